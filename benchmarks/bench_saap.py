"""SAAP (`saap`) on the default model, CPU: training cost, selectivity, recall, fidelity, speed vs `full`.

Measured in one run (1 torch thread by default: on 2 shared cores it is the fastest setting):

* training, `small` preset (C = 32, hidden 128, 300 steps x 256 queries, four 2,048-token windows
  of the built-in corpus, every layer 1-29): wall time of capture, k-means and f_q per layer;
  with `--paper-baseline` (default on) also the paper's form (per-query Eq. 1 targets, plain MLP,
  the paper's long-range query filter, four 1,024-token windows, min_distance 128, as the first
  `small` preset had them), so the bucket-level table compares both in one run;
* the `full` preset's training time, ESTIMATED (not run): one 8,192-token window is captured
  through 2 layers (x15 -> 30 layers, x40 windows), `--full-steps-timed` Adam steps of the full
  classifier (C = 1024, hidden 1024, batch 1000) are timed on it (x 40,000 steps x 29 layers), and
  one k-means at full size (40 x 8,191 keys, C = 1024, 10 iterations; x 87 KV heads);
* on a held-out ~2K-token document (`tests/conftest.py::natural_document`, not in the corpus):
  - bucket level, every SAAP layer: attention mass beyond the dense part captured by the
    classifier's top-ℓ buckets vs centroid probing at the same selectivity
    (`training.bucket_mass.bucket_mass_eval`), per layer and averaged;
  - attention level (`evaluation.fidelity.selection_recall`, last 16 tokens as queries, all 30
    layers): recall of the exact top-5%, KV touched, relative L2 error of the attention output;
  - model level: the 64 tokens after the context fed teacher-forced, top-1 agreement and
    KL(full || method) (`teacher_forced_logits` + `fidelity`);
  - decode: greedy generation, `--gen-tokens` tokens, EOS disabled, median tokens/s of
    `--repeats` interleaved runs vs `full`; SAAP's per-step selectivity from its planner's `stats()`.
  Baselines in the same run: `full`, `streaming` and exact `topk` given SAAP's measured budget.
* task level: the ~560-token passkey (`tests/conftest.py::passkey_document`, 6 keys at depths
  0.1-0.95, the test suite's question), greedy, 12 tokens: how many keys each configuration
  finds and the KV fraction it reads (all layers), for the classifier and for centroid probing at
  each of `--passkey-ells` (`full` for reference).

Decoding goes through the plan/run interface (`generate` with the `torch_ref` backend).

    python benchmarks/bench_saap.py --json /tmp/bench_saap.json
    python benchmarks/bench_saap.py --tasks passkey --model-dir DIR   # one part, an already trained model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from indexer.rope import undo_rope  # noqa: E402
from evaluation.fidelity import build_index, fidelity, selection_recall, teacher_forced_logits, truncate_capture  # noqa: E402
from indexer.base import DecodeContext, get_method  # noqa: E402
from indexer.clustering import kmeans  # noqa: E402
from indexer.saap_model import SaapModel  # noqa: E402
from training import loop  # noqa: E402
from training.bucket_mass import bucket_mass_eval  # noqa: E402
from training.capture import capture_first_layers  # noqa: E402
from training.corpus import builtin_corpus  # noqa: E402
from training.settings import PAPER, settings_from  # noqa: E402
from tests.conftest import MODEL_CACHE, PASSKEY_QUESTION, natural_document, passkey_document  # noqa: E402

QUESTION = "Summarize what the engineer and the scheduler did, in detail."


def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception as e:  # noqa: BLE001 - informational only
            return f"unavailable: {e}"

    return {"lscpu_model": sh("lscpu | grep 'Model name'"), "nproc": sh("nproc"), "date": sh("date"),
            "loadavg_start": sh("cat /proc/loadavg"), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


# the `small` preset before the fix: the paper's f_q (plain MLP) and Eq. 1 (per-query targets)
PAPER_SMALL = {**PAPER, "doc_tokens": 1024, "min_distance": 128}


def bench_train_small(lm, out: Path, **overrides) -> dict:
    t0 = time.perf_counter()
    path = loop.train_saap(lm, settings_from("small", **overrides), out_dir=out, progress=True)
    wall = time.perf_counter() - t0
    m = json.loads((path / "manifest.json").read_text())
    layers = m["layers"].values()
    res = {"wall_s": wall, "capture_s": m["timings"]["capture_s"],
           "kmeans_s": sum(x.get("kmeans_s", 0) for x in layers), "classifier_s": sum(x.get("train_s", 0) for x in layers),
           "layers": len(m["layers"]), "settings": m["settings"], "kl_first_mean": statistics.mean(x["kl_first"] for x in layers),
           "kl_last_mean": statistics.mean(x["kl_last"] for x in layers),
           "balance_train_mean": statistics.mean(b for x in layers for b in x["balance_train"]),
           "resumed": any(x.get("resumed") for x in layers), "digest": m["digest"], "corpus_tokens": m["corpus"]["tokens"]}
    print(json.dumps(res), flush=True)
    return res


def bench_full_estimate(lm, steps_timed: int) -> dict:
    """Time the pieces of the `full` preset at their real sizes and extrapolate (an estimate)."""
    s = settings_from("full")
    spec = lm.spec
    n = min(s.doc_tokens, spec.max_positions)

    text = builtin_corpus(1, int(n * 0.75) + 50, seed=777)[0][1]
    ids = lm.context_ids(text)[:n]
    t0 = time.perf_counter()
    cap = capture_first_layers(lm, ids, 2)
    capture_2l = time.perf_counter() - t0
    q, k = cap.q[1].float(), cap.k[1].float()
    pos = torch.arange(len(ids))
    qd, kd = undo_rope(q, pos, spec.rope_theta), undo_rope(k, pos, spec.rope_theta)
    # one k-means at full size: 40 windows' worth of keys (this window's keys + small noise, x40)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([kd[0, 1:] + 0.01 * torch.randn(kd.shape[1] - 1, kd.shape[2], generator=g) for _ in range(s.n_docs)])
    t0 = time.perf_counter()
    kmeans(x, s.clusters, s.kmeans_iters, 0)
    kmeans_1 = time.perf_counter() - t0
    cent = torch.stack([kmeans(kd[h, 1:], s.clusters, 2, h) for h in range(spec.num_kv_heads)])  # any centroids
    timed = s.model_copy(update={"steps": steps_timed})
    # 40 windows' targets (40 x 8K positions x 3 heads x 1024 buckets, fp32: ~4 GB) exceed
    # `_TABLE_BYTES`, so the full preset computes each step's targets for its batch: time that path
    table_bytes, loop._TABLE_BYTES = loop._TABLE_BYTES, 0
    try:
        t0 = time.perf_counter()
        loop._train_layer([q], [k], [kd], [qd], cent, timed, s.min_distance_for(n), spec.group_size, g)
        step_s = (time.perf_counter() - t0) / steps_timed
    finally:
        loop._TABLE_BYTES = table_bytes
    layers = spec.num_layers - 1
    est = {
        "window_tokens": len(ids), "capture_2_layers_s": capture_2l, "kmeans_one_head_s": kmeans_1,
        "step_s": step_s, "steps_timed": steps_timed,
        "est_capture_s": capture_2l * spec.num_layers / 2 * s.n_docs,
        "est_kmeans_s": kmeans_1 * layers * spec.num_kv_heads,
        "est_classifier_s": step_s * s.steps * layers,
    }
    est["est_total_h"] = (est["est_capture_s"] + est["est_kmeans_s"] + est["est_classifier_s"]) / 3600
    print(json.dumps(est), flush=True)
    return est


def bench_buckets(model: SaapModel, cap, ells: list[int], recent: int, label: str = "") -> list[dict]:
    """Per ℓ: means over the SAAP layers, the number of layers the classifier wins, and `per_layer`."""
    n = cap.n_tokens
    qpos = torch.arange(n // 2, n, 16)
    rows = []
    for ell in ells:
        layers = sorted(model.layers)
        per = [bucket_mass_eval(model, layer, cap.q[layer], cap.k[layer], qpos, ell, recent) for layer in layers]
        row = {"model": label, "nprobe": ell,
               **{key: statistics.mean(r[key] for r in per) for key in ("classifier", "centroid", "oracle", "selectivity")},
               "layers_classifier_wins": sum(r["classifier"] > r["centroid"] for r in per), "layers": len(per)}
        print(json.dumps(row), flush=True)
        row["per_layer"] = [{"layer": layer, **{k: r[k] for k in ("classifier", "centroid", "oracle", "selectivity")}}
                            for layer, r in zip(layers, per)]
        rows.append(row)
    return rows


def print_per_layer(rows: list[dict], baseline: list[dict] | None, ell: int) -> None:
    """Markdown table, one line per layer at ℓ = `ell`: classifier vs centroid (and the baseline's)."""
    cur = next(r for r in rows if r["nprobe"] == ell)["per_layer"]
    base = {x["layer"]: x for x in next(r for r in baseline if r["nprobe"] == ell)["per_layer"]} if baseline else {}
    print("| layer | classifier | centroid | Δ | selectivity | oracle |" + (" paper f_q | its centroid | Δ |" if base else ""))
    for x in cur:
        line = (f"| {x['layer']} | {x['classifier']:.3f} | {x['centroid']:.3f} | {x['classifier'] - x['centroid']:+.3f} | "
                f"{x['selectivity']:.3f} | {x['oracle']:.3f} |")
        if x["layer"] in base:
            b = base[x["layer"]]
            line += f" {b['classifier']:.3f} | {b['centroid']:.3f} | {b['classifier'] - b['centroid']:+.3f} |"
        print(line)


def configs(model_dir: str, ells: list[int]) -> list[tuple[str, str, dict]]:
    out = []
    for ell in ells:
        out.append((f"saap ℓ={ell}", "saap", {"model_dir": model_dir, "nprobe": ell}))
        out.append((f"k-means probe ℓ={ell}", "saap", {"model_dir": model_dir, "nprobe": ell, "probe": "centroid"}))
    return out


def baselines(budget: float, n: int) -> list[tuple[str, str, dict]]:
    return [(f"topk {budget:.1%}", "topk", {"ratio": budget}),
            (f"streaming ({budget:.1%})", "streaming", {"sink": 1, "window": max(1, round(budget * n) - 1)})]


def bench_recall(cap, todo, n_queries: int) -> list[dict]:
    rows = []
    for label, name, kw in todo:
        m = get_method(name)
        params = m.Params(**kw)
        t0 = time.perf_counter()
        s = selection_recall(m, params, cap, n_queries=n_queries, ratio=0.05).summary()
        rows.append({"config": label, "recall_top5pct": s["recall"], "kv_touched": s["kv_touched"],
                     "rel_l2_err": s["rel_l2_err"], "recall_min_layer": min(s["recall_per_layer"]),
                     "wall_s": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_fidelity(lm, cap, ids, positions: int, todo) -> list[dict]:
    n_ctx = cap.n_tokens
    ctx = ContextKV(n_ctx, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    cont = ids[n_ctx:n_ctx + positions]
    full = get_method("full")
    ref = teacher_forced_logits(lm, ctx, full.open(None, full.Params(), DecodeContext(n_ctx, lm.spec, len(cont))),
                                full.Params(), cont)
    rows = []
    for label, name, kw in todo:
        m = get_method(name)
        params = m.Params(**kw)
        index = build_index(m, params, cap)
        planner = m.open(index, params, DecodeContext(n_ctx, lm.spec, len(cont)))
        t0 = time.perf_counter()
        logits = teacher_forced_logits(lm, ctx, planner, params, cont)
        row = {"config": label, **fidelity(ref, logits), "wall_s": time.perf_counter() - t0}
        sel = planner.stats().get("selectivity_per_step")
        if sel:
            row["selectivity_mean"] = statistics.mean(sel)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_decode(lm, cap, todo, gen_tokens: int, repeats: int) -> list[dict]:
    n = cap.n_tokens
    ctx = ContextKV(n, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    lm_noeos = dataclasses.replace(lm, eos_token_ids=())
    q_ids = lm.question_ids(QUESTION)
    todo = [("full", "full", {})] + todo
    built = {}
    for label, name, kw in todo:
        m = get_method(name)
        params = m.Params(**kw)
        t0 = time.perf_counter()
        index = build_index(m, params, cap)
        size = 0 if index is None else sum(index.layer(a, i).numel() * index.layer(a, i).element_size()
                                           for a in index.names for i in range(lm.spec.num_layers))
        built[label] = (m, params, index, time.perf_counter() - t0, size)
    times: dict[str, list[float]] = {label: [] for label, _, _ in todo}
    sel_ms: dict[str, list[float]] = {label: [] for label, _, _ in todo}
    extra: dict[str, dict] = {}
    for _ in range(repeats):  # interleaved: a neighbour's load spike hits every method alike
        for label, _, _ in todo:
            m, params, index, _, _ = built[label]
            planner = m.open(index, params, DecodeContext(n, lm.spec, len(q_ids) + gen_tokens))
            res = generate(lm_noeos, ctx, planner, params, q_ids, max_tokens=gen_tokens, backend="torch_ref")
            times[label].append((res.stats.steps - 1) / res.decode_s)
            sel_ms[label].append(res.stats.plan_s / res.stats.steps * 1e3)
            extra[label] = {"kv_fraction_all_layers": res.stats.kv_fraction, "first_tokens": res.token_ids[:8]}
            sel = planner.stats().get("selectivity_per_step")
            if sel:
                extra[label]["selectivity_per_step"] = sel
    full_tps = statistics.median(times["full"])
    rows = []
    for label, _, _ in todo:
        tps = statistics.median(times[label])
        rows.append({"config": label, "tokens_per_s": tps, "vs_full": tps / full_tps, "runs_tps": times[label],
                     "plan_ms_per_token": statistics.median(sel_ms[label]), "build_s": built[label][3],
                     "index_mb": built[label][4] / 2**20, **extra[label]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "selectivity_per_step"}), flush=True)
    return rows


PASSKEYS = [(71432, 0.5), (52817, 0.3), (90817, 0.8), (38140, 0.1), (66029, 0.65), (17395, 0.95)]


def bench_passkey(lm, model_dir: str, ells: list[int]) -> list[dict]:
    caps = []
    for key, depth in PASSKEYS:
        ids = lm.context_ids(passkey_document(key, depth=depth))
        caps.append((key, prefill(lm, ids)))
    q_ids = lm.question_ids(PASSKEY_QUESTION)
    todo = [("full", "full", {})] + configs(model_dir, ells)
    rows = []
    for label, name, kw in todo:
        m = get_method(name)
        params = m.Params(**kw)
        found, kv, answers = 0, [], []
        for key, cap in caps:
            ctx = ContextKV(cap.n_tokens, lambda nm, layer, cap=cap: (cap.k if nm == "kv/k" else cap.v)[layer])
            planner = m.open(build_index(m, params, cap), params, DecodeContext(cap.n_tokens, lm.spec, len(q_ids) + 12))
            res = generate(lm, ctx, planner, params, q_ids, max_tokens=12, backend="torch_ref")
            text = lm.tokenizer.decode(res.token_ids)
            found += str(key) in text
            kv.append(res.stats.kv_fraction)
            answers.append(text.strip()[:32])
        rows.append({"config": label, "found": found, "of": len(caps), "kv_fraction": statistics.mean(kv),
                     "n_tokens": statistics.mean(cap.n_tokens for _, cap in caps), "answers": answers})
        print(json.dumps(rows[-1]), flush=True)
    return rows


TASKS = ("train", "buckets", "recall", "fidelity", "decode", "passkey")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/ctxcache-bench-saap"), help="trained small model goes here")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="use this trained model (the `small` preset) instead of training one into OUT")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS),
                    help="parts to run (default all; `train` also trains the paper-baseline and times the full preset)")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--ells", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--n-queries", type=int, default=16)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--full-steps-timed", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passkey-ells", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--paper-baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also train and evaluate the paper's f_q / Eq. 1 (the former small preset) into OUT-paper")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks = set(args.tasks)
    out = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    lm = load_model("smollm2-135m", MODEL_CACHE)

    model_dir = args.model_dir or args.out
    paper_dir = args.out.with_name(args.out.name + "-paper")
    if "train" in tasks:
        if args.model_dir is None:
            out["train_small"] = bench_train_small(lm, args.out)
        if args.paper_baseline:
            out["train_small_paper"] = bench_train_small(lm, paper_dir, **PAPER_SMALL)
        out["train_full_estimate"] = bench_full_estimate(lm, args.full_steps_timed)

    if tasks & {"buckets", "recall", "fidelity", "decode"}:
        ids = lm.context_ids(natural_document(1900))
        assert len(ids) >= args.n_ctx + args.positions, len(ids)
        t0 = time.perf_counter()
        cap = prefill(lm, ids[:args.n_ctx])
        out["prefill_s"] = time.perf_counter() - t0
    if "buckets" in tasks:
        model = SaapModel.open(model_dir)
        recent = get_method("saap").Params().recent_for(args.n_ctx)
        ells_b = sorted(set(args.ells + [8]))
        out["buckets"] = bench_buckets(model, cap, ells_b, recent, "small")
        if args.paper_baseline and (paper_dir / "manifest.json").exists():
            out["buckets_paper"] = bench_buckets(SaapModel.open(paper_dir), cap, ells_b, recent, "small, paper's f_q")
        print_per_layer(out["buckets"], out.get("buckets_paper"), 2)

    saap_cfgs = configs(str(model_dir), args.ells)
    mid = f"saap ℓ={args.ells[len(args.ells) // 2]}"
    if "recall" in tasks:
        out["recall"] = bench_recall(cap, saap_cfgs, args.n_queries)
    if tasks & {"recall", "fidelity", "decode"}:
        # the baselines get the budget SAAP measured at the middle ℓ (its teacher-forced mean
        # selectivity), so SAAP's fidelity runs for any of these parts
        out["fidelity"] = bench_fidelity(lm, cap, ids, args.positions, saap_cfgs)
        budget = next(r["selectivity_mean"] for r in out["fidelity"] if r["config"] == mid)
        base = baselines(budget, args.n_ctx)
        if "recall" in tasks:
            out["recall"] += bench_recall(cap, base, args.n_queries)
        if "fidelity" in tasks:
            out["fidelity"] += bench_fidelity(lm, cap, ids, args.positions, base)
        if "decode" in tasks:
            dec = [c for c in saap_cfgs if c[0] == mid or c[0] == f"saap ℓ={args.ells[0]}"]
            out["decode"] = bench_decode(lm, cap, dec + base, args.gen_tokens, args.repeats)
    if "passkey" in tasks:
        out["passkey"] = bench_passkey(lm, str(model_dir), args.passkey_ells)
    out["machine"]["loadavg_end"] = open("/proc/loadavg").read().strip()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["machine"], indent=1))


if __name__ == "__main__":
    main()
