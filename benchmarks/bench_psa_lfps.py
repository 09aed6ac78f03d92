"""PSA (`psa`) and LFPS (`lfps`) against the exact top-K oracle (`topk`), StreamingLLM (`streaming`,
the lower bound) and dense attention (`full`), on the default model, CPU, all in one run so ratios
compare like with like.

* attention level, ~2K document (`decoder.fidelity.selection_recall`, every layer, the last
  `--n-queries` tokens as decode queries): recall of the exact top-5% and top-10%, fraction of KV
  attended, relative L2 error of the attention output. PSA additionally: blocks per step, and the
  attention mass its processed set *really* holds (dense softmax) vs eps. LFPS additionally: the
  candidate fraction (exact q·k per visible position), the bypassed fraction of heads and the true
  sink share of the bypassed heads.
* model level, same document (`teacher_forced_logits` + `fidelity`): the last `--positions` tokens
  fed one at a time after the rest; top-1 agreement and KL(full || method).
* passkey (tests/conftest.py::passkey_document, ~560 tokens, `--keys` keys at depth 0.5): does the
  greedy answer contain the key.
* decode speed at ~2K and ~8K tokens: `decoder.generate.generate` over a `ContextKV` of the captured
  K/V, greedy, `--gen-tokens` tokens with EOS disabled (every method decodes the same number of
  steps); tokens/s after the first token, best of `--repeats` interleaved runs, ratio to `full`.

Torch runs with `--threads` intra-op threads (default 1: the many small ops of the sparse paths
are several times slower with 2 threads on a shared 2-core machine; full attention is measured
under the same setting).

    python benchmarks/bench_psa_lfps.py --json /tmp/bench_psa_lfps.json
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

from decoder.fidelity import build_index, fidelity, selection_recall, teacher_forced_logits, truncate_capture  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from indexer.base import KVView, get_method  # noqa: E402
from tests.conftest import MODEL_CACHE, PASSKEY_QUESTION, natural_document, passkey_document  # noqa: E402

QUESTION = "Summarize what the engineer and the scheduler did, in detail."

# (label, method, params)
CONFIGS = [
    ("full", "full", {}),
    ("streaming w=96", "streaming", {"window": 96}),
    ("topk 5%", "topk", {"ratio": 0.05}),
    ("topk 10%", "topk", {"ratio": 0.10}),
    ("psa eps=0.9", "psa", {"eps": 0.9}),
    ("psa eps=0.95", "psa", {"eps": 0.95}),
    ("lfps 5%", "lfps", {"ratio": 0.05}),
    ("lfps 5% no-bypass", "lfps", {"ratio": 0.05, "bypass": False}),
    ("lfps 10%", "lfps", {"ratio": 0.10}),
]
# decode speed only: PSA returning its merged output itself (no second attention pass by the frame)
SPEED_EXTRA = [("psa eps=0.95 progressive", "psa", {"eps": 0.95, "execute": "progressive"})]
SPEED = ["full", "streaming w=96", "topk 5%", "psa eps=0.95", "psa eps=0.95 progressive", "lfps 5%"]
# passkey only: LFPS planning the question from the context's tables (no dense question step)
PASSKEY_EXTRA = [("lfps 5% table-only question", "lfps", {"ratio": 0.05, "dense_prompt": False})]


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


def bench_recall(cap, n_queries: int) -> list[dict]:
    rows = []
    for label, name, kw in CONFIGS:
        if name == "full":
            continue
        m = get_method(name)
        params = m.Params(**kw)
        row = {"label": label}
        t0 = time.perf_counter()
        for ratio in (0.05, 0.10):
            s = selection_recall(m, params, cap, n_queries=n_queries, ratio=ratio).summary()
            row[f"recall@{ratio:.2f}"] = s["recall"]
            row["kv_touched"] = s["kv_touched"]
            row["rel_l2_err"] = s["rel_l2_err"]
        row["seconds"] = time.perf_counter() - t0
        if name in ("psa", "lfps"):
            row.update(replay_extras(m, params, cap, n_queries))
        rows.append(row)
        print("recall", json.dumps(row), flush=True)
    return rows


@torch.inference_mode()
def replay_extras(m, params, cap, n_queries: int) -> dict:
    """Replays the queries of `selection_recall` once more and measures what only a dense softmax
    knows: PSA's true mass of the processed set, LFPS's true sink share of the bypassed heads."""
    spec = cap.spec
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    n_ctx = cap.n_tokens - n_queries
    sess = m.open(build_index(m, params, truncate_capture(cap, n_ctx)), params, n_ctx)
    true_mass, sink_share_bypassed, sink_share_all = [], [], []
    for layer in range(spec.num_layers):
        for i in range(n_queries):
            p = n_ctx + i
            q = cap.q[layer, :, p:p + 1].reshape(kvh, g, 1, d)
            kv = KVView(cap.k[layer, :, :n_ctx], cap.v[layer, :, :n_ctx], cap.k[layer, :, n_ctx:p + 1],
                        cap.v[layer, :, n_ctx:p + 1], torch.tensor([p]))
            custom = sess.attend(layer, q, kv)
            sel = sess.select(layer, q, kv) if custom is None else None
            probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q[:, :, 0], cap.k[layer, :, :p + 1]) * d ** -0.5, -1)
            if m.name == "psa":
                pos = sess.last[layer].positions[:, 0]  # [KVH, P]: every processed token
                mask = torch.zeros(kvh, p + 1, dtype=torch.bool)
                for h in range(kvh):
                    mask[h, pos[h][pos[h] >= 0]] = True
                true_mass.append((probs * mask[:, None]).sum(-1).flatten())
            else:
                share = probs[..., :params.sink].sum(-1).flatten()
                sink_share_all.append(share)
                byp = sess.last[layer].bypass[..., 0].flatten()
                sink_share_bypassed.append(share[byp])
    st = sess.stats()
    if m.name == "psa":
        tm = torch.cat(true_mass)
        return {
            "blocks_per_step": st["blocks_per_step"], "mass_est_mean": st["mass_est_mean"],
            "true_mass_mean": float(tm.mean()), "true_mass_p10": float(tm.quantile(0.1)),
            "true_mass_min": float(tm.min()),
            "frac_heads_below_eps": float((tm < params.eps).float().mean()),
        }
    sb = torch.cat(sink_share_bypassed)
    sa = torch.cat(sink_share_all)
    return {
        "candidate_fraction": st["candidate_fraction"], "bypass_fraction": st["bypass_fraction"],
        "bypassed_true_sink_share_mean": float(sb.mean()) if sb.numel() else None,
        "heads_true_sink_share_over_0.85": float((sa > 0.85).float().mean()),
    }


def bench_fidelity(lm, ids: list[int], positions: int) -> list[dict]:
    n_ctx = len(ids) - positions
    cap = prefill(lm, ids[:n_ctx])
    ctx = ContextKV(n_ctx, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    cont = ids[n_ctx:]
    logits = {}
    rows = []
    for label, name, kw in CONFIGS:
        m = get_method(name)
        params = m.Params(**kw)
        sess = m.open(build_index(m, params, cap), params, n_ctx)
        t0 = time.perf_counter()
        logits[label] = teacher_forced_logits(lm, ctx, sess, params, cont)
        row = {"label": label, "seconds": time.perf_counter() - t0}
        if label != "full":
            row.update(fidelity(logits["full"], logits[label]))
        if hasattr(sess, "stats"):
            row["stats"] = {k: v for k, v in sess.stats().items() if not isinstance(v, list)}
        rows.append(row)
        print("fidelity", json.dumps(row), flush=True)
    return rows


def bench_passkey(lm, keys: list[int]) -> list[dict]:
    configs = CONFIGS + PASSKEY_EXTRA
    rows = {label: {"label": label, "correct": 0, "answers": []} for label, _, _ in configs}
    for key in keys:
        cap = prefill(lm, lm.context_ids(passkey_document(key)))
        ctx = ContextKV(cap.n_tokens, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
        for label, name, kw in configs:
            m = get_method(name)
            params = m.Params(**kw)
            sess = m.open(build_index(m, params, cap), params, cap.n_tokens)
            res = generate(lm, ctx, sess, params, lm.question_ids(PASSKEY_QUESTION), max_tokens=12)
            text = lm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            rows[label]["correct"] += int(str(key) in text)
            rows[label]["answers"].append(text)
    for r in rows.values():
        r["n"] = len(keys)
        print("passkey", json.dumps(r), flush=True)
    return list(rows.values())


def bench_decode(lm, ids: list[int], gen_tokens: int, repeats: int) -> list[dict]:
    n = len(ids)
    cap = prefill(lm, ids)
    ctx = ContextKV(n, lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    lm_noeos = dataclasses.replace(lm, eos_token_ids=())
    q_ids = lm.question_ids(QUESTION)
    opened = {}
    for label, name, kw in CONFIGS + SPEED_EXTRA:
        if label in SPEED:
            m = get_method(name)
            params = m.Params(**kw)
            t0 = time.perf_counter()
            index = build_index(m, params, cap)
            opened[label] = (m, params, index, time.perf_counter() - t0)
    best: dict[str, float] = {}
    kv: dict[str, tuple[float, float]] = {}
    last = {}
    for label in SPEED:  # the question step alone, to split its KV fraction from the decode steps'
        m, params, index, _ = opened[label]
        st = generate(lm_noeos, ctx, m.open(index, params, n), params, q_ids, max_tokens=1).stats
        kv[label] = (st.touched_sum, st.touched_n)
    for _ in range(repeats):  # interleaved, so a neighbour's load spike hits every method alike
        for label in SPEED:
            m, params, index, _ = opened[label]
            res = generate(lm_noeos, ctx, m.open(index, params, n), params, q_ids, max_tokens=gen_tokens)
            tps = (len(res.token_ids) - 1) / res.decode_s
            best[label] = max(best.get(label, 0.0), tps)
            last[label] = res.stats
    rows = []
    for label in SPEED:
        st = last[label]
        q_sum, q_n = kv[label]
        row = {"label": label, "n_ctx": n, "tokens_per_s": best[label], "ratio_vs_full": best[label] / best["full"],
               "kv_fraction_question": q_sum / q_n,
               "kv_fraction_decode": (st.touched_sum - q_sum) / (st.touched_n - q_n),
               "build_s": opened[label][3]}
        rows.append(row)
        print("decode", json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-queries", type=int, default=16)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--keys", type=int, nargs="+", default=[48213, 71942, 30517, 55555, 12986])
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", nargs="*", default=[], choices=["recall", "fidelity", "passkey", "decode"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    lm = load_model("smollm2-135m", MODEL_CACHE)
    doc2k = lm.context_ids(natural_document(1750))[:2048]
    if "recall" not in args.skip:
        res["recall"] = bench_recall(prefill(lm, doc2k), args.n_queries)
    if "fidelity" not in args.skip:
        res["fidelity"] = bench_fidelity(lm, doc2k, args.positions)
    if "passkey" not in args.skip:
        res["passkey"] = bench_passkey(lm, args.keys)
    if "decode" not in args.skip:
        res["decode"] = []
        for n in args.lengths:
            ids = lm.context_ids(natural_document(int(n * 0.86) + 50))[:n]
            res["decode"] += bench_decode(lm, ids, args.gen_tokens, args.repeats)
    res["machine"]["load_avg_end"] = machine()["load_avg"]
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["machine"]))


if __name__ == "__main__":
    main()
