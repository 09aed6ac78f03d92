"""Service-path baseline on the CPU: prefill throughput, artifact write, cold vs warm KV load,
decode tokens/s of full / topk / streaming over stored artifacts (same run, ratios vs full).

    python benchmarks/bench_service.py [--tokens 2048 8000] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import MODEL_CACHE, natural_document  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from indexer import DecodeContext, get_method  # noqa: E402
from storage.artifacts import ContextStore  # noqa: E402
from storage.keys import PromptHash  # noqa: E402
from storage.tier import DramTier  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    lm = load_model("smollm2-135m", MODEL_CACHE)
    q_ids = lm.question_ids("Summarize the text in one sentence.")
    rows = []
    for n in args.tokens:
        ids = (lm.context_ids(natural_document(int(n * 0.9))) * 8)[:n]
        t0 = time.perf_counter()
        cap = prefill(lm, ids, keep_q=False)
        t_prefill = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            store = ContextStore(tmp)
            key = PromptHash.compute(lm.spec.fingerprint, lm.spec.tokenizer_fingerprint, ids)
            t0 = time.perf_counter()
            manifest = store.publish(key, lm.spec, ids, cap.k, cap.v, [], {})
            t_write = time.perf_counter() - t0
            art = store.open(lm.spec.slug, key)
            tier = DramTier(8 << 30)
            load = lambda name, layer: tier.get((key.hex, name, layer), lambda: art.read(name, layer))[0]  # noqa: E731
            t0 = time.perf_counter()
            for layer in range(lm.spec.num_layers):
                load("kv/k", layer), load("kv/v", layer)
            t_cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            for layer in range(lm.spec.num_layers):
                load("kv/k", layer), load("kv/v", layer)
            t_warm = time.perf_counter() - t0
            ctx = ContextKV(n, load)
            dec = {}
            for name, over in [("full", {}), ("topk", {"ratio": 0.05}), ("streaming", {})]:
                m = get_method(name)
                p = m.Params().with_overrides(over)
                planner = m.open(None, p, DecodeContext(n, lm.spec, len(q_ids) + args.new))
                res = generate(lm, ctx, planner, p, q_ids, max_tokens=args.new)
                steps = max(len(res.token_ids) - 1, 1)
                dec[name] = {"tokens_per_s": steps / res.decode_s, "ttft_s": res.ttft_s, "kv_fraction": res.stats.kv_fraction}
        row = {"n_tokens": n, "prefill_tokens_per_s": n / t_prefill, "write_s": t_write, "bytes": manifest["bytes"],
               "kv_load_cold_s": t_cold, "kv_load_warm_s": t_warm, "decode": dec}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = ROOT / "benchmarks" / "out"
    out.mkdir(exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    (out / "bench_service.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n{meta}\n")
    print("| tokens | prefill tok/s | write s | MB | KV load cold ms | warm ms | full tok/s | topk 5% tok/s (×full) | streaming tok/s (×full) | topk KV frac |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["decode"]
        f = d["full"]["tokens_per_s"]
        print(f"| {r['n_tokens']} | {r['prefill_tokens_per_s']:.0f} | {r['write_s']:.2f} | {r['bytes'] / 1e6:.0f} | "
              f"{1000 * r['kv_load_cold_s']:.0f} | {1000 * r['kv_load_warm_s']:.2f} | {f:.1f} | "
              f"{d['topk']['tokens_per_s']:.1f} ({d['topk']['tokens_per_s'] / f:.2f}×) | "
              f"{d['streaming']['tokens_per_s']:.1f} ({d['streaming']['tokens_per_s'] / f:.2f}×) | {d['topk']['kv_fraction']:.3f} |")


if __name__ == "__main__":
    main()
