"""`topk`: exact top-K by attention score (the "Flat" oracle every top-K method is bounded by).

GQA pooling: a KV head's query group shares one selection. A key's score is the attention mass the
group puts on it, sum over the group's heads of softmax(q·k / sqrt(d)); the K keys with the largest
group mass are selected. (Raw q·k is not comparable across heads whose logit scales differ.)
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from indexer.base import MethodParams, MethodSession, SparseMethod, register


class TopKParams(MethodParams):
    k: int | None = Field(None, ge=1, le=1 << 22, description="tokens selected per step; overrides ratio")
    ratio: float = Field(0.05, gt=0.0, le=1.0, description="fraction of visible tokens selected per step")

    def budget(self, n_visible: int) -> int:
        k = self.k if self.k is not None else math.ceil(self.ratio * n_visible)
        return max(1, min(k, n_visible))


def group_attention_mass(q: torch.Tensor, kv) -> torch.Tensor:
    """[KVH, G, T, D] queries -> [KVH, T, N + M] attention mass per position (causal)."""
    scale = q.shape[-1] ** -0.5
    s = torch.cat(
        [torch.einsum("hgtd,hnd->hgtn", q, kv.ctx_k), torch.einsum("hgtd,hmd->hgtm", q, kv.loc_k)], dim=-1
    ) * scale
    pos = torch.arange(s.shape[-1], device=q.device)
    s = s.masked_fill(pos[None, :] > kv.q_pos[:, None], float("-inf"))
    return torch.softmax(s.float(), dim=-1).sum(dim=1)


class _ExactTopK(MethodSession):
    def __init__(self, params: TopKParams):
        self.params = params

    def select(self, layer, q, kv):
        mass = group_attention_mass(q, kv)  # [KVH, T, N + M]
        k = self.params.budget(int(kv.q_pos.max()) + 1)
        return torch.topk(mass, k, dim=-1, sorted=False).indices


@register
class TopK(SparseMethod):
    name = "topk"
    Params = TopKParams

    def open(self, index, params, n_ctx, env=None):
        return _ExactTopK(params)
