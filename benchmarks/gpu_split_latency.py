"""Where the attention kernel's fixed cost goes: `decoder/kernels/attention.py`'s split kernel on a
frame-only step (sink 4, window 32, 64 request-local tokens: about 100 key rows per KV head, what
`streaming` attends) and on a psa-shaped plan (66 blocks of 32 tokens per KV head, with lengths),
over the `KernelConfig` knobs that shape one program's work (rows per chunk, warps, pipeline
stages), next to an empty Triton kernel on the same grid as the floor of a launch.

One Llama-3.1-8B layer at 128K (8 KV heads, group 4, head dim 128, bf16), B = 1. Per variant:
the kernels' device time (torch profiler, eager, back to back) and the graph replay with a cold
L2 (`_gpu_timing.Timing`), in one run, so the rows compare with each other.

    python benchmarks/gpu_split_latency.py            # on the device tool; JSON to $OUT
    ncu ... python benchmarks/gpu_split_latency.py --ncu  # the default config only, 5 calls each, untimed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._gpu_timing import BF, D, G, KVH, M_LOCAL, Timing, kernel_profile  # noqa: E402
from decoder.kernels.attention import KernelConfig, frame_attention, launch_plan, _sm_count  # noqa: E402

T = Timing()


@triton.jit
def _empty_kernel(OUT):
    tl.store(OUT + tl.program_id(0), 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--more", action="store_true", help="also sweep stages and programs per SM on the plan")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--ncu", action="store_true",
                    help="under a profiler: the default config on the frame, then on the plan, 5 calls each, no timing")
    a = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n = a.n
    ctx_k = torch.randn(KVH, n, D, device=dev, generator=gen, dtype=BF)
    ctx_v = torch.randn(KVH, n, D, device=dev, generator=gen, dtype=BF)
    loc_k = torch.randn(KVH, M_LOCAL, D, device=dev, generator=gen, dtype=BF)
    loc_v = torch.randn(KVH, M_LOCAL, D, device=dev, generator=gen, dtype=BF)
    q = torch.randn(KVH, G, 1, D, device=dev, generator=gen, dtype=BF)
    q_pos = torch.tensor([n + M_LOCAL - 1], device=dev)
    # a psa-shaped plan: 66 whole blocks of 32 tokens per KV head (16 % of a 410-block row), -1 after
    width, used = 410 * 32, 66
    blocks = torch.stack([torch.randperm(n // 32 - 8, device=dev, generator=gen)[:used] + 4 for _ in range(KVH)])
    pos = (blocks[:, :, None] * 32 + torch.arange(32, device=dev)).reshape(KVH, 1, used * 32).int()
    positions = torch.full((KVH, 1, width), -1, dtype=torch.int32, device=dev)
    positions[..., : used * 32] = pos
    lengths = torch.full((KVH, 1), used * 32, dtype=torch.int32, device=dev)
    frame_only = positions[..., :0]
    scale = D ** -0.5

    variants = [("frame", frame_only, None, KernelConfig(block_n=bn, num_warps=w, num_stages=s))
                for bn, w, s in [(128, 4, None), (128, 8, None), (64, 4, None), (64, 8, None), (32, 4, None),
                                 (32, 8, None), (64, 4, 1), (64, 4, 3), (128, 4, 1)]]
    variants += [("plan", positions, lengths, KernelConfig(block_n=bn, num_warps=w))
                 for bn, w in [(128, 4), (128, 8), (64, 4), (64, 8)]]
    if a.more:  # pipeline depth and the programs per SM on the plan too (session 21's sweep)
        variants += [("plan", positions, lengths, KernelConfig(block_n=bn, num_warps=w, num_stages=s, programs_per_sm=pps))
                     for bn, w, s, pps in [(128, 4, 1, 2), (128, 8, 1, 2), (64, 4, 1, 2), (64, 8, 1, 2), (32, 4, 1, 2),
                                           (32, 4, 2, 2), (64, 4, 2, 4), (64, 4, 1, 4), (32, 4, 1, 4), (128, 4, 2, 1),
                                           (128, 4, 2, 4)]]
    if a.ncu:  # for `ncu --kernel-name regex:_split_kernel`: frame calls 1-5, plan calls 6-10
        for p, ln in ((frame_only, None), (positions, lengths)):
            for _ in range(5):
                frame_attention(q, ctx_k, ctx_v, loc_k, loc_v, q_pos, p, 4, 32, scale, lengths=ln)
        torch.cuda.synchronize()
        return
    rows = []
    out_empty = torch.empty(KVH, device=dev)
    empty = lambda: _empty_kernel[(KVH,)](out_empty)  # noqa: E731
    prof = kernel_profile(empty)
    g_ms, why = T.graph_ms(empty, reps=a.reps)
    rows.append({"case": "empty_kernel", "grid": KVH, "device_us": prof["device_us_per_call"], "graph_ms": g_ms})
    print(f"empty kernel x{KVH}: {prof['device_us_per_call']:.2f} us device, graph {g_ms}", flush=True)
    ref = None
    for case, p, ln, cfg in variants:
        fn = lambda p=p, ln=ln, cfg=cfg: frame_attention(q, ctx_k, ctx_v, loc_k, loc_v, q_pos, p, 4, 32, scale,  # noqa: E731
                                                         lengths=ln, cfg=cfg)
        out = fn()
        lp = launch_plan(KVH, G, 1, D, 2, n, M_LOCAL, p.shape[-1], 4, 32, _sm_count(dev), cfg)
        if case == "plan":
            ref = out if ref is None else ref
            err = float((out.float() - ref.float()).norm() / ref.float().norm())
        else:
            err = None
        prof = kernel_profile(fn)
        g_ms, why = T.graph_ms(fn, reps=a.reps)
        row = {"case": case, "block_n": lp.block_n, "num_warps": lp.num_warps, "num_stages": lp.num_stages,
               "programs_per_sm": cfg.programs_per_sm, "splits": lp.splits, "chunks_per_split": lp.chunks_per_split, "device_us": prof["device_us_per_call"],
               "kernels": prof["top"], "graph_ms": g_ms, "graph": why, "rel_err_vs_first_plan_variant": err}
        rows.append(row)
        print(f"{case:5s} block_n {lp.block_n:3d} warps {lp.num_warps} stages {lp.num_stages} "
              f"pps {cfg.programs_per_sm} splits {lp.splits:3d}: "
              f"{prof['device_us_per_call']:6.2f} us device, graph {g_ms if g_ms is None else round(g_ms * 1e3, 1)} us"
              f"{'' if err is None else f' err {err:.1e}'}", flush=True)
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton.__version__, "device": torch.cuda.get_device_name(), "n": n}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_split_latency.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
