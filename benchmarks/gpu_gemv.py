"""Could a Triton GEMV beat cuBLAS on a decode step's projections? (one GPU, cold L2)

At B = 1 the 8B runner's projections are GEMVs: per layer QKV [6144 x 4096], O [4096 x 4096], gate/up
[28672 x 4096], down [4096 x 14336] (bf16 weights). On the H200 cuBLAS reads the small ones at
~3 TB/s, and it splits O and down over K with a second reduce kernel (benchmarks/RESULTS.md, "Where
a B = 1 token's time goes"). This script times F.linear against a plain split-K Triton GEMV (fp32
atomics into the output, or one program per output tile) over its block sizes, at M = 1 and 8
rows, each checked against F.linear. Not a test: numbers for a design decision. JSON to --out.

    python benchmarks/gpu_gemv.py --out $OUT/gemv
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._gpu_timing import kernel_profile  # noqa: E402
from indexer.kernels import interpreted  # noqa: E402,F401  (makes Triton 3.6's interpreter work with NumPy 2.4)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 ATOMIC: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr):
    """Y[M, N] (+)= X[M, K] @ W[N, K]^T over this program's K range; fp32 accumulation."""
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    k_lo = ps * k_per_split
    if DOT:
        acc = tl.zeros([BM, BN], tl.float32)
    else:
        acc = tl.zeros([BM, BN, BK], tl.float32)
    for k0 in tl.range(0, k_per_split, BK, num_stages=STAGES):
        k = k_lo + k0 + tl.arange(0, BK)
        w = tl.load(W + n[:, None].to(tl.int64) * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :],
                    other=0.0)  # [BN, BK]
        x = tl.load(X + m[:, None] * K + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)  # [BM, BK]
        if DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    if not DOT:
        out = tl.sum(acc, axis=2)
    else:
        out = acc
    ptr = Y + m[:, None] * N + n[None, :]
    msk = (m < M)[:, None] & (n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(ptr, out, mask=msk, sem="relaxed")
    else:
        tl.store(ptr, out, mask=msk)


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bn: int, bk: int, split: int, warps: int, stages: int):
    m, k = x.shape
    n = w.shape[0]
    kps = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, kps)
    if split > 1:
        y.zero_()
    dot = m > 1
    bm = 16 if dot else 1
    _gemv_kernel[(triton.cdiv(n, bn), split)](x, w, y, m, n, k, kps, BM=bm, BN=bn, BK=bk, ATOMIC=split > 1,
                                              DOT=dot, STAGES=stages, num_warps=warps)


VARIANTS = [(bn, bk, split, warps, stages) for bn, bk in ((16, 256), (32, 256), (16, 512), (32, 128), (64, 128))
            for split in (1, 2, 4) for warps in (4, 8) for stages in (3,)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
        for m in (1, 8):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x, w).float()
            y = torch.empty(m, n, device=dev, dtype=torch.float32)

            def cublas():
                flush.zero_()
                F.linear(x, w)

            prof = kernel_profile(cublas, reps=a.reps)
            base = sum(us for nm, _, us in prof["top"] if "elementwise" not in nm and "fill" not in nm.lower())
            row = {"shape": name, "m": m, "n": n, "k": k, "cublas_us": round(base, 2), "cublas_top": prof["top"][:4]}
            best = None
            for bn, bk, split, warps, stages in VARIANTS:
                try:
                    gemv(x, w, y, bn, bk, split, warps, stages)
                    err = float((y - ref).abs().max() / ref.abs().max())

                    def tri(bn=bn, bk=bk, split=split, warps=warps, stages=stages):
                        flush.zero_()
                        gemv(x, w, y, bn, bk, split, warps, stages)
                    p = kernel_profile(tri, reps=a.reps)
                    us = sum(u for nm, _, u in p["top"] if "_gemv_kernel" in nm)
                    v = {"bn": bn, "bk": bk, "split": split, "warps": warps, "stages": stages, "us": round(us, 2),
                         "err": err}
                except Exception as e:  # a variant that does not compile is reported, not fatal
                    v = {"bn": bn, "bk": bk, "split": split, "warps": warps, "stages": stages,
                         "error": f"{type(e).__name__}: {str(e)[:120]}"}
                row.setdefault("variants", []).append(v)
                if "us" in v and v["err"] < 1e-2 and (best is None or v["us"] < best["us"]):
                    best = v
            row["best"] = best
            rows.append(row)
            print(f"{name:8s} M={m}: cublas {base:7.2f} us ({n * k * 2 / base / 1e6:.2f} TB/s); best triton "
                  f"{best['us'] if best else '-'} us {best}", flush=True)
    with open(os.path.join(a.out, "gpu_gemv.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
