"""The fused IVF plans (indexer/kernels/ivf.py) against the torch plans they replace, on a GPU: one
Llama-3.1-8B-shaped layer (32 query heads, 8 KV heads, head dim 128, bf16), CUDA-graph replayed.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_ivf.py                     # 32K and 128K, ctkvr + kivf
    python benchmarks/gpu_ivf.py --methods ctkvr --lengths 131072 --profile
    python benchmarks/gpu_ivf.py --device cpu --lengths 2048 --k 64 --list-size 128 --kivf-ratio 0.01 \\
        --layers 1 --steps 2 --methods ctkvr kivf                      # smoke run of the logic (interpreter)

Inputs as benchmarks/gpu_decode.py: per KV head, RoPE'd keys and queries from one Zipf mixture of
512 centres (so lists overlap and selections mean something), Gaussian values, 64 request tokens in
a 64-slot buffer, the step's query the request's last token (T = 1). Methods at their
gpu_decode.py operating points: ctkvr k = 1024, lists of 2560, probe 4, C = min(2048, N / 16), FIFO
64 (the CTkvr paper's point); kivf ratio 0.05 (k = 6554 at 128K), nprobe from scan 4.

Per length and method:
* agreement: a torch planner (`fused = False`) and a fused one (`fused = True`) step in lockstep
  over `--steps` decode steps (query j = request token 64 - steps + j, CTkvr's update after each);
  per step the fraction of plan rows with the same position set, the mean Jaccard of the rows, and
  (CTkvr) whether the FIFO rings hold the same lists. Expected: identical, up to rows where two
  candidates' masses tie within rounding at the k-th place, or bf16 cosines tie at the probe's P-th
  place (the kernel takes the lowest entry id, torch.topk an unspecified one).
* timing (median of CUDA-event-timed graph replays): one graph holds the step for `--layers` layer
  copies (distinct memory for the index and K/V, so a layer's 17 MB of centroids and its gathered
  rows are not L2-resident from the previous replay, as in a real multi-layer step); reported per
  layer: plan (torch / fused), update (torch / fused, CTkvr), plan + triton attention (torch plan /
  fused plan), the triton attention alone over the fused plan, and SDPA full over N + 64 keys.
* `--profile`: kernels per plan and their summed device time (torch profiler, eager).
* `--sweep`: the fused CTkvr plan's graph time under each launch knob of `ivf.IvfConfig` varied one
  at a time around the defaults (block sizes, warps); pick the best and set them as the defaults.

Rows (JSON, $OUT/gpu_ivf.json or benchmarks/results/gpu_ivf.json): n, method, what, ms (per layer),
ratio_vs_sdpa where it applies; agreement rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._gpu_timing import BF, D, G, H, KVH, M_LOCAL, THETA, Timing, kernel_profile  # noqa: E402
from indexer.rope import apply_rope  # noqa: E402
from indexer.base import DecodeContext, IndexReader, KVView, PrefillCapture, get_method  # noqa: E402
from synthetic import Mixture, llama8b_spec  # noqa: E402



def make_inputs(n: int, mix: Mixture, seed: int, dev: str):
    """q [H, N + M, D], k / v [KVH, N + M, D] bf16: context then the request's tokens."""
    g = torch.Generator(device=dev).manual_seed(seed)
    pos = torch.arange(n + M_LOCAL, device=dev)
    k = apply_rope(mix.sample(n + M_LOCAL, g), pos, THETA).to(BF)
    q = apply_rope(mix.sample(n + M_LOCAL, g, heads=H), pos, THETA).to(BF)
    v = torch.randn(KVH, n + M_LOCAL, D, device=dev, generator=g).to(BF)
    return q, k, v


def method_params(name: str, args):
    m = get_method(name)
    if name == "ctkvr":
        return m, m.Params(k=args.k, list_size=args.list_size)
    return m, m.Params(ratio=args.kivf_ratio)


class Layers:
    """`count` layer copies of one layer's context K/V and index arrays, at distinct addresses."""

    def __init__(self, count: int, ctx_k, ctx_v, loc_k, loc_v, arrays: dict):
        self.count = count
        self.ctx_k = [ctx_k if i == 0 else ctx_k.clone() for i in range(count)]
        self.ctx_v = [ctx_v if i == 0 else ctx_v.clone() for i in range(count)]
        self.loc_k, self.loc_v = loc_k, loc_v
        self.arrays = {name: torch.stack([a[0]] * count).contiguous() for name, a in arrays.items()}

    def reader(self) -> IndexReader:
        return IndexReader(lambda name, layer: self.arrays[name][layer], sorted(self.arrays))

    def view(self, layer: int, q_pos: torch.Tensor) -> KVView:
        return KVView(self.ctx_k[layer], self.ctx_v[layer], self.loc_k, self.loc_v, q_pos)


def row_sets(pos: torch.Tensor) -> list[set[int]]:
    return [set(x for x in row if x >= 0) for row in pos.reshape(-1, pos.shape[-1]).tolist()]


def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    sa, sb = row_sets(a), row_sets(b)
    same = sum(x == y for x, y in zip(sa, sb)) / len(sa)
    jac = sum(len(x & y) / max(1, len(x | y)) for x, y in zip(sa, sb)) / len(sa)
    return same, jac


def sdpa_ms(q_last, k_all, v_all, timing: Timing, args, dev: str) -> float | None:
    """SDPA full over N + 64 keys per layer, one call per layer copy (distinct K/V memory)."""
    kf = [k_all[None].clone() for _ in range(args.layers)]
    vf = [v_all[None].clone() for _ in range(args.layers)]
    qf = q_last.reshape(1, H, 1, D)

    def sdpa():
        for i in range(args.layers):
            F.scaled_dot_product_attention(qf, kf[i], vf[i], enable_gqa=True)

    ms = timing.graph_ms(sdpa, reps=args.reps)[0] if dev == "cuda" else timing.host_ms(sdpa, reps=args.reps)
    return None if ms is None else ms / args.layers


def check_agreement(n, name, method, params, layers: Layers, ctx, q_all, args, dev) -> list[dict]:
    """A torch and a fused planner in lockstep over decode steps on layer 0 (CTkvr updates too)."""
    rows = []
    ref, fused = method.open(layers.reader(), params, ctx), method.open(layers.reader(), params, ctx)
    ref.fused, fused.fused = False, True
    for s in range(args.steps):
        j = M_LOCAL - args.steps + s
        q = q_all[:, n + j].reshape(KVH, G, 1, D).contiguous()
        kv = layers.view(0, torch.tensor([n + j], device=dev))
        a, b = ref.plan(0, q, kv).positions, fused.plan(0, q, kv).positions
        same, jac = agreement(a, b)
        row = {"n": n, "method": name, "what": "agreement", "step": s, "rows_same": same, "jaccard": jac,
               "plan_k": int(a.shape[-1]), "filled": float((b >= 0).float().mean())}
        ref.update(0, None, None, kv.q_pos)
        fused.update(0, None, None, kv.q_pos)
        if name == "ctkvr" and params.fifo:
            fr, ff = ref.fifo[0], fused.fifo[0]
            row["fifo_same"] = bool(torch.equal(fr.pushes, ff.pushes)) and bool(
                torch.equal(fr.lists.sort(-1).values, ff.lists.sort(-1).values))
        rows.append(row)
        print(f"    step {s}: rows with the same set {same:.3f}, jaccard {jac:.4f}"
              f"{'' if 'fifo_same' not in row else ', fifo same ' + str(row['fifo_same'])}", flush=True)
    if name == "ctkvr":
        st_ref, st_fused = ref.stats(), fused.stats()
        rows.append({"n": n, "method": name, "what": "stats", "torch": st_ref, "fused": st_fused})
        print(f"    stats torch {st_ref} fused {st_fused}", flush=True)
    return rows


def time_steps(n, name, method, params, layers: Layers, ctx, q_last, q_pos_last, t_sdpa, timing: Timing, args,
               dev) -> list[dict]:
    """Graph-replayed plan / update / plan + attention over every layer copy, per layer."""
    rows = []
    sink, window = params.frame(n)
    scale = D ** -0.5
    backend = None
    if dev == "cuda":
        from decoder.backends import get_backend

        backend = get_backend("triton")
    planners = {"torch": method.open(layers.reader(), params, ctx), "fused": method.open(layers.reader(), params, ctx)}
    planners["torch"].fused, planners["fused"].fused = False, True
    views = [layers.view(i, q_pos_last) for i in range(args.layers)]
    plans = {}

    def plan_fn(kind):
        def fn():
            p = planners[kind]
            plans[kind] = [p.plan(i, q_last, views[i]) for i in range(args.layers)]
        return fn

    def update_fn(kind, pending):
        def fn():  # the same pending push committed again at every call (and replay)
            p = planners[kind]
            for i in range(args.layers):
                p._pending[i] = pending[i]
                p.update(i, None, None, q_pos_last)
        return fn

    def step_fn(kind):
        def fn():
            p = planners[kind]
            for i in range(args.layers):
                backend.run(q_last, views[i], p.plan(i, q_last, views[i]), sink, window, scale)
        return fn

    def attn_only():
        for i in range(args.layers):
            backend.run(q_last, views[i], plans["fused"][i], sink, window, scale)

    def timed(fn):
        if dev != "cuda":
            return timing.host_ms(fn, reps=args.reps), "host clock (no CUDA)"
        return timing.graph_ms(fn, reps=args.reps)

    results = {}
    for kind in ("torch", "fused"):
        results[f"plan_{kind}"] = timed(plan_fn(kind))
        if name == "ctkvr" and params.fifo:
            for i in range(args.layers):  # a pending push for every layer
                planners[kind].plan(i, q_last, views[i])
            results[f"update_{kind}"] = timed(update_fn(kind, dict(planners[kind]._pending)))
        if backend is not None:
            results[f"plan_attention_{kind}"] = timed(step_fn(kind))
    if backend is not None:
        plan_fn("fused")()
        results["attention_fused_plan"] = timed(attn_only)
    for what, (ms, why) in results.items():
        per = None if ms is None else ms / args.layers
        rows.append({"n": n, "method": name, "what": what, "ms": per, "graph": why,
                     "ratio_vs_sdpa": None if per is None or t_sdpa is None else t_sdpa / per})
        print(f"    {what:24s} {'-' if per is None else f'{per * 1e3:8.1f} us'}"
              f"{'' if per is None or t_sdpa is None else f'  ({t_sdpa / per:.2f}x SDPA full)'}"
              f"{'' if why == 'ok' else '  [' + why + ']'}", flush=True)
    if args.profile and dev == "cuda":
        for kind in ("torch", "fused"):
            p = planners[kind]
            prof = kernel_profile(lambda: p.plan(0, q_last, views[0]), sync=timing.sync)
            rows.append({"n": n, "method": name, "what": f"profile_plan_{kind}", **prof})
            print(f"    profile plan {kind}: {prof['kernels_per_call']:.0f} kernels, "
                  f"{prof['device_us_per_call']:.1f} us device time; top {prof['top'][:4]}", flush=True)
    if args.sweep and name == "ctkvr":
        rows += sweep(n, planners["fused"], views, q_last, timing, args)
    return rows


def run_method(n, name, args, q_all, ctx_k, ctx_v, loc_k, loc_v, q_last, q_pos_last, t_sdpa, timing, dev):
    method, params = method_params(name, args)
    cap = PrefillCapture(q=q_all[None, :, :n], k=ctx_k[None], v=ctx_v[None], positions=torch.arange(n, device=dev),
                         spec=llama8b_spec(1))
    arrays = {k: v.to(dev) for k, v in method.build(cap, params).items()}
    layers = Layers(args.layers, ctx_k, ctx_v, loc_k, loc_v, arrays)
    del arrays  # Layers holds its own stacked copies
    ctx = DecodeContext(n, llama8b_spec(args.layers), M_LOCAL)
    info = {k: tuple(v.shape) for k, v in layers.arrays.items()}
    print(f"  {name}: {params.model_dump(exclude_none=True)} index {info}", flush=True)
    rows = check_agreement(n, name, method, params, layers, ctx, q_all, args, dev)
    rows += time_steps(n, name, method, params, layers, ctx, q_last, q_pos_last, t_sdpa, timing, args, dev)
    return rows


def run_length(n: int, args, timing: Timing, dev: str) -> list[dict]:
    mix = Mixture(llama8b_spec(1), dev, seed=0)
    q_all, k_all, v_all = make_inputs(n, mix, seed=n, dev=dev)
    ctx_k, ctx_v = k_all[:, :n].contiguous(), v_all[:, :n].contiguous()
    loc_k, loc_v = k_all[:, n:].contiguous(), v_all[:, n:].contiguous()
    q_pos_last = torch.tensor([n + M_LOCAL - 1], device=dev)
    q_last = q_all[:, n + M_LOCAL - 1].reshape(KVH, G, 1, D).contiguous()
    t_sdpa = sdpa_ms(q_last, k_all, v_all, timing, args, dev)
    rows = [{"n": n, "method": "sdpa_full", "what": "attention", "ms": t_sdpa}]
    print(f"n={n}: SDPA full {t_sdpa} ms per layer", flush=True)
    for name in args.methods:
        rows += run_method(n, name, args, q_all, ctx_k, ctx_v, loc_k, loc_v, q_last, q_pos_last, t_sdpa, timing, dev)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


SWEEP = {  # IvfConfig field -> values tried (the others at their defaults)
    "block_c": [32, 128], "probe_warps": [8], "block_u": [32, 128], "rerank_warps": [8],
    "chunks_per_prog": [2, 4], "select_block": [1024, 4096], "select_warps": [4, 16],
}


def sweep(n: int, planner, views, q, timing: Timing, args) -> list[dict]:
    import dataclasses

    from indexer.kernels import ivf

    default = ivf.DEFAULT_CONFIG
    configs = [("default", default)] + [(f"{k}={v}", dataclasses.replace(default, **{k: v}))
                                        for k, vals in SWEEP.items() for v in vals]
    rows = []
    try:
        for label, cfg in configs:
            ivf.DEFAULT_CONFIG = cfg

            def fn():
                for i in range(args.layers):
                    planner.plan(i, q, views[i])

            if timing.device == "cuda":
                ms, why = timing.graph_ms(fn, reps=args.reps)
            else:
                ms, why = timing.host_ms(fn, reps=1), "host"
            per = None if ms is None else ms / args.layers
            rows.append({"n": n, "method": "ctkvr", "what": "sweep_plan_fused", "config": label, "ms": per,
                         "graph": why})
            print(f"    sweep {label:20s} {'-' if per is None else f'{per * 1e3:8.1f} us'}", flush=True)
    finally:
        ivf.DEFAULT_CONFIG = default
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--methods", nargs="+", default=["ctkvr", "kivf"])
    ap.add_argument("--layers", type=int, default=4, help="layer copies per graph (defeats L2 reuse)")
    ap.add_argument("--steps", type=int, default=8, help="lockstep decode steps of the agreement check")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--k", type=int, default=1024, help="ctkvr: tokens selected")
    ap.add_argument("--list-size", type=int, default=2560, help="ctkvr: rho")
    ap.add_argument("--kivf-ratio", type=float, default=0.05)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="ctkvr: time the fused plan under other launch knobs")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "benchmarks" / "results")))
    args = ap.parse_args()
    dev = args.device
    if dev == "cpu":  # the interpreter (before any kernel module is imported) and its NumPy fix
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import indexer.kernels  # noqa: F401
    torch.set_num_threads(1)
    timing = Timing(dev)
    rows = []
    for n in args.lengths:
        rows += run_length(n, args, timing, dev)
    from indexer.kernels import ivf

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
            "ivf_config": str(ivf.DEFAULT_CONFIG),
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
            "args": vars(args)}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_ivf.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out / 'gpu_ivf.json'}")


if __name__ == "__main__":
    main()
