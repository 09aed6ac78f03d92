"""Measuring an approximate method against exact attention, on real captured tensors.

Two levels, shared by tests, benchmarks and `ctxcache eval`:

* attention level (`selection_recall`): split a capture into a context (first N - n_q tokens,
  the index is built from it) and n_q decode queries; replay the queries one by one through a
  method session exactly as the decoder would (select, union with sink + window, append), and
  compare with the exact top-K by group attention mass: recall, fraction of KV touched, and the
  relative L2 error of the attention output vs dense attention.
* model level (`teacher_forced_logits` + `fidelity`): feed a continuation token by token through
  the decoder with a method and compare next-token distributions with `full`: top-1 agreement
  and KL(full || method).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder.attention import dense_attention, merge_selection, sparse_attention
from decoder.generate import ContextKV, DecodeStep
from indexer.base import IndexReader, KVView, PrefillCapture, SparseMethod


def truncate_capture(cap: PrefillCapture, n: int) -> PrefillCapture:
    return PrefillCapture(q=cap.q[:, :, :n], k=cap.k[:, :, :n], v=cap.v[:, :, :n], positions=cap.positions[:n], spec=cap.spec)


def build_index(method: SparseMethod, params, cap: PrefillCapture) -> IndexReader | None:
    """Build in memory what the prefill worker would persist; serve it per layer like the store."""
    if not method.has_index:
        return None
    arrays = method.build(cap, params)
    return IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))


@dataclass
class RecallReport:
    recall: torch.Tensor  # [L] mean recall of the exact top-K per layer
    touched: torch.Tensor  # [L] mean fraction of visible KV attended per layer
    rel_err: torch.Tensor  # [L] mean ||out - dense|| / ||dense|| per layer
    k: int

    def summary(self) -> dict:
        return {
            "recall": float(self.recall.mean()),
            "kv_touched": float(self.touched.mean()),
            "rel_l2_err": float(self.rel_err.mean()),
            "k": self.k,
            "recall_per_layer": [round(float(x), 4) for x in self.recall],
        }


@torch.inference_mode()
def selection_recall(
    method: SparseMethod,
    params,
    cap: PrefillCapture,
    *,
    n_queries: int = 16,
    k: int | None = None,
    ratio: float | None = None,
    layers: list[int] | None = None,
) -> RecallReport:
    """Recall of the exact top-K (group attention mass, see indexer/topk.py) by the method's
    final attended set (selection ∪ sink ∪ window), per layer, over the last `n_queries` tokens."""
    from indexer.topk import group_attention_mass

    spec = cap.spec
    n_total = cap.n_tokens
    n_ctx = n_total - n_queries
    ctx_cap = truncate_capture(cap, n_ctx)
    index = build_index(method, params, ctx_cap)
    session = method.open(index, params, n_ctx)
    layers = list(range(spec.num_layers)) if layers is None else layers
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    scale = d ** -0.5
    rec = torch.zeros(spec.num_layers)
    tch = torch.zeros(spec.num_layers)
    err = torch.zeros(spec.num_layers)
    kk = 0
    for layer in layers:
        ctx_k, ctx_v = cap.k[layer, :, :n_ctx], cap.v[layer, :, :n_ctx]
        for i in range(n_queries):
            p = n_ctx + i
            q = cap.q[layer, :, p:p + 1].reshape(kvh, g, 1, d)
            loc_k, loc_v = cap.k[layer, :, n_ctx:p + 1], cap.v[layer, :, n_ctx:p + 1]
            q_pos = torch.tensor([p])
            kv = KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos)
            custom = session.attend(layer, q, kv)
            sel = session.select(layer, q, kv) if custom is None else None
            dense = dense_attention(q, ctx_k, ctx_v, loc_k, loc_v, scale)
            kk = k if k is not None else max(1, int(round((ratio or 0.05) * (p + 1))))
            exact = torch.topk(group_attention_mass(q, kv), min(kk, p + 1), dim=-1).indices  # [KVH, 1, K]
            if custom is not None:
                # the method computed the output itself (no token set): recall 0, the output error counts
                out, frac = custom
                tch[layer] += frac.float().mean() / n_queries
                err[layer] += ((out - dense).norm() / dense.norm().clamp_min(1e-12)) / n_queries
                session.append(layer, cap.k[layer, :, p:p + 1], cap.v[layer, :, p:p + 1], q_pos)
                continue
            if sel is None:
                idx = torch.arange(p + 1).expand(kvh, 1, p + 1)
                out = dense
            else:
                idx = merge_selection(sel, q_pos, params.sink, params.window)
                out = sparse_attention(q, idx, ctx_k, ctx_v, loc_k, loc_v, scale)
            hit = (exact[..., :, None] == idx[..., None, :]).any(-1).float().mean()
            rec[layer] += hit / n_queries
            tch[layer] += (idx >= 0).sum(-1).float().mean() / (p + 1) / n_queries
            err[layer] += ((out - dense).norm() / dense.norm().clamp_min(1e-12)) / n_queries
            session.append(layer, cap.k[layer, :, p:p + 1], cap.v[layer, :, p:p + 1], q_pos)
    return RecallReport(recall=rec[layers], touched=tch[layers], rel_err=err[layers], k=kk)


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
