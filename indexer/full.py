"""`full`: dense attention over every token (the reference every other method is compared with)."""

from __future__ import annotations

from indexer.base import MethodParams, Plan, Planner, SparseMethod, register


class _Dense(Planner):
    reads_query = False

    def plan(self, layer, q, kv):
        return Plan.dense()


@register
class Full(SparseMethod):
    name = "full"
    Params = MethodParams

    def open(self, index, params, ctx):
        return _Dense()
