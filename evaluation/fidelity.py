"""Measuring an approximate method against exact attention, on real captured tensors.

Two levels, shared by tests, benchmarks and `ctxcache eval`:

* attention level (`attention_metrics`, per layer and KV head; `selection_recall` is its per-layer
  view over a split capture: the first N - n_q tokens are the context the index is built from,
  the last n_q the decode steps): replay real queries step by step through a method's planner
  exactly as the decoder would (plan, run the `torch_ref` backend over frame ∪ plan, update), and
  compare with the exact top-K by group attention mass: recall, attention mass covered, fraction of
  KV touched, and the relative L2 error of the attention output vs dense attention. The attended set
  is `frame_mask` (sink, window, every request-local token, the plan; for a KV head, the union over
  its query group). `ctxcache eval` replays queries recorded during real generation (`QueryTrace`).
* model level (`teacher_forced_logits` + `fidelity`): feed a continuation token by token through
  the decoder with a method and compare next-token distributions with `full`: top-1 agreement
  and KL(full || method).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoder.backends import frame_fraction, frame_mask, get_backend
from decoder.backends.torch_ref import dense_attention
from decoder.generate import ContextKV, DecodeStep
from indexer.base import DecodeContext, IndexReader, KVView, Planner, PrefillCapture, SparseMethod


def truncate_capture(cap: PrefillCapture, n: int) -> PrefillCapture:
    return PrefillCapture(q=cap.q[:, :, :n], k=cap.k[:, :, :n], v=cap.v[:, :, :n], positions=cap.positions[:n], spec=cap.spec)


def build_index(method: SparseMethod, params, cap: PrefillCapture, env=None) -> IndexReader | None:
    """Build in memory what the prefill worker would persist; serve it per layer like the store."""
    if not method.has_index:
        return None
    arrays = method.build(cap, params, env)
    return IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))


@dataclass
class QueryTrace:
    """Real decode queries after a context, and the keys/values they append.

    q: [L, KVH, G, T, D]; k, v: [L, KVH, T, D]; step t sits at absolute position n_ctx + t.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    n_ctx: int

    @property
    def steps(self) -> int:
        return self.q.shape[3]

    @classmethod
    def from_capture(cls, cap: PrefillCapture, n_ctx: int) -> "QueryTrace":
        """The last tokens of a prefill capture as decode steps (consecutive prefill positions stand in
        for consecutive decode steps: same model, same causal attention)."""
        spec = cap.spec
        n_layers, _, n, d = cap.q.shape
        q = cap.q[:, :, n_ctx:].reshape(n_layers, spec.num_kv_heads, spec.group_size, n - n_ctx, d)
        return cls(q=q, k=cap.k[:, :, n_ctx:], v=cap.v[:, :, n_ctx:], n_ctx=n_ctx)


def nanmean(x: torch.Tensor, dim: int) -> torch.Tensor:
    ok = ~torch.isnan(x)
    s = torch.where(ok, x, torch.zeros_like(x)).sum(dim)
    cnt = ok.sum(dim)
    return torch.where(cnt > 0, s / cnt.clamp_min(1), torch.full_like(s, float("nan")))


def nan_to_none(x: float):
    return None if isinstance(x, float) and math.isnan(x) else x


def exact_topk_k(ratio: float, visible: int) -> int:
    """K of the exact top-K reference at a ratio of the visible tokens."""
    return min(visible, max(1, int(round(ratio * visible))))


@dataclass
class AttentionReport:
    """Attention-level comparison with exact attention, per layer and KV head (rows of layers not
    replayed are NaN / 0)."""

    recall: torch.Tensor  # [L, KVH] mean recall of the exact top-K
    mass: torch.Tensor  # [L, KVH] mean share of the exact group attention mass in the attended set
    rel_err: torch.Tensor  # [L, KVH] mean ||out - dense|| / ||dense|| over the head's query group
    touched: torch.Tensor  # [L, KVH] mean fraction of the visible KV attended
    layer_rel_err: torch.Tensor  # [L] mean over steps of the error over all heads of the layer
    bypass: torch.Tensor  # [L] fraction of (query head, step) pairs whose plan was bypassed (LFPS)
    layers: list[int]  # the layers replayed
    k_last: int  # K at the last query

    def summary(self) -> dict:
        ls = self.layers
        recall, mass = self.recall[ls], self.mass[ls]
        per_layer_recall = nanmean(recall, dim=1)
        return {
            "recall": nan_to_none(float(nanmean(recall.flatten(), dim=0))),
            "mass_recall": nan_to_none(float(nanmean(mass.flatten(), dim=0))),
            "rel_l2_err": float(self.layer_rel_err[ls].mean()),
            "kv_touched": float(self.touched[ls].mean()),
            "bypass_fraction": float(self.bypass[ls].mean()),
            "k": self.k_last,
            "recall_per_layer": [nan_to_none(round(float(x), 4)) for x in per_layer_recall],
            "rel_err_per_layer": [round(float(x), 4) for x in self.layer_rel_err[ls]],
            "touched_per_layer": [round(float(x), 4) for x in self.touched[ls].mean(1)],
            "recall_per_head": [[nan_to_none(round(float(x), 4)) for x in row] for row in recall],
            "mass_per_head": [[nan_to_none(round(float(x), 4)) for x in row] for row in mass],
            "rel_err_per_head": [[round(float(x), 4) for x in row] for row in self.rel_err[ls]],
            "touched_per_head": [[round(float(x), 4) for x in row] for row in self.touched[ls]],
        }


@torch.inference_mode()
def attention_metrics(
    planner: Planner,
    params,
    ctx_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    trace: QueryTrace,
    *,
    recall_ratio: float = 0.05,
    k: int | None = None,
    steps: int | None = None,
    layers: list[int] | None = None,
) -> AttentionReport:
    """Replay `trace` through `planner` step by step (every layer per step, in the decoder's order:
    plan, run `torch_ref` over frame ∪ plan, update with the step's key/value) and compare each
    layer's attention with exact attention, per KV head. The exact reference is the top-K by group
    attention mass (see indexer/topk.py), K = `k` or `recall_ratio` of the visible tokens."""
    from indexer.topk import group_attention_mass

    n_layers, kvh, g, t_all, d = trace.q.shape
    steps = t_all if steps is None else min(steps, t_all)
    layers = list(range(n_layers)) if layers is None else list(layers)
    scale = d ** -0.5
    sink, window = params.frame(trace.n_ctx)
    backend = get_backend("torch_ref")
    f64 = dict(dtype=torch.float64)
    rec_sum, mass_sum = torch.zeros(n_layers, kvh, **f64), torch.zeros(n_layers, kvh, **f64)
    err_sum, tch_sum = torch.zeros(n_layers, kvh, **f64), torch.zeros(n_layers, kvh, **f64)
    lerr_sum, bypass_sum = torch.zeros(n_layers, **f64), torch.zeros(n_layers, **f64)
    kk = 1
    for i in range(steps):
        p = trace.n_ctx + i
        q_pos = torch.tensor([p])
        for layer in layers:
            ctx_k, ctx_v = ctx_layer(layer)
            q = trace.q[layer, :, :, i:i + 1].to(ctx_k.dtype)  # [KVH, G, 1, D]
            loc_k, loc_v = trace.k[layer, :, :i + 1].to(ctx_k.dtype), trace.v[layer, :, :i + 1].to(ctx_k.dtype)
            kv = KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos)
            plan = planner.plan(layer, q, kv)
            out = backend.run(q, kv, plan, sink, window, scale)
            dense = dense_attention(q, kv, scale)
            gm = group_attention_mass(q, kv)  # [KVH, 1, p + 1], sums to G per head
            kk = min(k, p + 1) if k is not None else exact_topk_k(recall_ratio, p + 1)
            exact = torch.topk(gm, kk, dim=-1).indices  # [KVH, 1, K]
            attended = frame_mask(plan, kv, sink, window, g).any(1)  # [KVH, 1, p + 1]: read by some head of the group
            rec_sum[layer] += attended.gather(-1, exact).double().mean((-1, -2))  # [KVH]
            covered = (gm * attended).sum(-1).double()  # [KVH, 1]
            mass_sum[layer] += (covered[:, 0] / g).clamp(max=1.0)
            if plan.bypass is not None:
                bypass_sum[layer] += plan.bypass.double().mean()
            frac = frame_fraction(plan, kv, sink, window).double()[:, 0]
            diff = (out - dense).double()
            err_sum[layer] += diff.flatten(1).norm(dim=1) / dense.double().flatten(1).norm(dim=1).clamp_min(1e-12)
            lerr_sum[layer] += diff.norm() / dense.double().norm().clamp_min(1e-12)
            tch_sum[layer] += frac
            planner.update(layer, trace.k[layer, :, i:i + 1].to(ctx_k.dtype), trace.v[layer, :, i:i + 1].to(ctx_k.dtype),
                           q_pos)
    not_replayed = torch.ones(n_layers, dtype=torch.bool)
    not_replayed[layers] = False
    nan = float("nan")
    return AttentionReport(recall=(rec_sum / steps).masked_fill(not_replayed[:, None], nan).float(),
                           mass=(mass_sum / steps).masked_fill(not_replayed[:, None], nan).float(),
                           rel_err=(err_sum / steps).float(), touched=(tch_sum / steps).float(),
                           layer_rel_err=(lerr_sum / steps).float(), bypass=(bypass_sum / steps).float(), layers=layers,
                           k_last=kk)


@dataclass
class RecallReport:
    """Per-layer view of an `AttentionReport` (the layers replayed, in order)."""

    recall: torch.Tensor  # [L'] mean recall of the exact top-K per layer
    touched: torch.Tensor  # [L'] mean fraction of visible KV attended per layer
    rel_err: torch.Tensor  # [L'] mean ||out - dense|| / ||dense|| per layer
    k: int
    detail: AttentionReport

    def summary(self) -> dict:
        return {
            "recall": nan_to_none(float(nanmean(self.recall, dim=0))),
            "kv_touched": float(self.touched.mean()),
            "rel_l2_err": float(self.rel_err.mean()),
            "k": self.k,
            "recall_per_layer": [nan_to_none(round(float(x), 4)) for x in self.recall],
        }


def selection_recall(
    method: SparseMethod,
    params,
    cap: PrefillCapture,
    *,
    n_queries: int = 16,
    k: int | None = None,
    ratio: float | None = None,
    layers: list[int] | None = None,
    env=None,
) -> RecallReport:
    """Build the method's index over all but the last `n_queries` tokens of a capture, replay those
    as decode steps (`attention_metrics`) and report per layer: recall of the exact top-K (K = `k` or
    `ratio`, default 5%, of the visible tokens) by the attended set (frame ∪ plan), fraction of KV
    touched, relative L2 error of the attention output."""
    n_ctx = cap.n_tokens - n_queries
    index = build_index(method, params, truncate_capture(cap, n_ctx), env)
    planner = method.open(index, params, DecodeContext(n_ctx, cap.spec, n_queries, env))
    try:
        rep = attention_metrics(planner, params, lambda layer: (cap.k[layer, :, :n_ctx], cap.v[layer, :, :n_ctx]),
                                QueryTrace.from_capture(cap, n_ctx), recall_ratio=ratio or 0.05, k=k, layers=layers)
    finally:
        planner.close()
    ls = rep.layers
    return RecallReport(recall=nanmean(rep.recall[ls], dim=1), touched=rep.touched[ls].mean(1),
                        rel_err=rep.layer_rel_err[ls], k=rep.k_last, detail=rep)


@torch.inference_mode()
def teacher_forced_logits(lm, ctx: ContextKV, planner: Planner, params, token_ids: list[int], backend="torch_ref") -> torch.Tensor:
    """Next-token logits [T, V] after each of `token_ids`, fed one at a time after the context."""
    from transformers import DynamicCache

    model = lm.model
    device = next(model.parameters()).device
    step = DecodeStep(lm.spec, ctx, planner, params, get_backend(backend) if isinstance(backend, str) else backend, device)
    cache = DynamicCache(config=model.config)
    out_logits = []
    try:
        for i, tok in enumerate(token_ids):
            step.q_pos = torch.tensor([ctx.n_tokens + i], device=device)
            out = model(
                input_ids=torch.tensor([[tok]], device=device), position_ids=step.q_pos[None],
                past_key_values=cache, use_cache=True, logits_to_keep=1, ctx_step=step,
            )
            out_logits.append(out.logits[0, -1].float().cpu())
    finally:
        planner.close()
    return torch.stack(out_logits)


def fidelity(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(ref || method) over positions."""
    logp_ref = torch.log_softmax(ref_logits.double(), -1)
    logp = torch.log_softmax(logits.double(), -1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    agree = (ref_logits.argmax(-1) == logits.argmax(-1)).double()
    return {"top1_agreement": float(agree.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "positions": len(kl)}
