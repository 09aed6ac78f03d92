"""LFPS's fused one-token plan (`indexer/kernels/lfps.py`) on a GPU: its launch knobs swept at one
8B-shaped layer (benchmarks/gpu_decode.py's inputs and parameters), each variant checked to plan the
same positions as the default, timed as a CUDA-graph-replayed plan + triton attention step, plus a
per-kernel profile of the default.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_lfps_plan.py --lengths 131072
    python benchmarks/gpu_lfps_plan.py --device cpu --lengths 1024 --reps 1   # smoke run (interpreter)

Rows (JSON, $OUT/gpu_lfps_plan.json): n, cfg (the LfpsConfig fields that differ from the default),
graph_ms, same_plan (positions equal to the default's, as sets per row), profile (default only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_decode as gd  # noqa: E402
from benchmarks._gpu_timing import M_LOCAL, kernel_profile  # noqa: E402
from decoder.backends import get_backend  # noqa: E402
from indexer.base import PrefillCapture  # noqa: E402
from indexer.kernels import lfps as K  # noqa: E402
from synthetic import Mixture  # noqa: E402

SWEEP = [  # LfpsConfig variants (the default first)
    {}, {"score_mma": False}, {"score_tiles": 4, "score_stages": 3}, {"block_score": 128, "num_warps": 8},
    {"block_score": 128}, {"programs_per_sm": 8}, {"programs_per_sm": 16},
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    gd.DEV = a.device
    gd.T.device = a.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    be = get_backend("triton")
    with torch.inference_mode():
        for n in a.lengths:
            sp = gd.spec(1)
            mix = Mixture(sp, a.device, seed=0)
            q_all, k_all, v_all = gd.make_inputs(n, mix, seed=n)
            ctx_k, ctx_v = k_all[:, :n].contiguous(), v_all[:, :n].contiguous()
            loc_k, loc_v = k_all[:, n:].contiguous(), v_all[:, n:].contiguous()
            q = q_all[:, n + M_LOCAL - 1].reshape(gd.KVH, gd.G, 1, gd.D).contiguous()
            method, params = gd.method_params("lfps", None, 0.1)
            cap = PrefillCapture(q=q_all[None, :, :n], k=ctx_k[None], v=ctx_v[None],
                                 positions=torch.arange(n, device=a.device), spec=sp)
            arrays = {k: v.to(a.device) for k, v in method.build(cap, params).items()}
            ref = None
            for kw in SWEEP:
                K.DEFAULT_CONFIG = dataclasses.replace(K.LfpsConfig(), **kw)
                try:
                    req = gd.Request(ctx_k, ctx_v, loc_k, loc_v, q, arrays, method, params, 0, sp, be)
                    req.planner.fused = True
                    req.step()
                    pos = req.plan.positions
                    if ref is None:
                        ref = pos.clone()
                    same = gd.plan_agreement(pos, ref) == 1.0
                    ms, why = gd.T.graph_ms(req.step, reps=a.reps)
                    row = {"n": n, "cfg": kw, "graph_ms": ms, "graph": why, "same_plan": same}
                    if not kw and a.device == "cuda":
                        row["profile"] = kernel_profile(req.step, sync=gd.T.sync)
                except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
                    row = {"n": n, "cfg": kw, "error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append(row)
                got = row.get("error") or f"{row['graph_ms']} ms, same plan as the default: {row['same_plan']}"
                print(f"n={n} {json.dumps(kw):48s} {got}", flush=True)
            K.DEFAULT_CONFIG = K.LfpsConfig()
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu"}
    (out / "gpu_lfps_plan.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
