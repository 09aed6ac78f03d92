"""Measuring an approximate method against exact attention, on real captured tensors.

Two levels, shared by tests, benchmarks and `ctxcache eval`:

* attention level (`attention_metrics`, per layer and KV head; `selection_recall` is its per-layer
  view over a split capture: the first N - n_q tokens are the context the index is built from,
  the last n_q the decode steps): replay real queries step by step through a method session
  exactly as the decoder would (select or attend, union with sink + window, append), and compare
  with the exact top-K by group attention mass: recall, attention mass covered, fraction of KV
  touched, and the relative L2 error of the attention output vs dense attention. `ctxcache eval`
  replays queries recorded during real generation (`QueryTrace`) the same way.
* model level (`teacher_forced_logits` + `fidelity`): feed a continuation token by token through
  the decoder with a method and compare next-token distributions with `full`: top-1 agreement
  and KL(full || method).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decoder.attention import dense_attention, merge_selection, sparse_attention
from decoder.generate import ContextKV, DecodeStep
from indexer.base import IndexReader, KVView, MethodSession, PrefillCapture, SparseMethod


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
    replayed are NaN / 0). Recall is NaN where every step's output was computed by the method itself
    (`attend`: no token set to compare)."""

    recall: torch.Tensor  # [L, KVH] mean recall of the exact top-K
    mass: torch.Tensor  # [L, KVH] mean share of the exact group attention mass in the attended set
    rel_err: torch.Tensor  # [L, KVH] mean ||out - dense|| / ||dense|| over the head's query group
    touched: torch.Tensor  # [L, KVH] mean fraction of the visible KV attended
    layer_rel_err: torch.Tensor  # [L] mean over steps of the error over all heads of the layer
    custom: torch.Tensor  # [L] fraction of steps whose output the method computed itself
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
            "custom_output_fraction": float(self.custom[ls].mean()),
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
    session: MethodSession,
    params,
    ctx_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    trace: QueryTrace,
    *,
    recall_ratio: float = 0.05,
    k: int | None = None,
    steps: int | None = None,
    layers: list[int] | None = None,
) -> AttentionReport:
    """Replay `trace` through `session` step by step (every layer per step, in the decoder's order:
    select or attend, then append the step's key/value) and compare each layer's attention with exact
    attention, per KV head. The exact reference is the top-K by group attention mass (see
    indexer/topk.py), K = `k` or `recall_ratio` of the visible tokens."""
    from indexer.topk import group_attention_mass

    n_layers, kvh, g, t_all, d = trace.q.shape
    steps = t_all if steps is None else min(steps, t_all)
    layers = list(range(n_layers)) if layers is None else list(layers)
    scale = d ** -0.5
    f64 = dict(dtype=torch.float64)
    rec_sum, rec_n = torch.zeros(n_layers, kvh, **f64), torch.zeros(n_layers, kvh, **f64)
    mass_sum, err_sum = torch.zeros(n_layers, kvh, **f64), torch.zeros(n_layers, kvh, **f64)
    tch_sum = torch.zeros(n_layers, kvh, **f64)
    lerr_sum, custom_n = torch.zeros(n_layers, **f64), torch.zeros(n_layers, **f64)
    kk = 1
    for i in range(steps):
        p = trace.n_ctx + i
        q_pos = torch.tensor([p])
        for layer in layers:
            ctx_k, ctx_v = ctx_layer(layer)
            q = trace.q[layer, :, :, i:i + 1].to(ctx_k.dtype)  # [KVH, G, 1, D]
            loc_k, loc_v = trace.k[layer, :, :i + 1].to(ctx_k.dtype), trace.v[layer, :, :i + 1].to(ctx_k.dtype)
            kv = KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos)
            custom = session.attend(layer, q, kv)
            sel = session.select(layer, q, kv) if custom is None else None
            dense = dense_attention(q, ctx_k, ctx_v, loc_k, loc_v, scale)
            gm = group_attention_mass(q, kv)  # [KVH, 1, p + 1], sums to G per head
            kk = min(k, p + 1) if k is not None else exact_topk_k(recall_ratio, p + 1)
            exact = torch.topk(gm, kk, dim=-1).indices  # [KVH, 1, K]
            if custom is not None:
                out, frac = custom
                frac = frac.double().reshape(kvh, -1).mean(-1)
                custom_n[layer] += 1
            else:
                if sel is None:
                    idx = torch.arange(p + 1).expand(kvh, 1, p + 1)
                    out = dense
                else:
                    idx = merge_selection(sel, q_pos, params.sink, params.window)
                    out = sparse_attention(q, idx, ctx_k, ctx_v, loc_k, loc_v, scale)
                rec_sum[layer] += (exact[..., :, None] == idx[..., None, :]).any(-1).double().mean((-1, -2))  # [KVH]
                rec_n[layer] += 1
                covered = torch.gather(gm, -1, idx.clamp_min(0)).masked_fill(idx < 0, 0).sum(-1).double()  # [KVH, 1]
                mass_sum[layer] += (covered[:, 0] / g).clamp(max=1.0)
                frac = (idx >= 0).sum(-1).double()[:, 0] / (p + 1)
            diff = (out - dense).double()
            err_sum[layer] += diff.flatten(1).norm(dim=1) / dense.double().flatten(1).norm(dim=1).clamp_min(1e-12)
            lerr_sum[layer] += diff.norm() / dense.double().norm().clamp_min(1e-12)
            tch_sum[layer] += frac
            session.append(layer, trace.k[layer, :, i:i + 1].to(ctx_k.dtype), trace.v[layer, :, i:i + 1].to(ctx_k.dtype),
                           q_pos)
    nan = float("nan")
    recall = torch.where(rec_n > 0, rec_sum / rec_n.clamp_min(1), nan).float()
    mass = torch.where(rec_n > 0, mass_sum / rec_n.clamp_min(1), nan).float()
    return AttentionReport(recall=recall, mass=mass, rel_err=(err_sum / steps).float(), touched=(tch_sum / steps).float(),
                           layer_rel_err=(lerr_sum / steps).float(), custom=(custom_n / steps).float(), layers=layers,
                           k_last=kk)


@dataclass
class RecallReport:
    """Per-layer view of an `AttentionReport` (the layers replayed, in order)."""

    recall: torch.Tensor  # [L'] mean recall of the exact top-K per layer (NaN: every step custom)
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
    `ratio`, default 5%, of the visible tokens) by the attended set (selection ∪ sink ∪ window),
    fraction of KV touched, relative L2 error of the attention output."""
    n_ctx = cap.n_tokens - n_queries
    index = build_index(method, params, truncate_capture(cap, n_ctx), env)
    session = method.open(index, params, n_ctx, env)
    try:
        rep = attention_metrics(session, params, lambda layer: (cap.k[layer, :, :n_ctx], cap.v[layer, :, :n_ctx]),
                                QueryTrace.from_capture(cap, n_ctx), recall_ratio=ratio or 0.05, k=k, layers=layers)
    finally:
        session.close()
    ls = rep.layers
    return RecallReport(recall=nanmean(rep.recall[ls], dim=1), touched=rep.touched[ls].mean(1),
                        rel_err=rep.layer_rel_err[ls], k=rep.k_last, detail=rep)


@torch.inference_mode()
def teacher_forced_logits(lm, ctx: ContextKV, session, params, token_ids: list[int]) -> torch.Tensor:
    """Next-token logits [T, V] after each of `token_ids`, fed one at a time after the context."""
    from transformers import DynamicCache

    model = lm.model
    device = next(model.parameters()).device
    step = DecodeStep(lm.spec, ctx, session, params, model.dtype)
    cache = DynamicCache(config=model.config)
    out_logits = []
    for i, tok in enumerate(token_ids):
        step.q_pos = torch.tensor([ctx.n_tokens + i], device=device)
        out = model(
            input_ids=torch.tensor([[tok]], device=device), position_ids=step.q_pos[None],
            past_key_values=cache, use_cache=True, logits_to_keep=1, ctx_step=step,
        )
        out_logits.append(out.logits[0, -1].float().cpu())
    return torch.stack(out_logits)


def fidelity(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict:
    """Top-1 agreement and mean KL(ref || method) over positions."""
    logp_ref = torch.log_softmax(ref_logits.double(), -1)
    logp = torch.log_softmax(logits.double(), -1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    agree = (ref_logits.argmax(-1) == logits.argmax(-1)).double()
    return {"top1_agreement": float(agree.mean()), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "positions": len(kl)}
