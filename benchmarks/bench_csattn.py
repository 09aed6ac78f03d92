"""CPU benchmark of `csattn` with the real default model (SmolLM2-135M) against `full`, one run.

Per context length (2K and 8K tokens of the deterministic prose document from tests/conftest.py):
prefill capture, csattn build time (per 1K context tokens), then greedy decode of a question
through `decoder.generate` (the `torch_ref` backend, a ContextKV over the captured tensors, as
evaluation/fidelity.py does) for `full`, csattn (default scoring), csattn with the paper's
reduce-by-key, and csattn with the 0.20-step-8 schedule. Reported: decode tokens/s (median over
`--repeats` runs), host time in plan / run (attention backend) and per layer-step, the ratio to
`full` measured in the same run, the fraction of KV attended, how many leading greedy tokens equal
full's, and attention recall of the exact top-K (64 replayed queries, layers 0, 10, 20, 29).

    PYTHONUNBUFFERED=1 python benchmarks/bench_csattn.py [--lengths 2048 8064] [--tokens 32] [--threads 1]

Writes benchmarks/out/bench_csattn.json (or --out). 8064 (not 8192) leaves room for question +
answer within the model's 8192 positions. `--cache DIR` keeps the prefill captures there (safetensors)
so that a second run skips the prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import MODEL_CACHE, natural_document  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from evaluation.fidelity import selection_recall, truncate_capture  # noqa: E402
from indexer.base import DecodeContext, IndexReader, PrefillCapture, get_method  # noqa: E402
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

    def build(self, prefill, params, env=None):
        return self.arrays


def capture(lm, n: int, cache: Path | None) -> tuple[PrefillCapture, float]:
    ids = lm.context_ids(natural_document(int(n * 0.9)))
    if len(ids) < n:
        raise SystemExit(f"document too short: {len(ids)} < {n} tokens")
    ids = ids[:n]
    path = cache / f"smollm2-prose-{n}.safetensors" if cache else None
    if path is not None and path.exists():
        d = load_file(path)
        return PrefillCapture(d["q"], d["k"], d["v"], d["positions"], lm.spec), float("nan")
    t0 = time.perf_counter()
    cap = prefill(lm, ids)
    took = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"q": cap.q.contiguous(), "k": cap.k.contiguous(), "v": cap.v.contiguous(),
                   "positions": cap.positions.contiguous()}, path)
    return cap, took


def decode(lm, ctx, method, reader, params, q_ids, n_tokens, repeats) -> dict:
    """Greedy decode `repeats` times (same tokens each time); medians of the timings."""
    runs = []
    for _ in range(repeats):
        planner = method.open(reader, params, DecodeContext(ctx.n_tokens, lm.spec, len(q_ids) + n_tokens))
        res = generate(lm, ctx, planner, params, q_ids, max_tokens=n_tokens)
        runs.append(res)
    res = runs[0]
    layer_steps = res.stats.steps * lm.spec.num_layers
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    return {"tokens": len(res.token_ids), "steps": res.stats.steps,
            "tok_s": med(lambda r: len(r.token_ids) / r.decode_s),
            "tok_s_all": [len(r.token_ids) / r.decode_s for r in runs],
            "plan_s": med(lambda r: r.stats.plan_s), "run_s": med(lambda r: r.stats.run_s),
            "plan_ms_per_layer_step": med(lambda r: r.stats.plan_s) / layer_steps * 1e3,
            "run_ms_per_layer_step": med(lambda r: r.stats.run_s) / layer_steps * 1e3,
            "kv_fraction": res.stats.kv_fraction, "token_ids": res.token_ids,
            "text": lm.tokenizer.decode(res.token_ids)}


def run_length(lm, n: int, n_tokens: int, repeats: int, cache: Path | None) -> dict:
    cap, prefill_s = capture(lm, n, cache)
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
    print(f"[{n}] prefill {prefill_s:.1f}s, build {build_s:.1f}s ({build_s / (n / 1000):.2f}s per 1K), "
          f"index {index_bytes / 2**20:.1f} MiB = {index_bytes / kv_bytes:.2f}x bf16 KV")
    full_m = get_method("full")
    full = out["decode"]["full"] = decode(lm, ctx, full_m, None, full_m.Params(), q_ids, n_tokens, repeats)
    print(f"[{n}] full: {full['tok_s']:.2f} tok/s ({full['tokens']} tokens); run {full['run_ms_per_layer_step']:.3f} "
          f"ms per layer-step")
    for name, extra in VARIANTS.items():
        r = decode(lm, ctx, method, reader, CSAttnParams(**extra), q_ids, n_tokens, repeats)
        r["ratio_vs_full"] = r["tok_s"] / full["tok_s"]
        r["tokens_equal_to_full"] = next((i for i, (a, b) in enumerate(zip(r["token_ids"], full["token_ids"])) if a != b),
                                         min(r["tokens"], full["tokens"]))
        out["decode"][name] = r
        print(f"[{n}] {name}: {r['tok_s']:.2f} tok/s = {r['ratio_vs_full']:.2f}x full; plan {r['plan_s']:.2f}s "
              f"({r['plan_ms_per_layer_step']:.3f} ms per layer-step) run {r['run_s']:.2f}s "
              f"({r['run_ms_per_layer_step']:.3f} ms); KV touched {r['kv_fraction']:.3f}; "
              f"first {r['tokens_equal_to_full']}/{full['tokens']} tokens equal to full's")
    # attention-level recall on this context (index rebuilt on all but the last 64 tokens)
    arr64 = method.build(truncate_capture(cap, n - 64), params)
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
    ap.add_argument("--repeats", type=int, default=1, help="decode runs per variant (median timings)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--cache", type=Path, default=None, help="folder for prefill captures (reused when present)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "bench_csattn.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", MODEL_CACHE)
    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{torch.get_num_threads()} torch threads", "torch": torch.__version__,
              "load_avg_start": os.getloadavg(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "params": CSAttnParams().model_dump(), "lengths": {}}
    for n in args.lengths:
        result["lengths"][n] = run_length(lm, n, args.tokens, args.repeats, args.cache)
    result["load_avg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
