"""The transformers attention hook: how ctxcache gets hold of every layer's attention call.

One attention implementation, `ctxcache`, is registered with transformers. What it does depends on
the keyword arguments the caller passed to `model(...)` (transformers forwards them to every
attention call):

* `ctx_capture=PrefillCapture`: plain causal SDPA, and the layer's post-RoPE Q/K/V are recorded.
* `ctx_step=DecodeStep`: the step's planner plans and an attention backend runs over the persisted
  context KV plus the request's own KV; see `decoder/generate.py` and `decoder/backends/`.
* neither: plain SDPA (so `generate()` on the same model object is the dense reference).

The mask function is registered under the same name (transformers would otherwise build no mask
for padded batches); the decode path ignores it and builds its own causal mask, since decode is
one sequence whose positions start after the context.

Shapes in comments: H query heads, KVH key/value heads, T query tokens, D head dim, S key tokens.
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
