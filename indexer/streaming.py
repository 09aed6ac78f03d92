"""`streaming` (StreamingLLM): attention sinks + a recent window only; the lower bound."""

from __future__ import annotations

import torch
from pydantic import Field

from indexer.base import MethodParams, MethodSession, SparseMethod, register


class StreamingParams(MethodParams):
    window: int = Field(256, ge=0, le=65536, description="most recent tokens always attended")


class _SinkWindow(MethodSession):
    def select(self, layer, q, kv):
        kvh, _, t, _ = q.shape
        return torch.empty(kvh, t, 0, dtype=torch.int64, device=q.device)  # sink + window come from the frame


@register
class Streaming(SparseMethod):
    name = "streaming"
    Params = StreamingParams

    def open(self, index, params, n_ctx, env=None):
        return _SinkWindow()
