"""What planning ahead costs in fidelity, on the default model (CPU): a plan reused for later decode
steps, or a plan made from an earlier layer's residual stream.

A search per step is most of a sparse step's GPU time at B = 1 (benchmarks/RESULTS.md), and it sits
on the critical path: layer L's search needs layer L's query. Two ways to take it off:

* `reuse` (temporal): a layer plans every P-th one-token step and hands that plan to the P - 1 steps
  after it (no plan(), no update() on those steps; the frame still attends every new token).
  csattn offers this as its search period (`period`, the paper's schedules). P = 2 would halve the
  search's cost.
* `predict` (across layers, InfiniGen-style): layer L is planned with a query predicted from the
  residual stream that enters layer L - lag, through layer L's own input RMSNorm, q projection and
  RoPE; the attention still uses the true query. With lag 1 the search of layer L can run while
  layer L - 1 computes (on a side stream), off the critical path. Planned that early, the step's own
  key and value are not there yet: with `--own-key hidden` the planner sees the request-local rows
  up to the token before (the attention, run later, sees them all); with `predicted` the step's own
  row holds a key predicted the same way (layer L's k projection and RoPE of that residual), which is
  what `decoder/runner.py`'s `plan_ahead` writes there. lag 0: the true query with that same view.
  `--points attention`: the residual is taken after layer L - lag's attention instead of at its
  input (a runner planning from there overlaps that layer's MLP only: measured, not kept, RESULTS.md
  "Where a B = 1 token's time goes"); `delta`: at its input, plus the change those layers made to
  the step before's last token. `--widen F ...`: plans made ahead (lag >= 1) with the budget F times
  as wide (`MethodParams.widened`, what the service's `plan_ahead_widen` does), against lag 0 at the
  method's own budget.

Methods: those that stay close to dense attention at rho = 5% (`topk`, the exact oracle; `ctkvr`;
`kivf`) and `psa` by default, `csattn` and `lfps` with `--methods`; `saap` with `--saap-model DIR` (a trained model: its classifier decides the
plan, so random weights would say nothing; `--saap-nprobe`, default 2: the tests' small preset has
32 buckets, so saap's default of 32 is dense). Fidelity as in bench_psa_lfps.py: the last
`--positions` tokens of a document fed one at a time, top-1 agreement and KL(full || method) of the next-token distributions.

    python benchmarks/bench_early_plans.py --json benchmarks/results/bench_early_plans.json
    python benchmarks/bench_early_plans.py --doc-tokens 8000 --sections predict --json /tmp/early8k.json
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
from decoder.plan_ahead import OWN_KEYS, POINTS, PredictedQueries  # noqa: E402
from decoder.prefill import prefill  # noqa: E402
from evaluation.fidelity import fidelity, teacher_forced_logits  # noqa: E402
from indexer.base import Plan, Planner, get_method  # noqa: E402
from tests.conftest import MODEL_CACHE, natural_document  # noqa: E402

METHODS = [("topk 5%", "topk", {"ratio": 0.05}), ("ctkvr", "ctkvr", {}), ("kivf", "kivf", {}),
           ("psa eps=0.95", "psa", {"eps": 0.95}),
           # a wider budget planned ahead against the default one planned from the true query (--methods)
           ("topk 7.5%", "topk", {"ratio": 0.075}), ("kivf 7.5%", "kivf", {"ratio": 0.075}),
           ("ctkvr k=768", "ctkvr", {"k": 768}), ("psa eps=0.97", "psa", {"eps": 0.97}),
           ("csattn", "csattn", {}), ("lfps", "lfps", {})]
DEFAULT_METHODS = ["topk 5%", "ctkvr", "kivf", "psa eps=0.95"]
SECTIONS = ["reuse", "predict"]


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
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--own-key", nargs="+", default=["hidden"], choices=OWN_KEYS,
                    help="predict: what the planner sees in the step's own request-local row")
    ap.add_argument("--points", nargs="+", default=["input"], choices=POINTS,
                    help="predict: where in layer L - lag the residual is taken (its input, after its attention, "
                         "or its input plus the step before's change: decoder/plan_ahead.py)")
    ap.add_argument("--widen", type=float, nargs="+", default=[1.0],
                    help="predict: plan ahead (lag >= 1) with the method's budget this many times as wide "
                         "(MethodParams.widened; the service's plan_ahead_widen)")
    ap.add_argument("--saap-model", type=Path, default=None,
                    help="a trained SAAP model directory (e.g. the tests' `small` preset): adds saap to the methods")
    ap.add_argument("--saap-nprobe", type=int, default=2,
                    help="saap's buckets probed per step (the small preset has 32 buckets: the default 32 is dense)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="labels of METHODS to run (default: the four at their default budgets, and saap with --saap-model)")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    res: dict = {"machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "reuse": [], "predict": []}
    lm = load_model("smollm2-135m", MODEL_CACHE)
    ids = lm.context_ids(natural_document(int(a.doc_tokens * 0.86) + 50))[:a.doc_tokens]
    n_ctx = len(ids) - a.positions
    cap = prefill(lm, ids[:n_ctx])
    ctx = context_kv(cap)
    full = get_method("full")
    ref = teacher_forced_logits(lm, ctx, open_planner(full, full.Params(), cap, n_ctx, a.positions), full.Params(),
                                ids[n_ctx:])
    variants = {"reuse": ("period", [(p, None) for p in a.periods], lambda p, v: ReusedPlans(p, v[0])),
                "predict": ("lag", [(lag, own, pt, w) for lag in a.lags for own in a.own_key
                                    for pt in (a.points if lag else ["input"]) for w in (a.widen if lag else [1.0])],
                            lambda p, v: PredictedQueries(p, lm.model, lm.spec, *v[:3]))}
    saap = ("saap", "saap", {"model_dir": str(a.saap_model), "nprobe": a.saap_nprobe})
    methods = METHODS + ([saap] if a.saap_model else [])
    chosen = a.methods or DEFAULT_METHODS + (["saap"] if a.saap_model else [])
    methods = [m for m in methods if m[0] in chosen]
    for section in a.sections:
        key, values, wrap = variants[section]
        for label, name, kw in methods:
            m = get_method(name)
            for v in values:
                params = m.Params(**kw).widened(v[3] if v[1] is not None else 1.0)
                planner = wrap(open_planner(m, params, cap, n_ctx, a.positions), v)
                extra = {"own_key": v[1], "point": v[2], "widen": v[3]} if v[1] is not None else {}
                row = {"label": label, key: v[0], **extra,
                       **fidelity(ref, teacher_forced_logits(lm, ctx, planner, params, ids[n_ctx:]))}
                res[section].append(row)
                print(section, json.dumps(row), flush=True)
    res["machine"]["load_avg_end"] = machine()["load_avg"]
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
