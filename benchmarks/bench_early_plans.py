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
  key and value are not there yet, so the planner sees the request-local rows up to the token before
  (the attention, run later, sees them all). lag 0: the true query with that same view.

Methods: those that stay close to dense attention at rho = 5% (`topk`, the exact oracle; `ctkvr`;
`kivf`) and `psa`. Fidelity as in bench_psa_lfps.py: the last `--positions` tokens of a document
fed one at a time, top-1 agreement and KL(full || method) of the next-token distributions.

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
from decoder.prefill import prefill  # noqa: E402
from evaluation.fidelity import fidelity, teacher_forced_logits  # noqa: E402
from indexer.base import KVView, Plan, Planner, get_method  # noqa: E402
from tests.conftest import MODEL_CACHE, natural_document  # noqa: E402

METHODS = [("topk 5%", "topk", {"ratio": 0.05}), ("ctkvr", "ctkvr", {}), ("kivf", "kivf", {}),
           ("psa eps=0.95", "psa", {"eps": 0.95})]
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


class PredictedQueries(Planner):
    """`inner` plans layer L's one-token steps with a query predicted from the residual stream entering
    layer L - lag (layer L's input_layernorm, q_proj and RoPE applied to it) and without the step's own
    key (not computed yet when planning ahead); layers < lag and multi-token chunks plan as usual. Forward pre-hooks on the model's decoder layers
    keep each layer's input; close() removes them."""

    def __init__(self, inner: Planner, model, spec, lag: int):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.inner, self.spec, self.lag = inner, spec, lag
        self._rope = apply_rotary_pos_emb
        self.inputs: dict[int, torch.Tensor] = {}  # layer -> its input residual [1, T, hidden] (this step)
        self.predicted: dict[int, torch.Tensor] = {}  # layer -> predicted q [KVH, G, T, D]
        layers = model.model.layers
        self.hooks = [layer.register_forward_pre_hook(self._hook(i, layers), with_kwargs=True)
                      for i, layer in enumerate(layers)]

    def _hook(self, i: int, layers):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]  # [1, T, hidden]
            self.inputs[i] = h
            self.predicted.pop(i, None)
            if i >= self.lag and h.shape[1] == 1:
                layer = layers[i]
                q = layer.self_attn.q_proj(layer.input_layernorm(self.inputs[i - self.lag]))  # [1, T, H·D]
                d = self.spec.head_dim
                q = q.view(1, h.shape[1], -1, d).transpose(1, 2)  # [1, H, T, D]
                cos, sin = kwargs["position_embeddings"]
                q, _ = self._rope(q, q, cos, sin)
                self.predicted[i] = q[0].reshape(self.spec.num_kv_heads, self.spec.group_size, -1, d)
        return hook

    def plan(self, layer, q, kv):
        qp = self.predicted.get(layer)
        if qp is None or q.shape[2] != 1:
            return self.inner.plan(layer, q, kv)
        # planned ahead, the step's own key and value do not exist yet: the request-local rows end
        # one token earlier (the frame's attention, run later, still sees them)
        early = KVView(kv.ctx_k, kv.ctx_v, kv.loc_k[:, :-1], kv.loc_v[:, :-1], kv.q_pos)
        return self.inner.plan(layer, qp.to(q.dtype), early)

    def update(self, layer, k, v, positions):
        self.inner.update(layer, k, v, positions)

    def stats(self):
        return self.inner.stats()

    def close(self):
        for h in self.hooks:
            h.remove()
        self.inner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    ap.add_argument("--periods", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
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
    variants = {"reuse": ("period", a.periods, lambda p, v: ReusedPlans(p, v)),
                "predict": ("lag", a.lags, lambda p, v: PredictedQueries(p, lm.model, lm.spec, v))}
    for section in a.sections:
        key, values, wrap = variants[section]
        for label, name, kw in METHODS:
            m = get_method(name)
            params = m.Params(**kw)
            for v in values:
                planner = wrap(open_planner(m, params, cap, n_ctx, a.positions), v)
                row = {"label": label, key: v,
                       **fidelity(ref, teacher_forced_logits(lm, ctx, planner, params, ids[n_ctx:]))}
                res[section].append(row)
                print(section, json.dumps(row), flush=True)
    res["machine"]["load_avg_end"] = machine()["load_avg"]
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
