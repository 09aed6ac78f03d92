"""The transformer layer's arithmetic as plain functions, for the decode runner
(`decoder/runner.py`; S = rows of the step: the sum over requests of their T): RMSNorm, the
model's RoPE, the SiLU-gated MLP. On CUDA the runner runs the small ones fused
(`decoder/kernels/layer.py`, the same roundings); these stay the reference and the CPU path.

This RoPE follows the model's rotary module: its `inv_freq` and `attention_scaling` (scaled rope
types included), angles in fp32. `indexer/rope.py` is the default RoPE from `theta` in float64,
which the methods use to de-RoPE captured vectors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decoder.weights import LayerWeights


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] -> [..., C]; LlamaRMSNorm's arithmetic (fp32 statistics, weight in x's dtype)."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [S] int -> cos, sin [S, D] in `dtype`; the rotary module's arithmetic (fp32 angles)."""
    freqs = pos[:, None].float() * inv_freq[None, :]  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, heads, D], cos/sin [S, D] -> [S, heads, D] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """x [S, C] -> [S, C]: down(silu(gate(x)) * up(x))."""
    gate, up = F.linear(x, lw.wgu, lw.bgu).chunk(2, dim=-1)  # [S, I] each
    return F.linear(F.silu(gate) * up, lw.wdown, lw.bdown)
