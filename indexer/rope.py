"""RoPE helpers: apply and undo rotary position embeddings (HF "rotate_half" convention).

Captured keys/queries are post-RoPE (what attention sees). Methods that cluster or classify
position-free vectors (SAAP) de-RoPE them with the positions and rope parameters recorded in the
manifest. Only the default (unscaled) RoPE is handled here; `validate_configuration` of such a
method should refuse other rope types.

It lives in the indexer layer because the methods need it and the decoder sits above them. The
decode runner's own RoPE (`decoder/layers.py`) is a different function on purpose: it takes the
model's rotary `inv_freq` and `attention_scaling` (scaled rope types) and rounds its angles in
fp32 exactly as the model's rotary module does, where this one computes default-RoPE angles from
`theta` in float64.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    # on the positions' device: decode de-RoPEs GPU queries (float64 is exact enough and cheap at [N, D/2])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [..., N, D] -> rotated by each token's position."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, x.dtype)
    return x * cos + _rotate_half(x) * sin


def undo_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Inverse of `apply_rope` (rotation by the negative angle)."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, x.dtype)
    return x * cos - _rotate_half(x) * sin
