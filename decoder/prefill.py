"""Prefill: run the model over a context in chunks and capture every layer's post-RoPE Q/K/V."""

from __future__ import annotations

from collections.abc import Callable

import torch

from indexer.base import PrefillCapture


class _CaptureBuffer:
    """Preallocated [L, heads, N, D] buffers filled chunk by chunk from the attention hook."""

    def __init__(self, spec, n: int, dtype: torch.dtype, keep_q: bool):
        l, d = spec.num_layers, spec.head_dim
        self.q = torch.empty(l, spec.num_heads, n, d, dtype=dtype) if keep_q else None
        self.k = torch.empty(l, spec.num_kv_heads, n, d, dtype=dtype)
        self.v = torch.empty(l, spec.num_kv_heads, n, d, dtype=dtype)
        self.offset = 0

    def record(self, layer: int, q, k, v) -> None:  # q [1, H, T, D], k/v [1, KVH, T, D]
        t, o = k.shape[2], self.offset
        if self.q is not None:
            self.q[layer, :, o:o + t] = q[0].to("cpu", self.q.dtype)
        self.k[layer, :, o:o + t] = k[0].to("cpu", self.k.dtype)
        self.v[layer, :, o:o + t] = v[0].to("cpu", self.v.dtype)


@torch.inference_mode()
def prefill(
    lm,
    token_ids: list[int],
    *,
    chunk_tokens: int = 512,
    keep_q: bool = True,
    progress: Callable[[float], None] | None = None,
) -> PrefillCapture:
    """Forward the context once (chunked, with a KV cache between chunks) and return the capture.

    Chunking bounds activation memory and gives progress; each chunk attends to all earlier tokens,
    so the captured K/V are those of one causal pass over the whole context.
    """
    from transformers import DynamicCache

    model, spec = lm.model, lm.spec
    device = next(model.parameters()).device
    n = len(token_ids)
    buf = _CaptureBuffer(spec, n, model.dtype, keep_q)
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    for start in range(0, n, chunk_tokens):
        end = min(n, start + chunk_tokens)
        buf.offset = start
        model(
            input_ids=ids[:, start:end],
            position_ids=torch.arange(start, end, device=device)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            ctx_capture=buf,
        )
        if progress is not None:
            progress(end / n)
    return PrefillCapture(q=buf.q, k=buf.k, v=buf.v, positions=torch.arange(n), spec=spec)
