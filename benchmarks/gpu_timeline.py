"""Where one graph-replayed decode step's time goes, from timestamps the kernels take themselves
(`indexer/kernels/stamps.py`): per kernel, when its first program started and its last one ended
(relative to the step's first program), how long its programs ran, the gaps between one kernel's
last program and the next kernel's first; and inside CTkvr's and kivf's select, each program's
phases (the softmax parts' lse, the mass pass that writes the keys, the sample bracket, the counting
pass, the band's bisection, the emit), and the rerank's (the probe bests' merge, each chunk of slots,
the softmax state's store).

    python benchmarks/gpu_timeline.py --lengths 131072 524288 --methods ctkvr

Same layer, inputs, index and request as `gpu_decode.py` (one 8B layer, bf16, B = 1, the triton
backend), graph-captured, replayed with a cold L2. Stamps cost a barrier and three stores per point:
the step is timed with them and without them (a second graph of the same step) in the same run, so the
overhead is on record. Kernels stamped: CTkvr's probe, the IVF rerank and select, psa's criticality and select
(its phases: the tiles' states, the group keys, the threshold search, the emit, the budget plan's stores),
CTkvr's attended plan (`_attend_kernel`: its programs' wait for the plan, their rows, the state's store and
merge) or the attention's split and merge (other methods' kernels take no stamps: their rows show the attention
only; psa's sums and stop take none either).

Times: %globaltimer (ns) for positions on the step's timeline; %clock64 (SM cycles, converted with the
program's own globaltimer / clock64 ratio) for the select's phases, since the global timer may tick
coarser than a phase (its resolution is reported: the smallest non-zero step seen).

Rows ($OUT/gpu_timeline.json): n, method, graph_ms (stamped), graph_ms_plain, per kernel {programs,
first_start_us, last_start_us, first_end_us, last_end_us, prog_us_median, prog_us_max}, gaps_us
(next kernel's first start - this kernel's last end), select_phases_us (median over programs and
replays of each phase, split into the plan's and the FIFO push's programs, and the rerank's under
"rerank"), globaltimer_step_ns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_decode as gd  # noqa: E402
from benchmarks._gpu_timing import M_LOCAL, capture_graph, method_spec  # noqa: E402
from indexer.base import PrefillCapture  # noqa: E402
from indexer.kernels.stamps import recording  # noqa: E402

ORDER = ["probe", "psa_crit", "psa_select", "rerank", "select", "attend", "split", "merge"]
END_SLOT = {"select": 7}  # the slot a kernel stamps at its end (1 elsewhere)
PHASES = {  # per kernel: (phase, from slot, to slot) as the kernel stamps them
    "select": [("lse", 0, 1), ("keys", 1, 2), ("bracket", 2, 3), ("count", 3, 4), ("bisect", 4, 5), ("emit", 5, 6),
               ("tail", 6, 7), ("total", 0, 7)],
    "rerank": [("merge", 0, 2), ("chunk0", 2, 3), ("chunk1", 3, 4), ("tail", 4, 1), ("total", 0, 1)],
    # CTkvr's plan attended in its select launch (`_attend_part`): waiting for the plan, its rows, the state's store
    # and (the row's last program) the merge
    "attend": [("wait", 0, 2), ("rows", 2, 3), ("tail", 3, 1), ("total", 0, 1)],
    # psa's select (`indexer/kernels/psa.py`): the tiles' states reduced, the group keys, the threshold search,
    # the emit of the candidates, then (rule "budget") the plan's stores
    "psa_select": [("states", 0, 2), ("keys", 2, 3), ("search", 3, 4), ("emit", 4, 5), ("plan", 5, 1),
                   ("total", 0, 1)],
}


def build_request(n: int, spec_name: str):
    """The request of one timeline row; spec_name "METHOD" or "METHOD|BACKEND" (`gpu_decode.backend_for`'s spec:
    "psa@rule=budget|triton:maxnreg=128")."""
    spec_name, _, backend = spec_name.partition("|")
    sp = gd.spec(1)
    mix = gd.Mixture(gd.spec(2), gd.DEV, seed=0)
    q_all, k_all, v_all = gd.make_inputs(n, mix, seed=n)
    ctx_k, ctx_v = k_all[:, :n].contiguous(), v_all[:, :n].contiguous()
    loc_k, loc_v = k_all[:, n:].contiguous(), v_all[:, n:].contiguous()
    q_step = q_all[:, n + M_LOCAL - 1].reshape(gd.KVH, gd.G, 1, gd.D).contiguous()
    name, overrides, knobs = method_spec(spec_name)
    restore = gd.plan_knobs(name, knobs)
    method, params = gd.method_params(name, None, 0.1, overrides)
    arrays = None
    if method.has_index:
        cap = PrefillCapture(q=q_all[None, :, :n], k=ctx_k[None], v=ctx_v[None],
                             positions=torch.arange(n, device=gd.DEV), spec=sp)
        arrays = {k: v.to(gd.DEV) for k, v in method.build(cap, params).items()}
    req = gd.Request(ctx_k, ctx_v, loc_k, loc_v, q_step, arrays, method, params, 0, sp,
                     gd.backend_for(backend or "triton"))
    return req, restore


def analyse(stamps: dict[str, torch.Tensor], push: bool) -> dict:
    """One replay's stamps -> kernel spans and select phases (µs, relative to the first start). push:
    the select runs two programs per row, (row, 0) the FIFO push's and (row, 1) the plan's (CTkvr's
    one-token steps); else one, the plan's."""
    t0 = min(int(b[:, 0, 0][b[:, 0, 0] > 0].min()) for b in stamps.values() if len(b))
    out, phases, res = {}, {"plan": {}, "push": {}, "rerank": {}, "attend": {}, "psa_select": {}}, []
    for name in ORDER:
        b = stamps.get(name)
        if b is None or not len(b):
            continue
        end = END_SLOT.get(name, 1)
        ran = (b[:, 0, 0] > 0) & (b[:, end, 0] > 0)
        st, en = b[ran, 0, 0].double(), b[ran, end, 0].double()
        dur = (en - st) / 1e3
        out[name] = {"programs": int(ran.sum()), "first_start_us": (st.min() - t0) / 1e3,
                     "last_start_us": (st.max() - t0) / 1e3, "first_end_us": (en.min() - t0) / 1e3,
                     "last_end_us": (en.max() - t0) / 1e3, "prog_us_median": float(dur.median()),
                     "prog_us_max": float(dur.max()), "sms": int(b[ran, 0, 2].unique().numel())}
        out[name] = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in out[name].items()}
        gts = b[ran, :, 0]
        steps = (gts[:, 1:] - gts[:, :-1]).flatten()
        res += steps[steps > 0].tolist()
        if name in PHASES:
            for i in ran.nonzero().flatten().tolist():
                row = b[i]
                clk_ns = (row[end, 0] - row[0, 0]).item() / max(1, (row[end, 1] - row[0, 1]).item())
                kind = name if name != "select" else "push" if push and i % 2 == 0 else "plan"
                for ph, a, z in PHASES[name]:
                    if row[a, 1] > 0 and row[z, 1] > 0:
                        phases[kind].setdefault(ph, []).append((row[z, 1] - row[a, 1]).item() * clk_ns / 1e3)
    gaps = {}
    names = [n for n in ORDER if n in out]
    for a, z in zip(names, names[1:]):
        gaps[f"{a}->{z}"] = out[z]["first_start_us"] - out[a]["last_end_us"]
    return {"kernels": out, "gaps_us": gaps, "phases": phases, "min_step_ns": min(res) if res else None}


def run(n: int, spec_name: str, reps: int) -> dict:
    req, restore = build_request(n, spec_name)
    try:
        g_plain = capture_graph(req.step)
        plain = gd.T.cuda_ms(g_plain.replay, reps=reps)
        with recording(gd.DEV) as rec:
            g = capture_graph(req.step)
            stamped = gd.T.cuda_ms(g.replay, reps=reps)
            per = []
            for _ in range(reps):
                rec.clear()
                gd.T.flush_l2()
                g.replay()
                torch.cuda.synchronize()
                per.append(analyse(rec.read(), push=spec_name.split(":")[0].split("@")[0] == "ctkvr"))
    finally:
        restore()
    med = statistics.median
    kernels = {}
    for name in ORDER:
        got = [p["kernels"][name] for p in per if name in p["kernels"]]
        if got:
            kernels[name] = {k: med([x[k] for x in got]) for k in got[0]}
    gaps = {k: med([p["gaps_us"][k] for p in per if k in p["gaps_us"]]) for k in per[0]["gaps_us"]}
    phases = {}
    for kind in ("plan", "push", "rerank", "attend", "psa_select"):
        vals = {}
        for p in per:
            for ph, xs in p["phases"][kind].items():
                vals.setdefault(ph, []).extend(xs)
        phases[kind] = {ph: {"median": med(xs), "max": max(xs), "n": len(xs)} for ph, xs in vals.items()}
    res = [p["min_step_ns"] for p in per if p["min_step_ns"]]
    return {"n": n, "method": spec_name, "batch": 1, "graph_ms": stamped, "graph_ms_plain": plain,
            "kernels": kernels, "gaps_us": gaps, "select_phases_us": phases,
            "globaltimer_step_ns": min(res) if res else None, "reps": reps}


def report(row: dict) -> None:
    print(f"n={row['n']} {row['method']}: graph {row['graph_ms'] * 1e3:.1f} us stamped, "
          f"{row['graph_ms_plain'] * 1e3:.1f} plain; globaltimer step >= {row['globaltimer_step_ns']} ns")
    print("| kernel | programs | SMs | first start | last start | first end | last end | program median / max |")
    print("|---|---|---|---|---|---|---|---|")
    for name, k in row["kernels"].items():
        print(f"| {name} | {k['programs']:.0f} | {k['sms']:.0f} | {k['first_start_us']:.1f} | "
              f"{k['last_start_us']:.1f} | {k['first_end_us']:.1f} | {k['last_end_us']:.1f} | "
              f"{k['prog_us_median']:.1f} / {k['prog_us_max']:.1f} |")
    print("gaps (us): " + ", ".join(f"{k} {v:.2f}" for k, v in row["gaps_us"].items()))
    for kind, ph in row["select_phases_us"].items():
        if ph:
            print(f"{'select ' * (kind not in ('rerank', 'attend', 'psa_select'))}{kind} phases (us, median / max): "
                  + ", ".join(f"{k} {v['median']:.2f}/{v['max']:.2f}" for k, v in ph.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072])
    ap.add_argument("--methods", nargs="+", default=["ctkvr"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--l2", choices=["cold", "clean"], default="cold",
                    help="clean: flush the L2 before each replay by reading a buffer, not zeroing it (_gpu_timing)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_timeline.py needs a CUDA device (the stamps are PTX special registers)")
    gd.T.flush = "read" if args.l2 == "clean" else "zero"
    rows = []
    for n in args.lengths:
        for m in args.methods:
            row = run(n, m, args.reps)
            report(row)
            rows.append(row)
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "l2": args.l2,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (out / f"gpu_timeline{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
