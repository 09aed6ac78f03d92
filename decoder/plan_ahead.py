"""Planning a layer ahead: `plan_next`, what `decoder.runner.Runner(plan_ahead=True)` runs on a
side stream (the runner's module docstring says when and why), and `PredictedQueries`, the same on
the transformers path as a planner wrapper around the model's own modules (the reference the
runner's tests compare with, and `benchmarks/bench_early_plans.py`'s `predict` section).

`PredictedQueries(inner, model, spec, lag, own_key, point)` plans layer L's one-token steps with a
query predicted from the residual stream at `point` of layer L - lag: layer L's input_layernorm,
q_proj and RoPE applied to it (InfiniGen's idea; the attention still uses the true query). Layers <
lag and multi-token chunks plan as usual. The points (`POINTS`):

* `"input"`: the residual entering layer L - lag (the prediction misses that layer's attention and
  MLP outputs): what the runner does;
* `"attention"`: the residual after layer L - lag's attention has been added, entering its MLP (the
  prediction misses only the MLP's output). At lag 1 its plans are as close to dense as the true
  query's, but a runner planning from there gains almost nothing: the search would overlap only
  the MLP's GEMMs, which leave it no SMs (benchmarks/RESULTS.md, "Where a B = 1 token's time
  goes"), so the runner does not offer it;
* `"delta"`: the residual entering layer L - lag plus the change those lag layers made to the step
  before's last token (a guess at what they will add now, available as early as "input"). At lag
  1 on the default model it recovers about half of "input"'s fidelity cost for topk and ctkvr at
  8K and none for kivf (same section), so the runner does not offer it either.

Planned that early, the step's own key does not exist yet:

* `own_key="hidden"`: the planner sees the request-local rows up to the token before;
* `own_key="predicted"`: the step's own row holds a key predicted the same way (layer L's k_proj
  and RoPE of that residual): what the runner writes into the slot before planning ahead (the
  true key replaces it before the attention reads it).

Forward pre-hooks on the model's decoder layers keep each layer's input (and, for "delta", its
change over the lag layers before), and for "attention" pre-hooks on their post_attention_layernorm
the residual after the attention; close() removes them. Llama-family modules (q_proj, k_proj,
input_layernorm, post_attention_layernorm, position_embeddings in the layer's kwargs).

**Staged values** (`Runner(stage_values=...)`, on by default on CUDA when it plans ahead under a
backend that keeps the context's values in host memory, `offload_v` or `offload`, with its row
cache): right after plan(L), the side stream also fills this step's region of the request's row
cache of layer L (`Request.row_cache`, `decoder/kernels/stage.py`) with the value rows that plan
attends: from the cache's other regions where the last two plans had them, else from host memory.
Layer L's attention then finds every plan row in the cache (only the frame's rows, contiguous, are
read in place), so the scattered PCIe reads leave layer L's critical path. Same bytes, same
kernels: the tokens equal the unstaged ones (tests/test_runner.py). Layer 0 and the question chunk
are not planned ahead (layer 0's attention fills its cache itself). Measured (benchmarks/RESULTS.md,
"Offload_v's reads", "Scattered host reads cost by count", "The attention reads the row cache"):
ctkvr at 128K, B = 8, 314.5 tokens/s against 295.8 unstaged when consecutive plans overlap as the
default model's do, 197.0 against 180.5 at random weights' chance overlap (csattn: 221.2 against
229.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from decoder.kernels.stage import stage_rows
from decoder.layers import apply_rope, rms_norm
from decoder.streams import fork_join
from indexer.base import KVView, Planner

OWN_KEYS = ("hidden", "predicted")
POINTS = ("input", "attention", "delta")  # where in layer L - lag the residual that predicts layer L's query is taken


@dataclass
class Ahead:
    """Plans of one layer made ahead (batch position -> Plan), queued on `stream` (None: done). `x`
    (the residual the side stream reads) is held until the join: freed earlier, the caching
    allocator could hand its memory to the main stream while the side stream still reads it.
    `staged`: the batch positions whose plan's value rows were staged into the layer's row cache
    (the runner's stage_values)."""

    stream: object  # torch.cuda.Stream | None
    plans: dict
    x: torch.Tensor
    staged: set = field(default_factory=set)

    def join(self) -> dict:
        if self.stream is not None:
            torch.cuda.current_stream(self.x.device).wait_stream(self.stream)
        return self.plans


def plan_next(runner, reqs: list, ahead: list[int], layer: int, x: torch.Tensor, cos, sin, q_pos: list,
              slots: list) -> Ahead:
    """`decoder.runner.Runner`'s planning ahead: plan `layer` of the one-token step for the runner's
    requests at batch positions `ahead`, from x [B, C], the residual stream entering layer - 1 (the
    runner's module docstring, "Planning ahead"; `PredictedQueries` at point "input"): on CUDA queued
    on the layer's side stream (`runner.ahead_streams`, by layer parity; joined by `Ahead.join`), else
    run here."""
    w = runner.w
    lw = w.layers[layer]
    h, kvh, d, g = w.n_heads, w.n_kv_heads, w.head_dim, w.group
    rows = (h + kvh) * d
    fk = runner.layer_kernels

    def predict():
        # every row of the batch (a GEMM's cost is its weight's bytes; selecting the rows of the
        # requests planned ahead would copy an index to the device, a host sync)
        wqk = lw.wqkv[:rows]
        bqk = lw.bqkv[:rows] if lw.bqkv is not None else None
        if fk is None:
            qk = F.linear(rms_norm(x, lw.ln1, w.eps), wqk, bqk)  # [B, (H + KVH) D]
            pq = apply_rope(qk[:, :h * d].view(-1, h, d), cos, sin)  # [B, H, D]
            pk = apply_rope(qk[:, h * d:].view(-1, kvh, d), cos, sin)  # [B, KVH, D]
        else:
            pq, pk = fk.rope_qk(F.linear(fk.rms_norm(x, lw.ln1, w.eps), wqk, bqk), cos, sin, h, kvh, d)

        def plan_one(i: int):
            r = reqs[i]
            loc_k = r.loc_k[layer]
            loc_k.index_copy_(1, slots[i], pk[i:i + 1].transpose(0, 1))  # the step's own slot: predicted
            qh = pq[i:i + 1].transpose(0, 1).reshape(kvh, g, 1, d)
            plan = r.planner.plan(layer, qh, KVView(*r.ctx_kv[layer], loc_k, r.loc_v[layer], q_pos[i]))
            if not runner.stage_values or plan.is_dense:
                return plan, False
            ctx_v = r.ctx_kv[layer][1]  # its cache's readers (this layer, steps before) ran before this fork
            stage_rows(ctx_v, plan.positions, r.sink, r.window, r.row_cache(layer, plan.width, ctx_v),
                       r.pos)
            return plan, True

        streams = None
        if runner.parallel and len(ahead) > 1:
            side = runner.ahead_side[layer % 2]
            while len(side) < len(ahead):
                side.append(torch.cuda.Stream(runner.device))
            streams = side[:len(ahead)]
        outs = fork_join(streams, [lambda i=i: plan_one(i) for i in ahead])
        return {i: p for i, (p, _) in zip(ahead, outs)}, {i for i, (_, s) in zip(ahead, outs) if s}

    if runner.ahead_streams is None:
        plans, staged = predict()
        return Ahead(None, plans, x, staged)
    stream = runner.ahead_streams[layer % 2]
    stream.wait_stream(torch.cuda.current_stream(runner.device))
    with torch.cuda.stream(stream):
        plans, staged = predict()
    return Ahead(stream, plans, x, staged)


class PredictedQueries(Planner):
    """The transformers-path reference of planning ahead (module docstring)."""

    def __init__(self, inner: Planner, model, spec, lag: int = 1, own_key: str = "predicted", point: str = "input"):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        if own_key not in OWN_KEYS:
            raise ValueError(f"own_key must be one of {OWN_KEYS}")
        if point not in POINTS:
            raise ValueError(f"point must be one of {POINTS}")
        self.inner, self.spec, self.lag, self.own_key, self.point = inner, spec, lag, own_key, point
        self.graph_safe = False  # the predictions live in Python state set by the hooks
        self._rope = apply_rotary_pos_emb
        self.inputs: dict[int, torch.Tensor] = {}  # layer -> its input residual [1, T, hidden] (this step)
        self.mids: dict[int, torch.Tensor] = {}  # layer -> its residual after the attention (this step)
        self.deltas: dict[int, torch.Tensor] = {}  # layer L -> input(L) - input(L - lag) of the step before
        self.predicted: dict[int, tuple] = {}  # layer -> predicted (q [KVH, G, T, D], k [KVH, T, D])
        layers = model.model.layers
        self.hooks = [layer.register_forward_pre_hook(self._hook(i, layers), with_kwargs=True)
                      for i, layer in enumerate(layers)]
        if point == "attention":
            self.hooks += [layer.post_attention_layernorm.register_forward_pre_hook(self._mid_hook(i))
                           for i, layer in enumerate(layers)]

    def _mid_hook(self, i: int):
        def hook(module, args):
            self.mids[i] = args[0]  # the residual after layer i's attention [1, T, hidden]
        return hook

    def _hook(self, i: int, layers):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]  # [1, T, hidden]
            self.inputs[i] = h
            self.predicted.pop(i, None)
            if i >= self.lag and h.shape[1] == 1:
                layer = layers[i]
                src = (self.mids if self.point == "attention" else self.inputs)[i - self.lag]
                if self.point == "delta" and i in self.deltas:
                    src = src + self.deltas[i]
                hn = layer.input_layernorm(src)
                d = self.spec.head_dim
                q = layer.self_attn.q_proj(hn).view(1, 1, -1, d).transpose(1, 2)  # [1, H, 1, D]
                k = layer.self_attn.k_proj(hn).view(1, 1, -1, d).transpose(1, 2)  # [1, KVH, 1, D]
                cos, sin = kwargs["position_embeddings"]
                q, k = self._rope(q, k, cos, sin)
                self.predicted[i] = (q[0].reshape(self.spec.num_kv_heads, self.spec.group_size, 1, d), k[0])
            if self.point == "delta" and i >= self.lag:  # this step's change over the lag layers (its last
                # token), for the next step
                self.deltas[i] = h[:, -1:] - self.inputs[i - self.lag][:, -1:]
        return hook

    def plan(self, layer, q, kv):
        got = self.predicted.get(layer)
        if got is None or q.shape[2] != 1:
            return self.inner.plan(layer, q, kv)
        qp, kp = got
        # kv.loc_k ends with the step's own row (the transformers path writes it before attention)
        if self.own_key == "hidden":
            early = KVView(kv.ctx_k, kv.ctx_v, kv.loc_k[:, :-1], kv.loc_v[:, :-1], kv.q_pos)
        else:
            early = KVView(kv.ctx_k, kv.ctx_v, torch.cat([kv.loc_k[:, :-1], kp.to(kv.loc_k)], dim=1), kv.loc_v,
                           kv.q_pos)
        return self.inner.plan(layer, qp.to(q.dtype), early)

    def update(self, layer, k, v, positions):
        self.inner.update(layer, k, v, positions)

    def stats(self):
        return self.inner.stats()

    def close(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.inner.close()
