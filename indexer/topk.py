"""`topk`: exact top-K by attention score (the "Flat" oracle every top-K method is bounded by).

GQA pooling: a KV head's query group shares one selection. A key's score is the attention mass the
group puts on it, sum over the group's heads of softmax(q·k / sqrt(d)) over every visible token;
the K selectable context keys with the largest group mass are planned (the frame adds the sink, the
window and the request's own tokens). (Raw q·k is not comparable across heads whose logit scales
differ.) It reads every key: it is the reference, not a fast path.
"""

from __future__ import annotations

import torch
from pydantic import Field

from indexer.selection import bmm_f32, selectable_mask
from indexer.base import BudgetParams, Plan, Planner, SparseMethod, register
from indexer.kernels.select import topk_positions


class TopKParams(BudgetParams):
    k: int | None = Field(None, ge=1, le=1 << 22, description="context tokens selected per step; overrides ratio")
    ratio: float = Field(0.05, gt=0.0, le=1.0, description="fraction of the context selected per step")


def group_attention_mass(q: torch.Tensor, kv) -> torch.Tensor:
    """[KVH, G, T, D] queries -> [KVH, T, N + M] attention mass per position (causal: local slot j
    counts for query t iff N + j <= q_pos[t]). Scores in float32 arithmetic."""
    kvh, g, t, d = q.shape
    qf = q.reshape(kvh, g * t, d)
    loc_k = kv.loc_k.to(q.device)  # offload mode: the request's rows live on the GPU, the planner on the host
    s = torch.cat([bmm_f32(qf, kv.ctx_k.transpose(1, 2)), bmm_f32(qf, loc_k.transpose(1, 2))], dim=-1)
    s = s.view(kvh, g, t, -1) * d ** -0.5
    pos = torch.arange(s.shape[-1], device=q.device)
    s = s.masked_fill(pos[None, :] > kv.q_pos[:, None], float("-inf"))
    return torch.softmax(s, dim=-1).sum(dim=1)


class _ExactTopK(Planner):
    def __init__(self, params: TopKParams, n_ctx: int):
        self.k = params.budget(n_ctx)
        self.sink, self.window = params.frame(n_ctx)

    def plan(self, layer, q, kv):
        n = kv.n_ctx
        mass = group_attention_mass(q, kv)[..., :n]  # [KVH, T, N]
        mass = mass.masked_fill(~selectable_mask(kv.q_pos, n, self.sink, self.window)[None], float("-inf"))
        return Plan(topk_positions(mass, self.k))  # fused radix select on CUDA, torch.topk elsewhere


@register
class TopK(SparseMethod):
    name = "topk"
    Params = TopKParams

    def open(self, index, params, ctx):
        return _ExactTopK(params, ctx.n_ctx)
