"""`full`: dense attention over every token (the reference every other method is compared with)."""

from __future__ import annotations

from indexer.base import MethodParams, MethodSession, SparseMethod, register


class _Dense(MethodSession):
    def select(self, layer, q, kv):
        return None


@register
class Full(SparseMethod):
    name = "full"
    Params = MethodParams

    def open(self, index, params, n_ctx, env=None):
        return _Dense()
