"""How many of a decode step's planned context rows the step before already read, on the default
model's captured Q/K/V (CPU): what a GPU-side cache of recently read value rows would save the
offload backends, whose reads of scattered host rows are bound by the GPU's address translation,
not by bytes (benchmarks/RESULTS.md, "Scattered host reads").

For each method, the last `--positions` tokens of a document are replayed as one-token steps
(`bench_psa_lfps.replay`: captured queries, exact context K/V). Per layer and KV head, a step's
planned positions outside the frame are compared with:

* `prev`: the positions the step before planned (a cache holding exactly the last plan);
  This is the hit rate of the row cache the staging kernel keeps (`decoder.kernels.stage.RowCache`).
* `last g`: the positions any of the g steps before planned (a cache of the last g plans' rows).
* `cache C`: the alternative it was chosen over, a direct-mapped cache of C slots per layer and
  head, a slot per N / C consecutive positions, filled with the first planned position of a bucket
  that misses (one writer per slot per step, so no races); C = the plan's K times 1, 2, 4.

    python benchmarks/bench_value_reuse.py [--doc-tokens 8000] [--positions 32] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_psa_lfps import machine, open_planner, replay  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from indexer.base import get_method  # noqa: E402
from tests.conftest import MODEL_CACHE, natural_document  # noqa: E402

METHODS = [("topk 5%", "topk", {"ratio": 0.05}), ("ctkvr", "ctkvr", {}), ("kivf 5%", "kivf", {}),
           ("csattn", "csattn", {}), ("psa eps=0.95", "psa", {"eps": 0.95})]


def reuse(steps: list[list[torch.Tensor]], n: int, factors=(1, 2, 4)) -> dict:
    """steps[t][layer]: [KVH, K] planned positions (-1 empty). Hit fractions (module docstring)."""
    layers, kvh = len(steps[0]), steps[0][0].shape[0]
    k = max(int((p >= 0).sum(-1).max()) for s in steps for p in s)
    out = {"k": k, "n": n}
    planned = 0
    back = {1: 0, 2: 0, 4: 0}  # g -> rows one of the last g plans had
    caches = {f: torch.full((layers, kvh, f * k), -1, dtype=torch.long) for f in factors}
    hits = dict.fromkeys(factors, 0)
    for t, step in enumerate(steps):
        for layer, pos in enumerate(step):
            for h in range(kvh):
                p = torch.unique(pos[h][pos[h] >= 0].long())  # sorted
                if t:
                    planned += p.numel()
                    for g in back:
                        before = torch.cat([steps[u][layer][h] for u in range(max(0, t - g), t)])
                        back[g] += int(torch.isin(p, before[before >= 0].long()).sum())
                for f, cache in caches.items():
                    c = cache.shape[-1]
                    bucket = p * c // n
                    hit = cache[layer, h, bucket] == p
                    if t:
                        hits[f] += int(hit.sum())
                    first = torch.ones_like(p, dtype=torch.bool)
                    first[1:] = bucket[1:] != bucket[:-1]
                    ins = first & ~hit
                    cache[layer, h, bucket[ins]] = p[ins]
    out["prev"] = back.pop(1) / max(planned, 1)
    out.update({f"last {g}": v / max(planned, 1) for g, v in back.items()})
    out.update({f"cache {f}k": hits[f] / max(planned, 1) for f in factors})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doc-tokens", type=int, default=8000)
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model("smollm2-135m", MODEL_CACHE)
    ids = lm.context_ids(natural_document(int(a.doc_tokens * 0.86) + 50))[:a.doc_tokens]
    n_ctx = len(ids) - a.positions
    cap = prefill(lm, ids)
    res = {"machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "rows": []}
    for label, name, kw in METHODS:
        if a.methods and label not in a.methods and name not in a.methods:
            continue
        m = get_method(name)
        planner = open_planner(m, m.Params(**kw), cap, n_ctx, a.positions)
        steps, cur = [], []
        for layer, q, kv in replay(cap, n_ctx):
            plan = planner.plan(layer, q, kv)
            planner.update(layer, kv.loc_k[:, -1:], kv.loc_v[:, -1:], kv.q_pos)
            if plan.is_dense:
                break
            cur.append(plan.positions[:, 0].clone())
            if len(cur) == cap.spec.num_layers:
                steps.append(cur)
                cur = []
        planner.close()
        if not steps:
            print(label, "plans dense: skipped", flush=True)
            continue
        row = {"label": label, **reuse(steps, n_ctx)}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
