"""Sampling of the decode runner's next tokens on the device (`decoder/runner.py`).

Temperature 0 = greedy (argmax of the fp32 logits, as `decoder.generate`). Temperature > 0 =
Gumbel-max with counter-based noise: token = argmax(logits / T + g), g_i = -log(-log(u_i)), u_i a
32-bit integer hash of (seed, the token's absolute position, i). That is an exact draw from
softmax(logits / T), reproducible for a seed whatever the batch and whether the step was replayed
from a CUDA graph or not, and needs no generator state (graph-safe). It is *not* the stream
`generate`'s `torch.multinomial` draws for the same seed.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensors holding uint32 values; no int64 overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """seed, pos [B] int64 -> [B, V] fp32 standard Gumbel noise, a pure function of (seed, pos, i)."""
    key = _mix32((seed & _MASK32) ^ _mix32(pos & _MASK32))  # [B]
    bits = _mix32((key[:, None] + torch.arange(vocab, device=seed.device)[None, :]) & _MASK32) >> 9  # [B, V] 23 bits
    u = (bits.float() + 0.5) * 2.0 ** -23  # in (0, 1), exactly representable
    return -torch.log(-torch.log(u))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor,
                  hot: bool) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] int64. Greedy where temperature is 0; Gumbel-max over
    logits / temperature elsewhere (`hot`: a host flag, True when any row samples)."""
    greedy = logits.argmax(-1)  # first maximum, as torch.argmax in generate()
    if not hot:
        return greedy
    g = gumbel_noise(seed, pos, logits.shape[-1])
    drawn = (logits / temperature.clamp_min(1e-6)[:, None] + g).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)
