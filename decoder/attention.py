"""Attention functions: the transformers hook, dense attention and sparse attention over a selection.

One attention implementation, `ctxcache`, is registered with transformers. What it does depends on
the keyword arguments the caller passed to `model(...)` (transformers forwards them to every
attention call):

* `ctx_capture=PrefillCapture`: plain causal SDPA, and the layer's post-RoPE Q/K/V are recorded.
* `ctx_step=DecodeStep`: attention over the persisted context KV (dense or a sparse selection)
  plus the request's own KV; see `decoder/generate.py`.
* neither: plain SDPA (so `generate()` on the same model object is the dense reference).

The mask function is registered under the same name (transformers would otherwise build no mask
for padded batches); the decode path ignores it and builds its own causal mask, since decode is
one sequence whose positions start after the context.

Shapes in comments: H query heads, KVH key/value heads, G = H // KVH, T query tokens, D head dim,
N context tokens, M request-local tokens (question + generated so far), K selected tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "ctxcache"
_REGISTERED = False


def register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _ctxcache_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _REGISTERED = True


def _sdpa(module, query, key, value, attention_mask, scaling):
    # query [B, H, T, D], key/value [B, KVH, S, D]
    t, s = query.shape[2], key.shape[2]
    if attention_mask is None and t > 1 and s != t:
        # a chunk after cached tokens: causal aligned to the end (SDPA's is_causal aligns to the start)
        attention_mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
    is_causal = attention_mask is None and t > 1
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous()  # [B, T, H, D]


def _ctxcache_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.get("ctx_step")
    if step is not None:
        return step.attend(module.layer_idx, query, key, value, scaling), None
    out = _sdpa(module, query, key, value, attention_mask, scaling)
    capture = kwargs.get("ctx_capture")
    if capture is not None:
        t = query.shape[2]
        capture.record(module.layer_idx, query, key[:, :, -t:], value[:, :, -t:])
    return out, None


# ---------------------------------------------------------------------------------------------
# Decode attention over context + request-local KV. Reference implementations in plain torch.


def dense_attention(
    q: torch.Tensor,  # [KVH, G, T, D]
    ctx_k: torch.Tensor,  # [KVH, N, D]
    ctx_v: torch.Tensor,  # [KVH, N, D]
    loc_k: torch.Tensor,  # [KVH, M, D]
    loc_v: torch.Tensor,  # [KVH, M, D]
    scaling: float,
) -> torch.Tensor:  # [KVH, G, T, D]
    """Every context token + the causal part of the request's own tokens (the last T are the queries)."""
    t, m = q.shape[2], loc_k.shape[1]
    s_ctx = torch.einsum("hgtd,hnd->hgtn", q, ctx_k) * scaling
    s_loc = torch.einsum("hgtd,hmd->hgtm", q, loc_k) * scaling
    # query t sits at local position m - t + t_idx; it sees local positions <= its own
    causal = torch.arange(m, device=q.device)[None, :] <= (m - t + torch.arange(t, device=q.device))[:, None]
    s_loc = s_loc.masked_fill(~causal, float("-inf"))
    p = torch.softmax(torch.cat([s_ctx, s_loc], dim=-1).float(), dim=-1).to(q.dtype)
    n = ctx_k.shape[1]
    return torch.einsum("hgtn,hnd->hgtd", p[..., :n], ctx_v) + torch.einsum("hgtm,hmd->hgtd", p[..., n:], loc_v)


def merge_selection(
    selected: torch.Tensor,  # [KVH, T, K] int64 positions in [0, N + M), -1 = empty slot
    q_pos: torch.Tensor,  # [T] absolute positions of the query tokens
    n_sink: int,
    window: int,
) -> torch.Tensor:  # [KVH, T, K'] sorted, deduplicated; -1 = empty slot
    """Union of sink, recent window (per query position) and the method's selection.

    Positions a query may not see (after it) are dropped. Fixed size K' = n_sink + window + K, so
    the result is a plain tensor (padding = -1), ready for a gather.
    """
    kvh, t, _ = selected.shape
    dev = selected.device
    sink = torch.arange(n_sink, device=dev).expand(kvh, t, n_sink)
    win = (q_pos[:, None] - torch.arange(window, device=dev)[None, :]).expand(kvh, t, window)
    idx = torch.cat([sink, win, selected], dim=-1)
    big = torch.iinfo(torch.int64).max
    idx = torch.where((idx < 0) | (idx > q_pos[None, :, None]), big, idx)
    idx, _ = torch.sort(idx, dim=-1)
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = torch.where(dup | (idx == big), -1, idx)
    # keep valid entries first (stable order), so trailing slots are padding
    order = torch.argsort((idx < 0).to(torch.int8), dim=-1, stable=True)
    return torch.gather(idx, -1, order)


def sparse_attention(
    q: torch.Tensor,  # [KVH, G, T, D]
    idx: torch.Tensor,  # [KVH, T, K] positions in [0, N + M), -1 = empty; already causal
    ctx_k: torch.Tensor,  # [KVH, N, D]
    ctx_v: torch.Tensor,
    loc_k: torch.Tensor,  # [KVH, M, D]
    loc_v: torch.Tensor,
    scaling: float,
) -> torch.Tensor:  # [KVH, G, T, D]
    """Exact attention restricted to the selected positions (context or request-local)."""
    n = ctx_k.shape[1]
    kvh = idx.shape[0]
    valid = idx >= 0
    heads = torch.arange(kvh, device=idx.device)[:, None, None].expand_as(idx)
    # gather only the selected rows: context rows by advanced indexing, then patch request-local ones
    k_sel = ctx_k[heads, idx.clamp(0, n - 1)]  # [KVH, T, K, D]
    v_sel = ctx_v[heads, idx.clamp(0, n - 1)]
    local = idx >= n
    if bool(local.any()):
        h_loc, p_loc = heads[local], idx[local] - n
        k_sel[local] = loc_k[h_loc, p_loc]
        v_sel[local] = loc_v[h_loc, p_loc]
    s = torch.einsum("hgtd,htkd->hgtk", q, k_sel) * scaling
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.einsum("hgtk,htkd->hgtd", p, v_sel)
