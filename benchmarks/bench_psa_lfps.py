"""PSA (`psa`) and LFPS (`lfps`) against the exact top-K oracle (`topk`), StreamingLLM (`streaming`,
the lower bound) and dense attention (`full`), on the default model, CPU, all in one run so ratios
compare like with like. `--methods` picks the rows of every section (default `psa lfps`; `full`, the
reference, always runs; add `streaming topk` for the baselines).

* `recall`, attention level, ~2K document (`--doc-tokens`, default 2048; `evaluation.fidelity.selection_recall`,
  every layer, the last `--n-queries` tokens as decode queries): recall of the exact top-5% and top-10%, fraction of
  KV attended, relative L2 error of the attention output. PSA and LFPS rows add what a replay of the
  same queries against a dense softmax shows (`replay_extras`). PSA: blocks per step, P_acc at the
  stop, the attention mass its attended set really holds vs eps, steps capped by `max_ratio`.
  LFPS: candidate fraction (exact q·k per visible position), bypassed fraction of heads, rows cut by
  `max_candidates`, true sink share of the bypassed heads.
* `fidelity`, model level, same document (`teacher_forced_logits` + `fidelity`): the last
  `--positions` tokens fed one at a time after the rest; top-1 agreement and KL(full || method), and
  the planner's stats.
* `passkey` (tests/conftest.py::passkey_document, ~560 tokens, `--keys` keys at depth 0.5): does the
  greedy answer contain the key.
* `decode`, speed at each of `--lengths` tokens: `decoder.generate.generate` over a `ContextKV` of the
  captured K/V, greedy, `--gen-tokens` tokens with EOS disabled (every method decodes the same number
  of steps); tokens/s after the first token, best of `--repeats` interleaved runs, ratio to `full`;
  the KV fraction of the question step and of the one-token steps; index build time.
* `step_time`, at each of `--lengths`, for the rows of `decode`: one decode step's CPU time over all
  layers, plan + `torch_ref` run (`full`: `torch_ref` dense), on the captured K/V.

Torch runs with `--threads` intra-op threads (default 1: the many small ops of the sparse paths
are several times slower with 2 threads on a shared 2-core machine; full attention is measured
under the same setting).

    python benchmarks/bench_psa_lfps.py --methods streaming topk psa lfps --json /tmp/bench_psa_lfps.json
    python benchmarks/bench_psa_lfps.py --methods psa --json /tmp/bench_psa.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decoder.backends import frame_mask, get_backend  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from evaluation.fidelity import build_index, fidelity, selection_recall, teacher_forced_logits, truncate_capture  # noqa: E402
from indexer.base import DecodeContext, KVView, get_method  # noqa: E402
from tests.conftest import MODEL_CACHE, PASSKEY_QUESTION, natural_document, passkey_document  # noqa: E402

QUESTION = "Summarize what the engineer and the scheduler did, in detail."
PASSKEY_TOKENS = 12  # greedy tokens of a passkey answer

# (label, method, params)
CONFIGS = [
    ("full", "full", {}),
    ("streaming w=96", "streaming", {"window": 96}),
    ("topk 5%", "topk", {"ratio": 0.05}),
    ("topk 10%", "topk", {"ratio": 0.10}),
    ("psa eps=0.9", "psa", {"eps": 0.9}),
    ("psa eps=0.95", "psa", {"eps": 0.95}),
    ("psa eps=0.95 cap 25%", "psa", {"eps": 0.95, "max_ratio": 0.25}),
    ("psa eps=0.95 cap 10%", "psa", {"eps": 0.95, "max_ratio": 0.10}),  # the GPU benchmarks' operating point
    ("psa eps=0.95 cap 5%", "psa", {"eps": 0.95, "max_ratio": 0.05}),  # capped at the budget rho
    ("psa eps=1 cap 5%", "psa", {"eps": 1.0, "max_ratio": 0.05}),  # a fixed budget: the top-rho blocks (Quest-like)
    ("psa eps=1 cap 10%", "psa", {"eps": 1.0, "max_ratio": 0.10}),
    ("psa budget 5%", "psa", {"rule": "budget", "max_ratio": 0.05}),  # the same set as eps=1 cap 5%, no exact sums
    ("psa budget 10%", "psa", {"rule": "budget", "max_ratio": 0.10}),
    # coarser blocks: less metadata for the criticality to read, fewer keys to select (the GPU step's bound at 128K)
    ("psa budget 5% block 64", "psa", {"rule": "budget", "max_ratio": 0.05, "block_size": 64}),
    ("psa budget 5% block 128", "psa", {"rule": "budget", "max_ratio": 0.05, "block_size": 128}),
    ("psa budget 5% block 256", "psa", {"rule": "budget", "max_ratio": 0.05, "block_size": 256}),
    # the other two criticalities over blocks of 128 (mean reads one metadata row per block instead of two)
    ("psa budget 5% block 128 center", "psa", {"rule": "budget", "max_ratio": 0.05, "block_size": 128,
                                               "criticality": "center"}),
    ("psa budget 5% block 128 mean", "psa", {"rule": "budget", "max_ratio": 0.05, "block_size": 128,
                                             "criticality": "mean"}),
    # blocks of 32 at the KV the coarse rows touch on the 8K document (their budgets round up to whole blocks, and
    # their window's block is larger): the same bytes read, for a fair comparison
    ("psa budget 6%", "psa", {"rule": "budget", "max_ratio": 0.06}),
    ("psa budget 7.6%", "psa", {"rule": "budget", "max_ratio": 0.076}),
    ("lfps 5%", "lfps", {"ratio": 0.05}),
    ("lfps 5% no-bypass", "lfps", {"ratio": 0.05, "bypass": False}),
    ("lfps 10%", "lfps", {"ratio": 0.10}),
]
# decode speed and step time
SPEED = ["full", "streaming w=96", "topk 5%", "psa eps=0.95", "psa eps=0.95 cap 25%", "lfps 5%"]
# passkey only: LFPS planning the question from the context's tables (no dense question step)
PASSKEY_EXTRA = [("lfps 5% table-only question", "lfps", {"ratio": 0.05, "dense_prompt": False})]
METHODS = sorted({name for _, name, _ in CONFIGS} - {"full"})
SECTIONS = ["recall", "fidelity", "passkey", "decode", "step_time"]


def machine() -> dict:
    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            return ""

    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": sh("lscpu | grep 'Model name' | head -1").split(":", 1)[-1].strip(),
        "cores": sh("nproc"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg": sh("cat /proc/loadavg"),
    }


def configs(table: list[tuple[str, str, dict]], methods, labels=None) -> list[tuple]:
    """(label, method, params) of the rows of `table` for `full` and `methods` (and, given `labels`, only
    the rows so labelled)."""
    return [(label, get_method(name), get_method(name).Params(**kw))
            for label, name, kw in table if name == "full" or (name in methods and (not labels or label in labels))]


def open_planner(m, params, cap, n_ctx: int, max_local: int):
    """A planner over the first `n_ctx` tokens of a capture (its index built in memory) for a request
    of at most `max_local` tokens."""
    index = build_index(m, params, truncate_capture(cap, n_ctx))
    return m.open(index, params, DecodeContext(n_ctx, cap.spec, max_local))


def context_kv(cap) -> ContextKV:
    return ContextKV(cap.n_tokens, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])


def scalar_stats(planner) -> dict:
    return {k: v for k, v in planner.stats().items() if not isinstance(v, list)}


def replay(cap, n_ctx: int):
    """The capture's tokens after `n_ctx` as single-token decode steps, step by step and layer by
    layer: yields (layer, q [KVH, G, 1, D], KVView). The caller plans, then calls update() with the
    step's own key/value (`kv.loc_k[:, -1:]`)."""
    spec = cap.spec
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    for p in range(n_ctx, cap.n_tokens):
        for layer in range(spec.num_layers):
            q = cap.q[layer, :, p:p + 1].reshape(kvh, g, 1, d)
            yield layer, q, KVView(cap.k[layer, :, :n_ctx], cap.v[layer, :, :n_ctx], cap.k[layer, :, n_ctx:p + 1],
                                   cap.v[layer, :, n_ctx:p + 1], torch.tensor([p]))


def bench_recall(cap, cfgs, n_queries: int) -> list[dict]:
    rows = []
    for label, m, params in cfgs:
        if m.name == "full":
            continue
        row = {"label": label}
        t0 = time.perf_counter()
        for ratio in (0.05, 0.10):
            s = selection_recall(m, params, cap, n_queries=n_queries, ratio=ratio).summary()
            row[f"recall@{ratio:.2f}"] = s["recall"]
            row["kv_touched"] = s["kv_touched"]
            row["rel_l2_err"] = s["rel_l2_err"]
        row["seconds"] = time.perf_counter() - t0
        if m.name in EXTRAS:
            row.update(replay_extras(m, params, cap, n_queries))
        rows.append(row)
        print("recall", json.dumps(row), flush=True)
    return rows


@torch.inference_mode()
def replay_extras(m, params, cap, n_queries: int) -> dict:
    """Replays the queries of `selection_recall` (plan, update) and measures what only a dense
    softmax knows, per (query head, step): the attention mass the attended set (frame ∪ plan,
    `frame_mask`) really holds, the sink's share, and that share for the heads the plan bypassed;
    `EXTRAS[m.name]` turns them and the planner's stats into the row's fields."""
    n_ctx = cap.n_tokens - n_queries
    planner = open_planner(m, params, cap, n_ctx, n_queries)
    sink, window = params.frame(n_ctx)
    g, d = cap.spec.group_size, cap.spec.head_dim
    mass, sink_share, bypassed = [], [], []
    for layer, q, kv in replay(cap, n_ctx):
        plan = planner.plan(layer, q, kv)
        keys = torch.cat([kv.ctx_k, kv.loc_k], dim=1)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q[:, :, 0], keys) * d ** -0.5, -1)
        mass.append((probs * frame_mask(plan, kv, sink, window, g)[:, :, 0]).sum(-1).flatten())
        share = probs[..., :params.sink].sum(-1).flatten()
        sink_share.append(share)
        if plan.bypass is not None:
            bypassed.append(share[plan.bypass[..., 0].flatten()])
        planner.update(layer, kv.loc_k[:, -1:], kv.loc_v[:, -1:], kv.q_pos)
    st = planner.stats()
    planner.close()
    return EXTRAS[m.name](st, params, torch.cat(mass), torch.cat(sink_share),
                          torch.cat(bypassed) if bypassed else torch.zeros(0))


def psa_extras(st: dict, params, mass, sink_share, bypassed) -> dict:
    """PSA's adaptive budget and the mass it really reaches (vs P_acc at the stop, `mass_est_mean`)."""
    return {
        "blocks_per_step": st["blocks_per_step"], "max_blocks": st["max_blocks"],
        "mass_est_mean": st["mass_est_mean"], "capped_fraction": st["capped_fraction"],
        "true_mass_mean": float(mass.mean()), "true_mass_p10": float(mass.quantile(0.1)),
        "true_mass_min": float(mass.min()),
        "frac_heads_below_eps": float((mass < params.eps).float().mean()),
    }


def lfps_extras(st: dict, params, mass, sink_share, bypassed) -> dict:
    """LFPS's candidates and bypass: candidate, bypassed and `max_candidates`-cut fractions, and the
    true sink share of the bypassed heads vs how many heads really put > 0.85 on the sink."""
    return {
        "candidate_fraction": st["candidate_fraction"], "bypass_fraction": st["bypass_fraction"],
        "capped_fraction": st["capped_fraction"],
        "bypassed_true_sink_share_mean": float(bypassed.mean()) if bypassed.numel() else None,
        "heads_true_sink_share_over_0.85": float((sink_share > 0.85).float().mean()),
    }


EXTRAS = {"psa": psa_extras, "lfps": lfps_extras}


def bench_fidelity(lm, ids: list[int], cfgs, positions: int) -> list[dict]:
    n_ctx = len(ids) - positions
    cap = prefill(lm, ids[:n_ctx])
    ctx = context_kv(cap)
    logits = {}
    rows = []
    for label, m, params in cfgs:
        planner = open_planner(m, params, cap, n_ctx, positions)
        t0 = time.perf_counter()
        logits[label] = teacher_forced_logits(lm, ctx, planner, params, ids[n_ctx:])
        row = {"label": label, "seconds": time.perf_counter() - t0}
        if label != "full":
            row.update(fidelity(logits["full"], logits[label]))
        row["stats"] = scalar_stats(planner)
        rows.append(row)
        print("fidelity", json.dumps(row), flush=True)
    return rows


def bench_passkey(lm, cfgs, keys: list[int]) -> list[dict]:
    q_ids = lm.question_ids(PASSKEY_QUESTION)
    rows = {label: {"label": label, "correct": 0, "answers": []} for label, _, _ in cfgs}
    for key in keys:
        cap = prefill(lm, lm.context_ids(passkey_document(key)))
        ctx = context_kv(cap)
        for label, m, params in cfgs:
            planner = open_planner(m, params, cap, cap.n_tokens, len(q_ids) + PASSKEY_TOKENS)
            res = generate(lm, ctx, planner, params, q_ids, max_tokens=PASSKEY_TOKENS)
            text = lm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            rows[label]["correct"] += int(str(key) in text)
            rows[label]["answers"].append(text)
    for r in rows.values():
        r["n"] = len(keys)
        print("passkey", json.dumps(r), flush=True)
    return list(rows.values())


def bench_decode(lm, cap, cfgs, gen_tokens: int, repeats: int) -> list[dict]:
    n = cap.n_tokens
    ctx = context_kv(cap)
    lm_noeos = dataclasses.replace(lm, eos_token_ids=())
    q_ids = lm.question_ids(QUESTION)
    built = {}
    for label, m, params in cfgs:
        t0 = time.perf_counter()
        built[label] = (build_index(m, params, cap), time.perf_counter() - t0)

    def run(label, m, params, max_tokens: int):
        planner = m.open(built[label][0], params, DecodeContext(n, lm.spec, len(q_ids) + gen_tokens))
        return generate(lm_noeos, ctx, planner, params, q_ids, max_tokens=max_tokens)

    # the question step alone, to split its KV fraction from the decode steps'
    kv_q = {label: run(label, m, params, 1).stats.kv_fraction for label, m, params in cfgs}
    best: dict[str, float] = {}
    kv_all = {}
    for _ in range(repeats):  # interleaved, so a neighbour's load spike hits every method alike
        for label, m, params in cfgs:
            res = run(label, m, params, gen_tokens)
            best[label] = max(best.get(label, 0.0), (len(res.token_ids) - 1) / res.decode_s)
            kv_all[label] = (res.stats.kv_fraction, len(q_ids) + res.stats.steps - 1)  # entries ∝ query tokens
    rows = []
    for label, _, _ in cfgs:
        frac, tokens = kv_all[label]
        row = {"label": label, "n_ctx": n, "tokens_per_s": best[label], "ratio_vs_full": best[label] / best["full"],
               "kv_fraction_question": kv_q[label],
               "kv_fraction_decode": (frac * tokens - kv_q[label] * len(q_ids)) / (tokens - len(q_ids)),
               "build_s": built[label][1]}
        rows.append(row)
        print("decode", json.dumps(row), flush=True)
    return rows


@torch.inference_mode()
def bench_step_time(cap, cfgs, steps: int = 4, repeats: int = 3) -> list[dict]:
    """CPU time of one decode step over all layers: plan, then `torch_ref` over frame ∪ plan (`full`'s
    plan is dense), on the captured K/V with the last `steps` tokens as single-token queries; best of
    `repeats` per (layer, step), summed over layers, mean over steps."""
    n_ctx = cap.n_tokens - steps
    backend = get_backend("torch_ref")
    scale = cap.spec.head_dim ** -0.5
    rows = []
    for label, m, params in cfgs:
        sink, window = params.frame(n_ctx)
        planner = open_planner(m, params, cap, n_ctx, steps)
        plan_s = run_s = 0.0
        for layer, q, kv in replay(cap, n_ctx):
            best_p = best_r = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = planner.plan(layer, q, kv)
                t1 = time.perf_counter()
                backend.run(q, kv, plan, sink, window, scale)
                t2 = time.perf_counter()
                best_p, best_r = min(best_p, t1 - t0), min(best_r, t2 - t1)
            planner.update(layer, kv.loc_k[:, -1:], kv.loc_v[:, -1:], kv.q_pos)
            plan_s += best_p
            run_s += best_r
        row = {"label": label, "n_ctx": n_ctx,
               "plan_ms_per_step": 1e3 * plan_s / steps, "run_ms_per_step": 1e3 * run_s / steps,
               "step_ms": 1e3 * (plan_s + run_s) / steps, "stats": scalar_stats(planner)}
        planner.close()
        rows.append(row)
        print("step_time", json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=["psa", "lfps"], choices=METHODS,
                    help="the rows of every section besides `full` (the reference, always run)")
    ap.add_argument("--n-queries", type=int, default=16)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--keys", type=int, nargs="+", default=[48213, 71942, 30517, 55555, 12986])
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--doc-tokens", type=int, default=2048,
                    help="length of the document of the recall and fidelity sections (the model's limit: 8192)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    ap.add_argument("--labels", nargs="*", default=None, help="only these rows of the table (and full)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    lm = load_model("smollm2-135m", MODEL_CACHE)
    n_doc = args.doc_tokens
    doc2k = lm.context_ids(natural_document(int(n_doc * 0.86) + 50))[:n_doc]
    cfgs = configs(CONFIGS, args.methods, args.labels)
    run = [s for s in SECTIONS if s not in args.skip]
    if "recall" in run:
        res["recall"] = bench_recall(prefill(lm, doc2k), cfgs, args.n_queries)
    if "fidelity" in run:
        res["fidelity"] = bench_fidelity(lm, doc2k, cfgs, args.positions)
    if "passkey" in run:
        res["passkey"] = bench_passkey(lm, configs(CONFIGS + PASSKEY_EXTRA, args.methods, args.labels), args.keys)
    speed = [c for c in cfgs if c[0] in SPEED]
    for section in ("decode", "step_time"):
        if section in run:
            res[section] = []
    for n in args.lengths if {"decode", "step_time"} & set(run) else []:
        cap = prefill(lm, lm.context_ids(natural_document(int(n * 0.86) + 50))[:n])
        if "decode" in run:
            res["decode"] += bench_decode(lm, cap, speed, args.gen_tokens, args.repeats)
        if "step_time" in run:
            res["step_time"] += bench_step_time(cap, speed)
    res["machine"]["load_avg_end"] = machine()["load_avg"]
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["machine"]))


if __name__ == "__main__":
    main()
