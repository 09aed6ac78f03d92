"""Can a sparse layer's latency-bound search hide the next projection's weight reads in L2?

At B = 1 a sparse decode step spends ~45 µs per 8B layer in a chain of small search and attention
kernels (benchmarks/RESULTS.md, "Where a B = 1 token's time goes") while the HBM is nearly idle,
then reads the 33.5 MB output projection from HBM (~11 µs at ~3 TB/s). This script measures, on one
GPU, whether that projection runs faster from L2 after a kernel touches its weight first, and what
the search's own traffic (plan rows' K/V, ~27-44 MB at 128K) does to it, with and without eviction
hints; and what splitting the fused QKV projection into q first and k/v after would cost. One JSON
row per variant under --out (benchmarks/results/). Not a test: numbers for a design decision.

    python benchmarks/gpu_l2_prefetch.py --out $OUT/l2
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

POLICIES = {"normal": 0, "first": 1, "last": 2}


@triton.jit
def _touch_kernel(X, SINK, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Read BLOCK elements of X per program (one float per program stored, so the loads stay)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVICT == 1:
        x = tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
    elif EVICT == 2:
        x = tl.load(X + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
    else:
        x = tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(SINK + pid, tl.sum(x.to(tl.float32), axis=0))


def touch(x: torch.Tensor, sink: torch.Tensor, policy: str, block: int = 8192) -> None:
    n = x.numel()
    grid = (triton.cdiv(n, block),)
    _touch_kernel[grid](x, sink, n, BLOCK=block, EVICT=POLICIES[policy], num_warps=8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    info = {"device": props.name, "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__,
            "triton": triton.__version__}
    print(json.dumps(info))
    bf = torch.bfloat16
    c = 4096
    w_o = torch.randn(c, c, device=dev, dtype=bf) / 64  # the 8B layer's o_proj: 33.5 MB
    w_qkv = torch.randn(6144, c, device=dev, dtype=bf) / 64  # fused q/k/v: 50 MB
    w_q, w_kv = w_qkv[:c].clone(), w_qkv[c:].clone()
    x = torch.randn(1, c, device=dev, dtype=bf)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    sink = torch.empty(1 << 16, device=dev)
    traffic = {mb: torch.randn(mb << 19, device=dev, dtype=bf) for mb in (16, 27, 44)}  # mb MB of bf16
    rows = []

    def gemm_us(fn) -> dict:
        prof = kernel_profile(fn, reps=a.reps)
        gemm = sum(us for name, _, us in prof["top"] if "nvjet" in name or "gemm" in name.lower() or "splitK" in name)
        return {"gemm_us": round(gemm, 2), "top": prof["top"][:6]}

    # 1. the projection's kernel time after a touch of its weight, with traffic in between
    for pf in ("none", "normal", "last"):
        for mb in (0, 16, 27, 44):
            for tp in (("normal", "first") if mb else ("-",)):
                def fn(pf=pf, mb=mb, tp=tp):
                    flush.zero_()
                    if pf != "none":
                        touch(w_o, sink, pf)
                    if mb:
                        touch(traffic[mb], sink, tp)
                    F.linear(x, w_o)
                r = {"test": "o_proj_after_touch", "prefetch": pf, "traffic_mb": mb, "traffic_policy": tp, **gemm_us(fn)}
                rows.append(r)
                print(f"o_proj after touch={pf:6s} traffic={mb:2d} MB ({tp:6s}): {r['gemm_us']:7.2f} us")

    # 2. a latency-bound chain (sleep kernels, then the traffic) with the touch on a side stream, in one graph
    side = torch.cuda.Stream(dev)
    starts, ends = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for mb, tp in ((0, "-"), (27, "first"), (27, "normal")):
        for pf in ("none", "normal", "last"):
            def step(pf=pf, mb=mb, tp=tp):
                if pf != "none":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        touch(w_o, sink, pf)
                for _ in range(6):
                    torch.cuda._sleep(13000)  # ~6 small dependent kernels, ~40 µs in all
                if mb:
                    touch(traffic[mb], sink, tp)
                if pf != "none":
                    torch.cuda.current_stream().wait_stream(side)
                F.linear(x, w_o)
            g = torch.cuda.CUDAGraph()
            s0 = torch.cuda.Stream(dev)
            s0.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s0):
                step()
                step()
            torch.cuda.current_stream().wait_stream(s0)
            with torch.cuda.graph(g):
                step()
            ts = []
            for _ in range(a.reps + 3):
                flush.zero_()
                starts.record()
                g.replay()
                ends.record()
                torch.cuda.synchronize()
                ts.append(starts.elapsed_time(ends) * 1e3)
            ts = sorted(ts[3:])
            r = {"test": "graph_chain_then_o_proj", "prefetch": pf, "traffic_mb": mb, "traffic_policy": tp,
                 "graph_us_median": round(ts[len(ts) // 2], 2), "graph_us_min": round(ts[0], 2)}
            rows.append(r)
            print(f"graph chain + o_proj, touch={pf:6s} traffic={mb:2d} ({tp:6s}): {r['graph_us_median']:7.2f} us "
                  f"(min {r['graph_us_min']:.2f})")

    # 3. the fused qkv projection against q alone and k/v alone (cold L2)
    for name, fn in (("qkv", lambda: (flush.zero_(), F.linear(x, w_qkv))),
                     ("q", lambda: (flush.zero_(), F.linear(x, w_q))),
                     ("kv", lambda: (flush.zero_(), F.linear(x, w_kv))),
                     ("o", lambda: (flush.zero_(), F.linear(x, w_o)))):
        r = {"test": "projection_cold", "projection": name, **gemm_us(fn)}
        rows.append(r)
        print(f"projection {name:4s} cold: {r['gemm_us']:7.2f} us")

    with open(os.path.join(a.out, "gpu_l2_prefetch.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
