"""The decode worker's path before and after the plan/run redesign, same machine, same run:
ms per generated token over a stored context, and host->device copies per step on a GPU.

    # after (this tree) and before (a copy of the tree at the commit before the redesign, e.g. a
    # `git worktree add ../old <commit>`), one process each:
    python benchmarks/decode_before_after.py --impl new --device cuda --model random --n-ctx 8192
    PYTHONPATH=../old python benchmarks/decode_before_after.py --impl old --device cuda --model random --n-ctx 8192
    python benchmarks/decode_before_after.py --impl new --device cpu --model default --n-ctx 2048 8000

`--model random`: a SmolLM2-135M-shaped Llama at random weights (float32, as the service loads the
default model), token ids at random; `--model default`: the real default model over the tests'
natural document. `old` reproduces the old decode worker: arrays from a DRAM tier (host tensors),
`ContextKV.layer` and the index reader copy them to the decode device on every layer of every
step, `session.select` + `merge_selection` + `sparse_attention`. `new` is `decoder.pipeline`
(zarr store -> DRAM tier -> GPU tier, `open_context`, planner + `torch_ref` backend). Methods: full,
topk, streaming and the index methods given with --methods (built once per length, same params in
both trees). 32 new tokens after a 16-token question; a first request warms tiers and kernels, the
second is timed. One JSON line per (impl, n, method); $OUT/decode_before_after_<impl>_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent


def random_model(n_ctx: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention
    from decoder.model import LoadedModel, ModelSpec

    register_attention()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=n_ctx + 1024,
                      rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(device).eval()
    m.config._attn_implementation = ATTN_IMPLEMENTATION
    spec = ModelSpec(name="smollm2-shaped-random", fingerprint="0" * 64, tokenizer_fingerprint="0" * 64,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_positions=n_ctx + 1024,
                     rope_theta=100000.0, rope_type="default", dtype="float32")
    return LoadedModel(spec=spec, tokenizer=None, model=m)


def h2d_per_step(fn, steps: int) -> dict:
    """Host->device copies per step (count, device time), from the torch profiler's CUDA events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n, us = 0, 0.0
    for e in prof.key_averages():
        if "HtoD" in e.key or "Host to Device" in e.key:
            n += e.count
            us += float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) or 0.0)
    return {"h2d_copies_per_step": n / steps, "h2d_ms_per_step": us / 1e3 / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["old", "new"], required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=["random", "default"], default="random")
    ap.add_argument("--n-ctx", type=int, nargs="+", default=[8192])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=["full", "topk", "streaming"])
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.impl == "new":
        sys.path.insert(0, str(HERE))
    sys.path.append(str(HERE / "tests"))
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = a.device
    from decoder.generate import ContextKV, generate
    from decoder.prefill import prefill
    from indexer.base import get_method

    rows = []
    tmp = tempfile.TemporaryDirectory()
    for n_ctx in a.n_ctx:
        if a.model == "random":
            lm = random_model(n_ctx, dev)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 49152, (n_ctx,), generator=g).tolist()
            question = torch.randint(0, 49152, (16,), generator=g).tolist()
        else:
            from conftest import MODEL_CACHE, natural_document
            from decoder.model import load_model

            lm = load_model("smollm2-135m", MODEL_CACHE, device=dev)
            ids = (lm.context_ids(natural_document(int(n_ctx * 0.9))) * 8)[:n_ctx]
            question = lm.question_ids("Summarize the text in one sentence.")
            lm.eos_token_ids = ()  # always generate --tokens tokens
        spec = lm.spec
        with torch.inference_mode():
            cap = prefill(lm, ids)  # captured to host memory, as the prefill worker stores it
        for name in a.methods:
            method = get_method(name)
            params = method.Params()
            if a.impl == "old":
                from indexer.base import IndexReader
                from storage.tier import DramTier

                tier = DramTier(8 << 30)
                host = {"kv/k": cap.k, "kv/v": cap.v}
                arrays = method.build(cap, params) if method.has_index else {}
                host.update({f"idx/{k}": v.cpu() for k, v in arrays.items()})

                def load(nm, layer):
                    return tier.get((nm, layer), lambda: host[nm][layer])[0]

                def request(max_tokens):
                    ctx = ContextKV(n_ctx, load, dev)  # the old worker: DRAM tier, .to(dev) per layer and step
                    index = (IndexReader(lambda nm, layer: load(f"idx/{nm}", layer).to(dev), sorted(arrays))
                             if arrays else None)
                    return generate(lm, ctx, method.open(index, params, n_ctx), params, question, max_tokens=max_tokens)
            else:
                from decoder.pipeline import ContextTiers, build_context, open_context
                from storage.artifacts import ContextStore
                from storage.keys import PromptHash

                store = ContextStore(Path(tmp.name) / "contexts")
                key = PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, ids)
                index_id = method.index_id(params, spec) if method.has_index else None
                todo = {index_id: (method, params)} if index_id else {}
                have = store.read_manifest(spec.slug, key)["indexes"] if store.exists(spec.slug, key) else {}
                if not store.exists(spec.slug, key) or (index_id and index_id not in have):
                    build_context(lm, store, key, ids, todo)
                art = store.open(spec.slug, key)
                tiers = ContextTiers(8 << 30, 8 << 30, dev)

                def request(max_tokens):
                    o = open_context(art, key.hex, method, params, index_id, tiers=tiers, spec=spec,
                                     backend="torch_ref", max_local=len(question) + max_tokens)
                    return generate(lm, o.kv, o.planner, params, question, backend=o.backend, max_tokens=max_tokens)

            with torch.inference_mode():
                request(a.tokens)  # warm-up: tiers, kernels
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                res = request(a.tokens)
                steps = len(res.token_ids)
                row = {"impl": a.impl, "device": dev, "model": a.model, "method": name, "n_ctx": n_ctx, "tokens": steps,
                       "ms_per_token": 1e3 * res.decode_s / max(steps - 1, 1), "ttft_ms": 1e3 * res.ttft_s,
                       "kv_fraction": res.stats.kv_fraction, "threads": torch.get_num_threads()}
                if dev.startswith("cuda"):
                    row.update(h2d_per_step(lambda: request(4), 4))
                    row["gpu"] = torch.cuda.get_device_name()
            print(json.dumps(row), flush=True)
            rows.append(row)
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode_before_after_{a.impl}_{dev.split(':')[0]}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
