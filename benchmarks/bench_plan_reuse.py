"""What reusing a plan across decode steps costs in fidelity, on the default model (CPU).

A search per step is most of a sparse step's GPU time at B = 1 (benchmarks/RESULTS.md), so a plan
kept for P one-token steps would divide that cost by P. csattn offers it as its search period
(`period`, the paper's schedules); this measures it for the methods that stay close to dense
attention at rho = 5% (`topk`, the exact oracle; `ctkvr`; `kivf`): a wrapper planner plans every
P-th one-token step of a layer and hands the same plan to the P - 1 steps after it (no plan(), no
update() on those steps; the frame still attends every new token). Fidelity as in
bench_psa_lfps.py: the last `--positions` tokens of a ~2K document fed one at a time, top-1
agreement and KL(full || method) of the next-token distributions.

    python benchmarks/bench_plan_reuse.py --json benchmarks/results/bench_plan_reuse.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_psa_lfps import context_kv, machine, open_planner  # noqa: E402
from decoder.model import load_model  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from evaluation.fidelity import fidelity, teacher_forced_logits  # noqa: E402
from indexer.base import Plan, Planner, get_method  # noqa: E402
from tests.conftest import MODEL_CACHE, natural_document  # noqa: E402

METHODS = [("topk 5%", "topk", {"ratio": 0.05}), ("ctkvr", "ctkvr", {}), ("kivf", "kivf", {})]


class ReusedPlans(Planner):
    """`inner`'s plan of a layer's one-token step, reused for the `period` - 1 one-token steps after it
    (multi-token chunks always plan). update() reaches `inner` only after a step it planned."""

    def __init__(self, inner: Planner, period: int):
        self.inner, self.period = inner, period
        self.steps: dict[int, int] = {}  # layer -> one-token steps seen
        self.last: dict[int, Plan] = {}

    def _reused(self, layer: int, t: int) -> bool:
        return t == 1 and self.steps.get(layer, 0) % self.period != 0 and layer in self.last

    def plan(self, layer, q, kv):
        if self._reused(layer, q.shape[2]):
            return self.last[layer]
        self.last[layer] = self.inner.plan(layer, q, kv)
        return self.last[layer]

    def update(self, layer, k, v, positions):
        reused = self._reused(layer, positions.shape[0])
        if positions.shape[0] == 1:
            self.steps[layer] = self.steps.get(layer, 0) + 1
        if not reused:
            self.inner.update(layer, k, v, positions)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    res: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "rows": []}
    lm = load_model("smollm2-135m", MODEL_CACHE)
    ids = lm.context_ids(natural_document(int(a.doc_tokens * 0.86) + 50))[:a.doc_tokens]
    n_ctx = len(ids) - a.positions
    cap = prefill(lm, ids[:n_ctx])
    ctx = context_kv(cap)
    full = get_method("full")
    ref = teacher_forced_logits(lm, ctx, open_planner(full, full.Params(), cap, n_ctx, a.positions), full.Params(),
                                ids[n_ctx:])
    for label, name, kw in METHODS:
        m = get_method(name)
        params = m.Params(**kw)
        for period in a.periods:
            planner = ReusedPlans(open_planner(m, params, cap, n_ctx, a.positions), period)
            row = {"label": label, "period": period,
                   **fidelity(ref, teacher_forced_logits(lm, ctx, planner, params, ids[n_ctx:]))}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    res["machine"]["load_avg_end"] = machine()["load_avg"]
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
