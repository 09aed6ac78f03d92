"""Fidelity of `full` attention over a context whose K/V are stored in bfloat16 (or float16) against
the same context stored in float32, on the real default model (SmolLM2-135M, float32 weights, CPU,
`torch_ref`): the service's decode path end to end (`build_context(kv_dtype=...)` -> zarr -> DRAM
tier -> `open_context` -> the model with the attention hook).

    python benchmarks/kv_dtype_fidelity.py                 # bfloat16 vs float32, 32 new tokens
    python benchmarks/kv_dtype_fidelity.py --dtype float16

Per question, both contexts:
* teacher-forced: question + the float32 greedy answer in one forward over each context; the
  logits at every answer position (the question's last token's = the first answer token's, then
  one per answer token): max and mean |difference|, and top-1 agreement (argmax equal) per position;
* free-running: greedy decoding of `--new-tokens` tokens over each; the positions where the two
  answers agree (and the first divergence).
Also the stored bytes per context token of each dtype (manifest `nbytes` of kv/k + kv/v) and the
decode time of the greedy run. Writes benchmarks/results/kv_dtype_fidelity.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import MODEL_CACHE, PASSKEY_QUESTION, natural_document, passkey_document  # noqa: E402
from decoder.generate import DecodeStep, generate  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.pipeline import ContextTiers, build_context, open_context  # noqa: E402
from indexer.base import get_method  # noqa: E402
from storage.artifacts import ContextStore  # noqa: E402
from storage.keys import PromptHash  # noqa: E402

# (document, questions): a passkey document (three depths) and the tests' natural document
CASES = [
    ("passkey-71432-d0.2", lambda: passkey_document(71432, depth=0.2), [PASSKEY_QUESTION]),
    ("passkey-68923-d0.5", lambda: passkey_document(68923, depth=0.5), [PASSKEY_QUESTION]),
    ("passkey-30517-d0.8", lambda: passkey_document(30517, depth=0.8), [PASSKEY_QUESTION]),
    ("natural-1100w", lambda: natural_document(1100),
     ["Who validates the manifest?", "What does the scheduler do?", "Summarize the text in one sentence."]),
]


@torch.inference_mode()
def forced_logits(lm, opened, params, ids: list[int], n_ctx: int) -> torch.Tensor:
    """Logits [len(ids), vocab] (float32) of one forward of `ids` after the stored context, through
    the same attention hook as `generate` (teacher forcing: every position in one step)."""
    from transformers import DynamicCache

    model = lm.model
    step = DecodeStep(lm.spec, opened.kv, opened.planner, params, opened.backend, "cpu")
    step.q_pos = torch.arange(n_ctx, n_ctx + len(ids))
    try:
        out = model(input_ids=torch.tensor([ids]), position_ids=step.q_pos[None], past_key_values=DynamicCache(
            config=model.config), use_cache=True, logits_to_keep=0, ctx_step=step)
    finally:
        opened.planner.close()
    return out.logits[0].float()


def run(dtype: str, new_tokens: int) -> dict:
    torch.set_num_threads(1)  # as the tests: steadier timings on a shared small machine
    lm = load_model("smollm2-135m", MODEL_CACHE)
    spec = lm.spec
    full = get_method("full")
    params = full.Params()
    store = ContextStore(Path(tempfile.mkdtemp(prefix="kvdt-")) / "contexts")
    rows, bytes_per_token = [], {}
    for name, make_doc, questions in CASES:
        ids = lm.context_ids(make_doc())
        arts = {}
        for dt in ("float32", dtype):
            key = PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, ids, dt)
            man = build_context(lm, store, key, ids, {}, kv_dtype=dt).manifest
            bytes_per_token[dt] = (man["arrays"]["kv/k"]["nbytes"] + man["arrays"]["kv/v"]["nbytes"]) / len(ids)
            arts[dt] = (store.open(spec.slug, key), key.hex)

        def opened(dt: str, max_local: int):
            art, cid = arts[dt]
            return open_context(art, cid, full, params, None, tiers=ContextTiers(1 << 31), spec=spec,
                                max_local=max_local)

        for question in questions:
            q = lm.question_ids(question)
            greedy = {}
            for dt in ("float32", dtype):
                o = opened(dt, len(q) + new_tokens + 1)
                t0 = time.perf_counter()
                res = generate(lm, o.kv, o.planner, params, q, backend=o.backend, max_tokens=new_tokens)
                greedy[dt] = (res.token_ids, time.perf_counter() - t0)
            ref = greedy["float32"][0]
            forced_ids = q + ref[:-1] if ref else q
            la, lb = (forced_logits(lm, opened(dt, len(forced_ids) + 1), params, forced_ids, len(ids))
                      for dt in ("float32", dtype))
            la, lb = la[len(q) - 1:], lb[len(q) - 1:]  # the answer positions
            diff = (la - lb).abs()
            other = greedy[dtype][0]
            n = min(len(ref), len(other))
            agree = [a == b for a, b in zip(ref, other)]
            rows.append({
                "document": name, "n_ctx": len(ids), "question": question,
                "answer_float32": lm.tokenizer.decode(ref), f"answer_{dtype}": lm.tokenizer.decode(other),
                "forced_positions": int(la.shape[0]),
                "logit_max_abs_diff": float(diff.max()),
                "logit_mean_abs_diff": float(diff.mean()),
                "first_logit_max_abs_diff": float(diff[0].max()),
                "logit_scale_mean_abs": float(la.abs().mean()),
                "forced_top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).float().mean()),
                "greedy_tokens": [len(ref), len(other)],
                "greedy_agree_positions": int(sum(agree)), "greedy_compared": n,
                "greedy_identical": ref == other,
                "greedy_first_divergence": next((i for i, a in enumerate(agree) if not a),
                                                None if len(ref) == len(other) else n),
                "decode_s": {dt: round(s, 3) for dt, (_, s) in greedy.items()},
            })
            print(json.dumps(rows[-1]), flush=True)
    forced = [r["forced_top1_agreement"] * r["forced_positions"] for r in rows]
    summary = {
        "questions": len(rows),
        "logit_max_abs_diff": max(r["logit_max_abs_diff"] for r in rows),
        "logit_mean_abs_diff": sum(r["logit_mean_abs_diff"] * r["forced_positions"] for r in rows)
        / sum(r["forced_positions"] for r in rows),
        "forced_top1_agreement": sum(forced) / sum(r["forced_positions"] for r in rows),
        "greedy_identical": sum(r["greedy_identical"] for r in rows),
        "greedy_agree_positions": sum(r["greedy_agree_positions"] for r in rows),
        "greedy_compared": sum(r["greedy_compared"] for r in rows),
        "bytes_per_token": bytes_per_token,
        "decode_s": {dt: round(sum(r["decode_s"][dt] for r in rows), 2) for dt in ("float32", dtype)},
    }
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''} cpu, {torch.get_num_threads()} torch thread".strip(),
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "model": spec.name, "model_dtype": spec.dtype, "kv_dtype": dtype, "method": "full", "backend": "torch_ref",
        "new_tokens": new_tokens, "summary": summary, "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_dtype_fidelity.json")
    args = ap.parse_args()
    result = run(args.dtype, args.new_tokens)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
