"""`torch_ref`: exact attention over frame ∪ plan in plain torch, float32 arithmetic.

The reference every other backend is tested against (and the CPU path). Fixed shapes, no host
sync: the sink, window and plan rows are gathered as one [KVH, T, R] block with a validity mask
(`frame_rows`), the request-local rows are attended with a causal mask from q_pos, and one
softmax runs over [context rows ; local rows ; optional pseudo-token].

Shapes: KVH kv heads, G query heads per kv head, T query tokens, D head dim, N context tokens,
M request-local slots, R = sink + window + K gathered context rows.
"""

from __future__ import annotations

import torch

from decoder.backends import AttentionBackend, frame_rows, local_visible, register_backend
from indexer.selection import bmm_f32, gather_rows
from indexer.base import KVView, Plan

NEG_INF = float("-inf")


def dense_attention(q: torch.Tensor, kv: KVView, scale: float) -> torch.Tensor:
    """Every context token + the request-local tokens each query may see. q [KVH, G, T, D].
    Scores and the softmax in float32; on a GPU the context's bf16/fp16 K/V are read in place
    (`bmm_f32`) rather than copied to float32 when q has their dtype. K/V stored in another dtype
    than the model's (`kv_dtype` bfloat16 under a float32 model) are upcast one layer at a time
    for the step, never rounding q; the tiers keep them in their stored dtype."""
    kvh, g, t, d = q.shape
    qf = q.reshape(kvh, g * t, d)
    s_ctx = bmm_f32(qf, kv.ctx_k.transpose(1, 2)).view(kvh, g, t, -1) * scale
    s_loc = bmm_f32(qf, kv.loc_k.transpose(1, 2)).view(kvh, g, t, -1) * scale
    s_loc = s_loc.masked_fill(~local_visible(kv.q_pos, kv.n_ctx, kv.loc_k.shape[1])[None, None], NEG_INF)
    p = torch.softmax(torch.cat([s_ctx, s_loc], dim=-1), dim=-1).view(kvh, g * t, -1)
    n = kv.n_ctx
    p_v = p if kv.ctx_v.dtype == torch.float32 or not q.is_cuda else p.to(kv.ctx_v.dtype)
    out = bmm_f32(p_v[..., :n], kv.ctx_v) + bmm_f32(p_v[..., n:], kv.loc_v)
    return out.view(kvh, g, t, d).to(q.dtype)


def attend_rows(
    q: torch.Tensor,  # [KVH, G, T, D]
    k_rows: torch.Tensor,  # [KVH, T, R, D] gathered context rows (frame + plan)
    v_rows: torch.Tensor,
    ok: torch.Tensor,  # [KVH, T, R] bool
    n_frame: int,  # the first n_frame rows are the sink + window (never bypassed)
    kv: KVView,  # for the request-local rows and q_pos (ctx_k/ctx_v are not read)
    plan: Plan,
    scale: float,
) -> torch.Tensor:  # [KVH, G, T, D]
    """Attention over gathered context rows + the visible request-local rows (+ the plan's
    pseudo-token). Shared by `torch_ref` and `offload` (which gathers the rows on the host)."""
    kvh, g, t, d = q.shape
    qf = q.float()
    s_ctx = torch.einsum("hgtd,htrd->hgtr", qf, k_rows.float()) * scale
    okg = ok[:, None].expand(kvh, g, t, -1)
    if plan.bypass is not None:
        okg = okg.clone()
        okg[..., n_frame:] &= ~plan.bypass.to(okg.device)[..., None]
    s_ctx = s_ctx.masked_fill(~okg, NEG_INF)
    s_loc = torch.einsum("hgtd,hmd->hgtm", qf, kv.loc_k.float()) * scale
    s_loc = s_loc.masked_fill(~local_visible(kv.q_pos, kv.n_ctx, kv.loc_k.shape[1])[None, None], NEG_INF)
    parts = [s_ctx, s_loc]
    if plan.rest_logit is not None:
        parts.append(plan.rest_logit.to(s_ctx.device, torch.float32)[..., None])
    p = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    r, m = s_ctx.shape[-1], s_loc.shape[-1]
    out = torch.einsum("hgtr,htrd->hgtd", p[..., :r], v_rows.float())
    out = out + torch.einsum("hgtm,hmd->hgtd", p[..., r:r + m], kv.loc_v.float())
    if plan.rest_logit is not None:
        out = out + p[..., r + m:] * plan.rest_value.to(out.device, torch.float32)[:, None, None, :]
    return out.to(q.dtype)


@register_backend
class TorchRef(AttentionBackend):
    name = "torch_ref"

    def run(self, q, kv, plan, sink, window, scale):
        if plan.is_dense:
            return dense_attention(q, kv, scale)
        kvh, _, t, d = q.shape
        rows, ok, nf = frame_rows(plan.positions, kv.q_pos, kv.n_ctx, kvh, sink, window)
        flat = rows.reshape(kvh, -1)
        k_rows = gather_rows(kv.ctx_k, flat).view(kvh, t, -1, d)
        v_rows = gather_rows(kv.ctx_v, flat).view(kvh, t, -1, d)
        return attend_rows(q, k_rows, v_rows, ok, nf, kv, plan, scale)
