"""`streaming` (StreamingLLM): attention sinks + a recent window only; the lower bound."""

from __future__ import annotations

import torch
from pydantic import Field

from indexer.base import MethodParams, Plan, Planner, SparseMethod, register


class StreamingParams(MethodParams):
    window: int = Field(256, ge=0, le=65536, description="most recent tokens always attended")


class _SinkWindow(Planner):
    reads_query = False

    def plan(self, layer, q, kv):
        kvh, _, t, _ = q.shape
        return Plan(torch.empty(kvh, t, 0, dtype=torch.int32, device=q.device))  # the frame is all there is


@register
class Streaming(SparseMethod):
    name = "streaming"
    Params = StreamingParams

    def open(self, index, params, ctx):
        return _SinkWindow()
