"""SAAP's plan on a GPU: the fused kernels (indexer/kernels/saap.py) against the torch path, one
Llama-3.1-8B-shaped layer, CUDA-graph-replayed; and plan + triton attention against SDPA full.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_saap_plan.py                      # 128K, C 1024, hidden 1024
    PYTHONUNBUFFERED=1 python benchmarks/gpu_saap_plan.py --lengths 32768 131072 --sweep
    python benchmarks/gpu_saap_plan.py --device cpu --lengths 4096 --clusters 64 --hidden 64 --steps 3
                                       # smoke run of the logic (Triton's interpreter, host clock)

Layer shape: 32 query heads, 8 KV heads (G 4), D 128, bf16 K/V and queries, RoPE theta 500000; a
request of 64 tokens (a static buffer), T = 1. Inputs as in benchmarks/gpu_decode.py: structured
(per KV head a mixture of 512 centres, Zipf 0.8, RoPE'd at their positions), and a synthetic SAAP
model in its on-disk format (tests/synthetic.py::write_saap_model: k-means on de-RoPE'd mixture
keys, the classifier at random init) with C = --clusters buckets and --hidden hidden units,
nprobe --nprobe (32). Layer 0 is SAAP's dense layer, so the planned layer is layer 1.

Planners compared (all on the same index):
  torch         the torch path, fp32 weights (the reference; ~90 kernels)
  torch_bf16w   the torch path on the bf16-rounded weights (what the kernels read)
  fused         the kernels, bf16 weights (the GPU default)
  fused_fp32w   the kernels, fp32 weights
Checks over --steps decode steps (query tokens n .. n + steps - 1): fused == torch_bf16w and
fused_fp32w == torch, position for position (exact unless the step has a near-tie at the edge of
the top-ℓ: the smallest edge gap of the scores is printed); fused vs torch (the bf16 rounding):
rows with the same planned keys, and their mean Jaccard; the stats of fused and torch_bf16w.
Timings (CUDA graph replay, median): each planner's plan, triton attention over the fused plan,
fused plan + triton attention, torch plan + triton attention, SDPA full over N + 64 keys;
per-kernel device time of the fused plan (torch.profiler). --sweep times PlanConfig variants
of the fused plan (each checked to plan the same positions).

Expected on an H100 at 128K (module docstring of indexer/kernels/saap.py): fused plan ~12-15 µs
(~20.5 MiB of weights and plan bytes: 6.4 µs at 3.35 TB/s, plus four dependent launches), fused
plan + triton attention ~35 µs against SDPA full ~0.23 ms; torch plan ~0.22 ms.

Rows (JSON, $OUT/gpu_saap_plan.json): info, per length the checks, the timings (ms) and the profile.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import traceback
from datetime import datetime, timezone
from pathlib import Path

_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--device", default="cuda")
if _pre.parse_known_args()[0].device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels on CPU tensors: Triton's interpreter

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import indexer.kernels  # noqa: E402,F401  (the interpreter's NumPy fix, before any kernel module)
from benchmarks._gpu_timing import BF, D, G, H, KVH, M_LOCAL, THETA, Timing, kernel_profile  # noqa: E402
from decoder.backends import backend_names, get_backend  # noqa: E402
from indexer.rope import apply_rope, undo_rope  # noqa: E402
from indexer.base import DecodeContext, IndexReader, KVView, PrefillCapture, get_method  # noqa: E402
from indexer.kernels import saap as K  # noqa: E402
from indexer.saap_model import SaapModel, bucket_scores  # noqa: E402
from synthetic import Mixture, llama8b_spec, write_saap_model  # noqa: E402

T = Timing("cuda")

SWEEP = [  # PlanConfig variants for --sweep (the default first)
    {},
    {"block_c": 8}, {"block_c": 32}, {"tile": 4096}, {"tile": 16384},  # _logits_kernel: its tile
    {"num_stages": 2}, {"num_stages": 4}, {"num_warps": 8},  # ... its pipelining, and every kernel's warps
    {"block_hidden": 8}, {"block_hidden": 32},  # _hidden_kernel
    {"block_rank": 16}, {"block_rank": 64}, {"block_j": 256}, {"rank_stages": 1},  # _rank_kernel
    {"block_plan": 512}, {"block_plan": 2048},  # _expand_kernel
    # combinations of the single-knob winners of the first sweep (tile 4096, block_j 256, rank_stages 1)
    {"tile": 4096, "block_j": 256, "rank_stages": 1},
    {"tile": 4096, "block_j": 512, "block_rank": 16, "rank_stages": 1},
    {"tile": 4096, "block_j": 1024, "block_rank": 8, "rank_stages": 1},
]


def edge_gap(score: torch.Tensor, p: int) -> float:
    if p >= score.shape[-1]:
        return float("inf")
    top = torch.topk(score.float(), p + 1, dim=-1).values
    return float((top[..., p - 1] - top[..., p]).min())


def row_sets(pos: torch.Tensor) -> list[set]:
    rows = pos.reshape(-1, pos.shape[-1]).cpu()
    return [set(r[r >= 0].tolist()) for r in rows]


def run_length(n: int, a, workdir: Path, dev: str) -> dict:
    out: dict = {"n": n, "clusters": a.clusters, "hidden": a.hidden, "nprobe": a.nprobe}
    sp = llama8b_spec(2)
    mix = Mixture(sp, dev, seed=0)
    g = torch.Generator(device=dev).manual_seed(n)
    pos = torch.arange(n + M_LOCAL, device=dev)
    k_all = apply_rope(mix.sample(n + M_LOCAL, g), pos, THETA).to(BF)
    v_all = torch.randn(KVH, n + M_LOCAL, D, device=dev, generator=g).to(BF)
    q_req = apply_rope(mix.sample(M_LOCAL, g, heads=H), pos[n:], THETA).to(BF)  # [H, M, D] the request's queries
    ctx_k, ctx_v = k_all[:, :n].contiguous(), v_all[:, :n].contiguous()
    loc_k, loc_v = k_all[:, n:].contiguous(), v_all[:, n:].contiguous()
    model_dir = workdir / f"saap-{a.clusters}-{a.hidden}"
    if not (model_dir / "manifest.json").exists():
        write_saap_model(model_dir, sp, mix, layers=[1], clusters=a.clusters, hidden=a.hidden,
                         sample=min(65536, max(4 * a.clusters, n)))
    method = get_method("saap")
    params = method.Params(model_dir=str(model_dir), nprobe=a.nprobe)
    cap = PrefillCapture(q=ctx_k[None].expand(2, -1, -1, -1), k=ctx_k[None].expand(2, -1, -1, -1),
                         v=ctx_v[None].expand(2, -1, -1, -1), positions=torch.arange(n, device=dev), spec=sp)
    arrays = {k: v.to(dev) for k, v in method.build(cap, params).items()}  # q is not read by saap's build
    reader = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    dctx = DecodeContext(n, sp, M_LOCAL)
    model = SaapModel.open(model_dir)
    planners = {name: method.open(reader, params, dctx) for name in ("torch", "torch_bf16w", "fused", "fused_fp32w")}
    planners["torch"].use_kernels = planners["torch_bf16w"].use_kernels = False
    planners["fused"].use_kernels = planners["fused_fp32w"].use_kernels = True
    planners["fused_fp32w"].kernel_weight_dtype = torch.float32
    w32 = model.layer(1, dev)
    wbf = {k: v.float() for k, v in model.kernel_layer(1, dev, BF).items()}
    planners["torch"]._w[1] = w32
    planners["torch_bf16w"]._w[1] = wbf
    fused = planners["fused"]
    sink, window = params.frame(n)
    width = fused.width[1]
    out["plan_width"] = width
    print(f"n={n}: C={a.clusters} hidden={a.hidden} nprobe={a.nprobe}, plan width K={width}, frame ({sink}, {window})",
          flush=True)

    def step_inputs(i: int):
        q = q_req[:, i].reshape(KVH, G, 1, D).contiguous()
        return q, KVView(ctx_k, ctx_v, loc_k, loc_v, torch.tensor([n + i], device=dev))

    # --- checks over the steps
    same_bf, same_32, rows_same, jac, gaps32, gapsbf, filled = 0, 0, 0, [], [], [], []
    for i in range(a.steps):
        q, kv = step_inputs(i)
        plans = {name: pl.plan(1, q, kv).positions for name, pl in planners.items()}
        qd = undo_rope(q.float(), kv.q_pos, THETA)
        gaps32.append(edge_gap(bucket_scores(qd, w32, "classifier"), fused.nprobe))
        gapsbf.append(edge_gap(bucket_scores(qd, wbf, "classifier"), fused.nprobe))
        same_bf += bool(torch.equal(plans["fused"], plans["torch_bf16w"]))
        same_32 += bool(torch.equal(plans["fused_fp32w"], plans["torch"]))
        for x, y in zip(row_sets(plans["fused"]), row_sets(plans["torch"])):
            rows_same += x == y
            jac.append(len(x & y) / max(1, len(x | y)))
        filled.append(float((plans["fused"] >= 0).float().mean()))
    n_rows = a.steps * KVH
    st = {name: pl.stats() for name, pl in planners.items()}
    out["checks"] = {
        "steps": a.steps,
        "fused_eq_torch_bf16w_steps": same_bf, "fused_fp32w_eq_torch_steps": same_32,
        "min_edge_gap_fp32w": min(gaps32), "min_edge_gap_bf16w": min(gapsbf),
        "bf16_vs_fp32_rows_same": rows_same / n_rows, "bf16_vs_fp32_mean_jaccard": sum(jac) / len(jac),
        "plan_filled": sum(filled) / len(filled),
        "stats_equal": st["fused"] == st["torch_bf16w"], "stats": {k: {kk: v[kk] for kk in ("selectivity_mean",
                                                                                         "largest_probed_bucket")}
                                                                   for k, v in st.items()},
    }
    print(f"  checks: fused == torch(bf16 weights) in {same_bf}/{a.steps} steps, fused(fp32 weights) == torch in "
          f"{same_32}/{a.steps}; min edge gap {min(gapsbf):.2e} (bf16 w) / {min(gaps32):.2e} (fp32 w); bf16 vs fp32 "
          f"weights: {rows_same}/{n_rows} rows the same keys, mean Jaccard {sum(jac) / len(jac):.4f}; "
          f"plan filled {out['checks']['plan_filled']:.3f}; stats equal {out['checks']['stats_equal']}", flush=True)

    # --- timings (graph replay; eager host time of the fused plan for reference)
    q, kv = step_inputs(M_LOCAL - 1)
    be = get_backend("triton") if "triton" in backend_names() else get_backend("torch_ref")
    scale = D ** -0.5
    fixed_plan = fused.plan(1, q, kv)
    qb = q.reshape(1, H, 1, D)
    kb, vb = k_all[None], v_all[None]
    fns = {f"plan_{name}": (lambda pl=pl: pl.plan(1, q, kv)) for name, pl in planners.items()}
    fns["attention_triton_over_fused_plan"] = lambda: be.run(q, kv, fixed_plan, sink, window, scale)
    fns["plan_fused+attention"] = lambda: be.run(q, kv, fused.plan(1, q, kv), sink, window, scale)
    fns["plan_torch+attention"] = lambda: be.run(q, kv, planners["torch"].plan(1, q, kv), sink, window, scale)
    fns["sdpa_full"] = lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
    times = {}
    for name, fn in fns.items():
        try:
            ms, why = T.graph_ms(fn, reps=a.reps)
            times[name] = {"graph_ms": ms, "graph": why, "eager_ms": T.host_ms(fn, reps=min(a.reps, 20))}
            g_txt = "-" if ms is None else f"{ms * 1e3:.1f} µs"
            print(f"  {name:34s} graph {g_txt:>10s}   eager {times[name]['eager_ms'] * 1e3:.1f} µs"
                  f"{'' if why == 'ok' else '  (' + why + ')'}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            times[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    out["times"] = times
    sd, fa = times.get("sdpa_full", {}).get("graph_ms"), times.get("plan_fused+attention", {}).get("graph_ms")
    if sd and fa:
        out["speedup_vs_sdpa_full"] = sd / fa
        print(f"  plan + triton attention {fa * 1e3:.1f} µs = {sd / fa:.2f}x faster than SDPA full ({sd * 1e3:.1f} µs)",
              flush=True)
    if dev == "cuda":
        for name in ("plan_fused", "plan_torch"):
            try:
                prof = kernel_profile(fns[name], reps=10, sync=T.sync)
                out[f"profile_{name}"] = prof
                print(f"  {name}: {prof['kernels_per_call']:.0f} kernels, "
                      f"{prof['device_us_per_call']:.1f} µs of device time; top: {prof['top'][:5]}", flush=True)
            except Exception as e:  # noqa: BLE001
                out[f"profile_{name}"] = {"error": f"{type(e).__name__}: {e}"[:200]}

    # --- sweep of the kernels' knobs (the fused plan alone)
    if a.sweep:
        w = model.kernel_layer(1, dev, BF)
        cos, sin = fused._rope
        order, offsets = arrays["order"][1], arrays["offsets"][1]
        rec = fused._rec_table(dev)
        ref_pos = None
        sweep = []
        for kw in SWEEP:
            cfg = K.PlanConfig(**kw)
            def fn(cfg=cfg):
                return K.saap_plan(q, kv.q_pos, n, cos, sin, w, order, offsets, fused.nprobe, width, sink, window,
                                   "classifier", rec, 0, cfg)
            try:
                got = fn().clone()
                ref_pos = got if ref_pos is None else ref_pos
                ms, why = T.graph_ms(fn, reps=a.reps)
                sweep.append({"cfg": kw, "graph_ms": ms, "same_plan": bool(torch.equal(got, ref_pos)), "graph": why})
                print(f"  sweep {json.dumps(kw):44s} {'-' if ms is None else f'{ms * 1e3:.1f} µs'}"
                      f"{'' if torch.equal(got, ref_pos) else '  PLAN DIFFERS'}", flush=True)
            except Exception as e:  # noqa: BLE001
                sweep.append({"cfg": kw, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"  sweep {json.dumps(kw)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        out["sweep"] = sweep
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072])
    ap.add_argument("--clusters", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16, help="decode steps checked (query tokens n .. n + steps - 1)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="time PlanConfig variants of the fused plan")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    a.steps = min(a.steps, M_LOCAL)
    T.device = a.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
            "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(info), flush=True)
    torch.set_num_threads(1)
    results = []
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        for n in a.lengths:
            try:
                results.append(run_length(n, a, Path(tmp), a.device))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                results.append({"n": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            (out / "gpu_saap_plan.json").write_text(json.dumps({"info": info, "results": results}, indent=1))
            if a.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
