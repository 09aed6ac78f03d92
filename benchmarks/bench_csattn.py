"""CPU benchmark of `csattn` with the real default model (SmolLM2-135M) against `full`, one run.

Per context length (2K and 8K tokens of the deterministic prose document from tests/conftest.py):
prefill capture, csattn build time (per 1K context tokens), then greedy decode of a question
through decoder.generate with a ContextKV over the captured tensors (as decoder/fidelity.py does)
for `full`, csattn (default scoring), csattn with the paper's reduce-by-key, and csattn with the
0.20-step-8 schedule. Reported: decode tokens/s, time in select / attention, the ratio to `full`
measured in the same run, the fraction of KV attended, how many leading greedy tokens equal full's,
and attention recall of the exact top-K (64 replayed queries, layers 0, 10, 20, 29).

    PYTHONUNBUFFERED=1 python benchmarks/bench_csattn.py [--lengths 2048 8064] [--tokens 32]

Writes benchmarks/out/bench_csattn.json. 8064 (not 8192) leaves room for question + answer
within the model's 8192 positions.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MODEL_CACHE, natural_document  # noqa: E402
from decoder.fidelity import selection_recall, truncate_capture  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from indexer.base import IndexReader, MethodParams, get_method  # noqa: E402
from indexer.csattn import CSAttention, CSAttnParams  # noqa: E402

QUESTION = "What does the engineer do in the document? Answer in one sentence."
PAPER = {"missing_score": "zero", "subspace_weights": "uniform"}  # the paper's reduce-by-key
VARIANTS = {
    "csattn (default scoring, 0.05-step-1)": {},
    "csattn (paper scoring, 0.05-step-1)": PAPER,
    "csattn (default scoring, 0.20-step-8)": {"schedule": "0.20-step-8"},
}


class _Prebuilt(CSAttention):
    def __init__(self, arrays):
        self.arrays = arrays

    def build(self, prefill, params):
        return self.arrays


def run_length(lm, n: int, n_tokens: int) -> dict:
    ids = lm.context_ids(natural_document(int(n * 0.9)))
    if len(ids) < n:
        raise SystemExit(f"document too short: {len(ids)} < {n} tokens")
    ids = ids[:n]
    t0 = time.perf_counter()
    cap = prefill(lm, ids)
    prefill_s = time.perf_counter() - t0
    method = get_method("csattn")
    params = CSAttnParams()
    t0 = time.perf_counter()
    arrays = method.build(cap, params)
    build_s = time.perf_counter() - t0
    reader = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    index_bytes = sum(a.numel() * a.element_size() for a in arrays.values())
    kv_bytes = cap.k.numel() * 2 * 2  # as bf16 K + V, the size it would have on a GPU
    ctx = ContextKV(n, lambda name, layer: {"kv/k": cap.k, "kv/v": cap.v}[name][layer])
    q_ids = lm.question_ids(QUESTION)
    out = {"n_ctx": n, "prefill_s": prefill_s, "build_s": build_s, "build_s_per_1k": build_s / (n / 1000),
           "index_bytes": index_bytes, "index_over_bf16_kv": index_bytes / kv_bytes, "decode": {}}

    full = generate(lm, ctx, get_method("full").open(None, MethodParams(), n), MethodParams(), q_ids,
                    max_tokens=n_tokens)
    full_tps = len(full.token_ids) / full.decode_s
    out["decode"]["full"] = {"tokens": len(full.token_ids), "tok_s": full_tps, "select_s": full.stats.select_s,
                             "attend_s": full.stats.attend_s, "kv_fraction": full.stats.kv_fraction,
                             "text": lm.tokenizer.decode(full.token_ids)}
    print(f"[{n}] prefill {prefill_s:.1f}s, build {build_s:.1f}s ({build_s / (n / 1000):.2f}s per 1K), "
          f"index {index_bytes / 2**20:.1f} MiB = {index_bytes / kv_bytes:.2f}x bf16 KV")
    print(f"[{n}] full: {full_tps:.2f} tok/s ({len(full.token_ids)} tokens)")
    for name, extra in VARIANTS.items():
        p = CSAttnParams(**extra)
        res = generate(lm, ctx, method.open(reader, p, n), p, q_ids, max_tokens=n_tokens)
        tps = len(res.token_ids) / res.decode_s
        prefix = next((i for i, (a, b) in enumerate(zip(res.token_ids, full.token_ids)) if a != b),
                      min(len(res.token_ids), len(full.token_ids)))
        out["decode"][name] = {"tokens": len(res.token_ids), "tok_s": tps, "ratio_vs_full": tps / full_tps,
                               "select_s": res.stats.select_s, "attend_s": res.stats.attend_s,
                               "kv_fraction": res.stats.kv_fraction, "tokens_equal_to_full": prefix,
                               "text": lm.tokenizer.decode(res.token_ids)}
        print(f"[{n}] {name}: {tps:.2f} tok/s = {tps / full_tps:.2f}x full; select {res.stats.select_s:.2f}s "
              f"attend {res.stats.attend_s:.2f}s; KV touched {res.stats.kv_fraction:.3f}; "
              f"first {prefix}/{len(full.token_ids)} tokens equal to full's")
    # attention-level recall on this context (index rebuilt on all but the last 64 tokens)
    ctx_cap = truncate_capture(cap, n - 64)
    arr64 = method.build(ctx_cap, params)
    out["recall"] = {}
    for name, extra in list(VARIANTS.items())[:2]:
        for rho in (0.05, 0.10):
            rep = selection_recall(_Prebuilt(arr64), CSAttnParams(rho=rho, **extra), cap, n_queries=64, ratio=rho,
                                   layers=[0, 10, 20, 29])
            out["recall"][f"{name} rho={rho}"] = rep.summary()
            print(f"[{n}] recall {name} rho={rho}: {rep.summary()['recall']:.3f} "
                  f"(per layer {rep.summary()['recall_per_layer']})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8064])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", MODEL_CACHE)
    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{torch.get_num_threads()} torch threads", "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "params": CSAttnParams().model_dump(), "lengths": {}}
    for n in args.lengths:
        result["lengths"][n] = run_length(lm, n, args.tokens)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_csattn.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'bench_csattn.json'}")


if __name__ == "__main__":
    main()
