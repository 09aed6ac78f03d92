"""The decode runner's small per-layer ops as single Triton launches: RMSNorm (with the residual add
before it), RoPE of q and k read from the fused QKV projection, and SiLU(gate)·up.

Why: a graph-replayed one-token step of an 8B model ran ~41 kernels per layer, ~1,300 per token,
of which ~1,100 are small torch ops (RMSNorm as a cast, a square, a mean, an add, an rsqrt, two
multiplies and a cast; RoPE as a negation, a cat, two multiplies and an add, for q and for k; the
residual adds; SiLU and the multiply): about 2 ms of device time per token plus a launch gap each
(benchmarks/RESULTS.md, "End to end at 128K"). Here they are 4 launches per layer, and the RoPE
launch also writes the step's keys and values into the requests' local slots (`SlotRows`: what two
`index_copy_` per request and layer did; RESULTS.md, "Pipelined steps").

Same numbers as the torch functions in `decoder/runner.py` (the reference and the CPU path):
every torch op on bf16/fp16 tensors computes in fp32 and rounds its result to the tensor's dtype,
and the kernels round at the same places (the residual sum; the normalised row before the weight;
x·cos and rot·sin before their sum; SiLU before the multiply). What can differ: RMSNorm's sum of
squares is reduced in another order (fp32, ~1e-7 relative, so an output rounds to the neighbouring
bf16 value when it lies that close to a rounding midpoint), and `exp` / `rsqrt` are the GPU's
approximate instructions where torch calls the libm-grade ones (~1-2 ulp of fp32). RoPE and the
residual add are exact (tests/test_layer_kernels.py checks bit equality for them and a rounding
bound for the others, in fp32, fp16 and bf16).

Grids from shapes only (graph-capturable, no host sync); each call allocates its outputs, as the
torch functions do. Compiled without fp contraction (`enable_fp_fusion=False`): a fused
multiply-add would round x·cos + rot·sin once where torch rounds each product.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4
from indexer.kernels.ivf import _round_as  # fp32 -> dtype rounding (nearest even), also in the interpreter

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _rms_norm_kernel(X, RES, W, OUT, XOUT, C, sx, sr, so, sxo, eps, DT: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One row: x (+ res, rounded to DT -> XOUT), then w · (x · 1/sqrt(mean(x²) + eps)) with the
    normalised row rounded to DT before the weight (LlamaRMSNorm) -> OUT. Every value is rounded
    in fp32 (`_round_as`) and stored exactly."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < C
    xf = tl.load(X + row * sx + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        xf = _round_as(xf + tl.load(RES + row * sr + offs, mask=m, other=0.0).to(tl.float32), DT)
        tl.store(XOUT + row * sxo + offs, xf.to(DT), mask=m)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, 0) / C + eps))
    y = _round_as(xf * inv, DT)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + row * so + offs, _round_as(w * y, DT).to(DT), mask=m)


@triton.jit(do_not_specialize=["layer"])
def _rope_qk_kernel(QKV, COS, SIN, Q, K, BASE, ROFF, HST, sqkv, scs, sb, layer, H, KVH, D: tl.constexpr,
                    DT: tl.constexpr, SLOTS: tl.constexpr):
    """Program (row s, head j < H + KVH): head j of the QKV row, rotated (rotate-half):
    x·cos + rot(x)·sin, each product rounded to the dtype before the sum -> Q [S, H, D] or
    K [S, KVH, D]. SLOTS: a K head's program also stores the rotated key and the row's value of that
    head into the request-local K/V buffers: row s's layer `layer` buffers start at the addresses
    BASE[s, 0, layer] (keys) and BASE[s, 1, layer] (values), its slot row at element ROFF[s] of
    head 0, heads HST[s] elements apart."""
    s = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, HALF)
    src = QKV + s * sqkv + j * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    c1 = tl.load(COS + s * scs + i).to(tl.float32)
    c2 = tl.load(COS + s * scs + HALF + i).to(tl.float32)
    s1 = tl.load(SIN + s * scs + i).to(tl.float32)
    s2 = tl.load(SIN + s * scs + HALF + i).to(tl.float32)
    a1 = _round_as(x1 * c1, DT)
    a2 = _round_as(x2 * c2, DT)
    b1 = _round_as(-x2 * s1, DT)  # rot = [-x2, x1]
    b2 = _round_as(x1 * s2, DT)
    y1 = _round_as(a1 + b1, DT).to(DT)
    y2 = _round_as(a2 + b2, DT).to(DT)
    if j < H:
        dst = Q + (s * H + j) * D
    else:
        dst = K + (s * KVH + (j - H)) * D
    tl.store(dst + i, y1)
    tl.store(dst + HALF + i, y2)
    if SLOTS:
        if j >= H:
            off = tl.load(ROFF + s) + (j - H) * tl.load(HST + s)
            kdst = tl.load(BASE + s * sb + layer).to(tl.pointer_type(DT)) + off
            vdst = tl.load(BASE + s * sb + sb // 2 + layer).to(tl.pointer_type(DT)) + off
            tl.store(kdst + i, y1)
            tl.store(kdst + HALF + i, y2)
            vsrc = QKV + s * sqkv + (H + KVH + (j - H)) * D
            tl.store(vdst + i, tl.load(vsrc + i))
            tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i))


@triton.jit
def _silu_mul_kernel(GU, OUT, I, sgu, so, DT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block): silu(gate) rounded to the dtype, times up -> OUT [S, I]; GU [S, 2I]
    holds gate then up (the fused projection's output)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    gf = tl.load(GU + row * sgu + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * sgu + I + offs, mask=m, other=0.0).to(tl.float32)
    act = _round_as(tl.div_rn(gf, 1.0 + tl.exp(-gf)), DT)
    tl.store(OUT + row * so + offs, _round_as(act * u, DT).to(DT), mask=m)


def unsupported(x: torch.Tensor, head_dim: int | None = None) -> list[str]:
    """Reasons the fused layer ops cannot run for x (empty = fine); the runner then keeps torch."""
    reasons = []
    if x.device.type != "cuda" and not interpreted():
        reasons.append("the fused layer ops need CUDA tensors (or TRITON_INTERPRET=1)")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        reasons.append(f"dtype {x.dtype} is not supported by the fused layer ops")
    if head_dim is not None and (head_dim < 2 or head_dim & (head_dim - 1)):
        reasons.append(f"head_dim {head_dim} is not a power of two")
    if os.environ.get("CTXCACHE_FUSED_LAYER", "1") == "0":
        reasons.append("the fused layer ops are switched off (CTXCACHE_FUSED_LAYER=0)")
    return reasons


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, res: torch.Tensor | None = None):
    """x [S, C] (+ res [S, C]) -> RMSNorm of the sum [S, C]; with res also returns the sum (the new
    residual stream): (normed, x + res). `decoder.layers.rms_norm` (after `x + res`) in one launch."""
    s, c = x.shape
    out = torch.empty_like(x)
    xo = torch.empty_like(x) if res is not None else out
    _rms_norm_kernel[(s,)](
        x, res if res is not None else x, w, out, xo, c, x.stride(0), (res if res is not None else x).stride(0),
        out.stride(0), xo.stride(0), float(eps), DT=_TL[x.dtype], HAS_RES=res is not None, BLOCK=triton.next_power_of_2(c),
        num_warps=4 if c <= 2048 else 8, enable_fp_fusion=False,
    )
    return (out, xo) if res is not None else out


@dataclass
class SlotRows:
    """Where `rope_qk` also writes each row's key and value (a step's request-local slots):
    base [S, 2, L] int64: the addresses of the row's request's K (0) and V (1) buffers of each layer
    (each [KVH, M, D], contiguous); row_off [S] int64: the row's slot x D; head_stride [S] int64: M x D."""

    base: torch.Tensor
    row_off: torch.Tensor
    head_stride: torch.Tensor


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
            head_dim: int, slots: SlotRows | None = None, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [S, (H + 2 KVH) D] (rows of unit-stride heads), cos/sin [S, D] -> q [S, H, D], k [S, KVH, D]
    rotated: `decoder.layers.apply_rope` of the q and k parts in one launch. With `slots`, the same
    launch stores each row's rotated key and its value (the v part, unchanged) into its slot of
    `layer`'s request-local buffers: what `index_copy_` of k and v there would do."""
    s = qkv.shape[0]
    q = torch.empty(s, n_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(s, n_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    base, roff, hst = (slots.base, slots.row_off, slots.head_stride) if slots is not None else (k, k, k)
    _rope_qk_kernel[(s, n_heads + n_kv_heads)](qkv, cos, sin, q, k, base, roff, hst, qkv.stride(0), cos.stride(0),
                                               base.stride(0) if slots is not None else 0, layer, n_heads,
                                               n_kv_heads, D=head_dim, DT=_TL[qkv.dtype], SLOTS=slots is not None,
                                               num_warps=1, enable_fp_fusion=False)
    return q, k


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [S, 2I] (gate, then up) -> silu(gate) · up [S, I]."""
    s, two_i = gu.shape
    i = two_i // 2
    out = torch.empty(s, i, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(s, triton.cdiv(i, block))](gu, out, i, gu.stride(0), out.stride(0), DT=_TL[gu.dtype],
                                                 BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out


__all__ = ["SlotRows", "rms_norm", "rope_qk", "silu_mul", "unsupported"]
