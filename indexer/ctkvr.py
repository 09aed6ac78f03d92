"""`ctkvr` (CTkvr, papers/ctkvr.txt §3): a query-centroid inverted file ("qcIVF") + exact rerank.

Idea (the paper's Obs. 1-2): after RoPE, queries close in position are similar and share most of
their top-K keys. So the last C prefill queries, each with its own precomputed top-ρ key list, are
a cheap index for the decode queries that follow the context.

Build (prefill worker, once per context; `build_fields`: `n_centroids`, `list_size`)
  * centroids = the last C prefill queries, C = `n_centroids` or min(2048, n // 16) (at least 1),
    capped at n. Stored per query head, unit-normalised (decode only needs their direction, for a
    cosine), in the capture's dtype: `centroids` [L, KVH, C, G, D], oldest first (position n - C at
    index 0; that order is the FIFO order of the dynamic update below).
  * lists: per centroid and query head, softmax(q·K / sqrt(D)) over **all** n keys; max over the
    GQA group (paper, Alg. 1 line 3); the top-ρ key ids per KV head, ρ = `list_size` [1280 =
    2.5 x the default budget ρ' = 512], capped at n. Stored as `lists` [L, KVH, C, ρ] int32, ids
    in descending score order.
  * Causality is ignored on purpose: a centroid at position p is scored against keys after p too.
    Decode queries see all n keys, and a list is "what a query like this one attends to", so it
    should rank every key a decode query can see (the paper does the same, Q^(c)·K over all K).
  * The work is chunked over centroids so one layer never materialises more than ~2^24 scores.

Decode: `plan` (per layer and step; all KV heads and query tokens batched, fixed shapes, no host
sync) selects context positions only -- the frame (sink, recent window, every request-local token)
is attended by the backend anyway (`indexer.base`):
  1. recall: cosine of each query head to its centroid head, max over the group (paper Alg. 2
     lines 1-2), over the C persisted entries and the F entries of the request's FIFO (below), with
     -inf for evicted / empty ones -> the C' = `probe` [4] best entries per KV head and query token
     -> gather their lists -> candidates = the deduplicated union [KVH, T, C'·ρ] (a scatter into a
     per-row table, no sort; `dedup_positions`), minus positions outside the selectable range
     (sink, window: `selection.selectable`).
  2. rerank: exact scores over the candidates, pooled over the group as in `indexer/topk.py` -- sum
     over the group's heads of softmax(q·k / sqrt(D)), each head's softmax taken over the
     candidates *and the frame's rows* (`selection.candidate_mass` with `frame_lse`: without the frame in the denominator
     a head that parks its mass on the sink would outweigh the others). (The paper uses the max
     over the group; the sum is used here so that, when the candidates are every selectable token,
     the plan is exactly the oracle's, `topk`.) Top-ρ' -> `Plan.positions` [KVH, T, K] int32,
     -1 = empty slot, K = min(ρ', C'·ρ). ρ' = `k` if set, else ceil(`ratio` x n_ctx) if set, else
     512 (the paper's ρ'); `indexer.base.budget`, sized from the context, never from the request's
     length.
  3. dynamic centroid update (paper §3.1.3), split the plan/update way: `plan` computes the push --
     the step's last query (unit-norm per head) and its rerank top-ρ (selectable context
     positions: the sink and the positions then inside the window are not in it) -- and keeps it
     as this layer's pending push; `update` commits it; a plan that is not followed by an update
     pushes nothing. The request's qcIVF is the
     persisted C entries followed by a private ring of capacity F = min(`fifo`, C) [64]: a push
     evicts the oldest persisted centroid until the ring is full, then the oldest pushed one, so
     the index always holds exactly C live entries (a strict FIFO when F = C; F bounds the
     per-request memory to F x KVH x (G·D·dtype + ρ·4) bytes per layer). `fifo` = 0 turns the
     update off. The ring is allocated once, at the layer's first plan, and only written in place;
     its fill state is one device counter (pushes so far), from which the "evicted persisted
     centroids" [C] and "filled slots" [F] masks and the write slot are derived on the device, so
     the cosines always run over C + F entries and a step is CUDA-graph capturable. The persisted
     arrays are only read: concurrent requests on one index never see each other's pushes.

Cost per layer and step: (C + F)·G·D for the cosines, C'·ρ for the union, (C'·ρ + sink + window +
request tokens)·G·D for the rerank; independent of n except through C and ρ (and the O(n) dedup
table, written, never initialised).

On a GPU the plan runs fused (`indexer/kernels/ivf.py`: probe, gather + dedup + rerank logits,
group mass + top-K, 3 launches instead of ~130 small kernels; `update` is one more launch). Asked
for its attention (`KVView.attend_scale`: one request alone in its step, one token), it returns it
as `Plan.attended` from a fourth launch that attends the plan as the select publishes it. This
torch code is the reference and the CPU path; the fused plan selects the same positions per row
(in candidate order rather than best first: no consumer depends on the order; ties and rounding:
the kernel module's docstring). `planner.fused`: None = fused for CUDA tensors (the default), True =
also on the CPU through Triton's interpreter (tests), False = always torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field

from indexer.base import Attended, BudgetParams, Plan, Planner, PrefillCapture, SparseMethod, register
from indexer.selection import (
    candidate_mass, dedup_positions, frame_logsumexp, gather_rows, selectable, top_positions,
)

DEFAULT_BUDGET = 512  # ρ' of the paper
_SCORE_CHUNK = 1 << 24  # scores materialised at once by the build (64 MiB of fp32)


class CTkvrParams(BudgetParams):
    n_centroids: int | None = Field(
        None, ge=1, le=65536, description="C: last prefill queries kept as centroids; None = min(2048, n // 16)"
    )
    list_size: int = Field(
        1280, ge=1, le=1 << 22, description="ρ: key ids kept per centroid and KV head (2.5 x the default budget); capped at n"
    )
    probe: int = Field(4, ge=1, le=65536, description="C': centroids whose lists are recalled per step")
    k: int | None = Field(None, ge=1, le=1 << 22, description="ρ': context tokens selected per step after the rerank; overrides ratio")
    ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="fraction of the context selected per step (when k is unset); None = 512 tokens"
    )
    fifo: int = Field(
        64, ge=0, le=65536, description="dynamic centroid update: pushed (query, list) entries kept per request; 0 = off"
    )

    build_fields = frozenset({"n_centroids", "list_size"})
    default_k = DEFAULT_BUDGET

    def n_centroids_for(self, n: int) -> int:
        c = self.n_centroids if self.n_centroids is not None else min(2048, n // 16)
        return max(1, min(c, n))


# ---------------------------------------------------------------------------------------------
# Build


def centroid_lists(qc: torch.Tensor, keys: torch.Tensor, rho: int) -> torch.Tensor:
    """qc [KVH, G, C, D] centroid queries, keys [KVH, N, D] -> [KVH, C, rho] int32 key ids, best first.

    Score of key j for centroid c = max over the group of softmax_j(qc·k_j / sqrt(D)) (no causal mask).
    """
    kvh, g, c, d = qc.shape
    n = keys.shape[1]
    scale = d ** -0.5
    step = max(1, _SCORE_CHUNK // max(1, kvh * g * n))
    out = torch.empty(kvh, c, rho, dtype=torch.int32, device=qc.device)
    for s in range(0, c, step):
        e = min(c, s + step)
        scores = torch.einsum("hgcd,hnd->hgcn", qc[:, :, s:e].float(), keys.float()) * scale
        mass = torch.softmax(scores, dim=-1).amax(dim=1)  # [KVH, c, N]
        out[:, s:e] = torch.topk(mass, rho, dim=-1, sorted=True).indices.to(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------
# Rerank (shared with indexer/kivf.py)


# ---------------------------------------------------------------------------------------------
# Planner


class _Fifo:
    """One layer's private qcIVF entries (the dynamic centroid update): a ring of `cap` slots,
    allocated once and then only written in place (a captured CUDA graph keeps reading the same
    storage). `pushes` [1] is the fill state, on the device: the first min(pushes, cap) slots hold
    an entry, the first min(pushes, cap) persisted centroids are evicted, the next write goes to
    slot pushes % cap."""

    def __init__(self, kvh: int, g: int, d: int, rho: int, c: int, cap: int, dtype, device):
        self.cent = torch.zeros(kvh, cap, g, d, dtype=dtype, device=device)  # unit-norm queries
        self.lists = torch.full((kvh, cap, rho), -1, dtype=torch.int32, device=device)  # context positions
        self.pushes = torch.zeros(1, dtype=torch.int64, device=device)
        self.share = torch.zeros(1, dtype=torch.float32, device=device)  # sum over committed pushes of the probe share
        self.cap = cap
        self._ar_c = torch.arange(c, device=device)
        self._ar_f = torch.arange(cap, device=device)

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(evicted [C], filled [F]) bool, derived from the device counter."""
        live = self.pushes.clamp(max=self.cap)
        return self._ar_c < live, self._ar_f < live

    def push(self, cent: torch.Tensor, lst: torch.Tensor) -> None:  # [KVH, G, D], [KVH, rho] int32
        slot = self.pushes % self.cap  # [1], on the device
        self.cent.index_copy_(1, slot, cent[:, None].to(self.cent.dtype))
        self.lists.index_copy_(1, slot, lst[:, None])
        self.pushes += 1


def _ivf():
    """The fused kernels (indexer/kernels/ivf.py), or None where Triton is missing."""
    try:
        from indexer.kernels import ivf
    except ImportError:
        return None
    return ivf


@dataclass
class _FusedPush:
    tensors: tuple  # (query [KVH, G, D], list [KVH, rho] int32, probed FIFO entries per row [KVH·T] int32)
    n_probed: int  # KVH·T·probe: the share's denominator


class _CTkvrPlanner(Planner):
    def __init__(self, index, params: CTkvrParams, ctx):
        if index is None:
            raise ValueError("ctkvr needs its built index (qcIVF); build it at registration")
        self.index = index
        self.params = params
        self.n_ctx = ctx.n_ctx
        self.k = params.budget(ctx.n_ctx)
        self.sink, self.window = params.frame(ctx.n_ctx)
        self.fifo: dict[int, _Fifo] = {}  # layer -> the request's pushed entries
        self._pending: dict[int, tuple | _FusedPush] = {}  # layer -> (query, list, share) or the fused plan's push
        self._steps: dict[int, int] = {}  # layer -> committed pushes (their probe shares add up in fifo.share)
        self.fused: bool | None = None  # None: fused kernels for CUDA tensors; True: also on CPU (interpreter)

    def _fused_ok(self, q, probe: int, entries: int) -> bool:
        if self.fused is False or (self.fused is None and not q.is_cuda):
            return False
        ivf = _ivf()
        return ivf is not None and not ivf.unsupported(q, ctkvr_probe=probe, entries=entries)

    def _layer_fifo(self, layer: int, kvh: int, g: int, d: int, rho: int, c: int, dtype, device) -> _Fifo:
        fifo = self.fifo.get(layer)
        if fifo is None:  # lazily, at the layer's first plan (empty: reading it changes nothing)
            fifo = self.fifo[layer] = _Fifo(kvh, g, d, rho, c, min(self.params.fifo, c), dtype, device)
        return fifo

    def plan(self, layer, q, kv):
        kvh, g, t, d = q.shape
        n = self.n_ctx
        cent = self.index.layer("centroids", layer)  # [KVH, C, G, D] unit-norm, shared: read only
        lists = self.index.layer("lists", layer)  # [KVH, C, rho] int32, shared: read only
        c, rho = cent.shape[1], lists.shape[2]
        if self._fused_ok(q, min(self.params.probe, c), c + (min(self.params.fifo, c) if self.params.fifo else 0)):
            return self._plan_fused(layer, q, kv, cent, lists)
        qn = F.normalize(q.float(), dim=-1).to(cent.dtype)  # [KVH, G, T, D]

        # 1. recall: cosine per query head vs the same head of each entry, max over the group, over
        #    the C persisted + F pushed entries (exactly C of them live); the P best entries' lists
        cos = torch.einsum("hgtd,hcgd->htcg", qn, cent).amax(-1).float()  # [KVH, T, C]
        fifo = None
        if self.params.fifo > 0:
            fifo = self._layer_fifo(layer, kvh, g, d, rho, c, cent.dtype, q.device)
            evicted, filled = fifo.masks()
            cos_f = torch.einsum("hgtd,hfgd->htfg", qn, fifo.cent).amax(-1).float()  # [KVH, T, F]
            neg = float("-inf")
            cos = torch.cat([cos.masked_fill(evicted, neg), cos_f.masked_fill(~filled, neg)], dim=-1)  # [KVH, T, C + F]
        p = min(self.params.probe, c)
        top = torch.topk(cos, p, dim=-1).indices.reshape(kvh, t * p)  # [KVH, T*P] entry ids in [0, C + F)
        ids = gather_rows(lists, top.clamp(max=c - 1))  # [KVH, T*P, rho]
        if fifo is not None:
            from_fifo = top >= c
            ids = torch.where(from_fifo[..., None], gather_rows(fifo.lists, (top - c).clamp(min=0)), ids)

        # 2. candidates: the deduplicated union of the recalled lists, selectable positions only
        cand = ids.view(kvh, t, p * rho).long()  # [KVH, T, U]
        cand = torch.where(selectable(cand, kv.q_pos, n, self.sink, self.window), cand, -1)
        cand = dedup_positions(cand, n)

        # 3. rerank by exact group mass over the candidates; one sorted top-K serves both the plan
        #    (top-rho') and the pending FIFO push (top-rho)
        frame_lse = frame_logsumexp(q, kv, self.sink, self.window)  # [KVH, G, T]
        mass = candidate_mass(q, cand, kv.ctx_k, cand >= 0, frame_lse)  # [KVH, T, U]
        ranked = top_positions(mass, cand, max(self.k, rho) if fifo is not None else self.k)  # best first, int32
        if fifo is not None:  # committed by update()
            share = from_fifo.float().mean()
            self._pending[layer] = (qn[:, :, -1], ranked[:, -1, :rho], share)
        return Plan(ranked[..., : min(self.k, ranked.shape[-1])].contiguous())

    def _plan_fused(self, layer, q, kv, cent, lists):
        """The same plan in 3 Triton launches (indexer/kernels/ivf.py); the pending push is the
        kernels' (query, list, probed-FIFO counts), committed by one more launch in update()."""
        kvh, g, t, d = q.shape
        fifo = None
        if self.params.fifo > 0:
            fifo = self._layer_fifo(layer, kvh, g, d, lists.shape[2], cent.shape[1], cent.dtype, q.device)
        pos, pending, out = _ivf().ctkvr_plan(q, kv, cent, lists, fifo, sink=self.sink, window=self.window,
                                              k=self.k, probe=self.params.probe, attend_scale=kv.attend_scale)
        if fifo is not None:
            self._pending[layer] = _FusedPush(pending, kvh * t * min(self.params.probe, cent.shape[1]))
        attended = None if out is None else Attended(q, self.sink, self.window, kv.attend_scale, out)
        return Plan(pos, attended=attended)

    def update(self, layer, k, v, positions):
        pending = self._pending.pop(layer, None)
        if pending is None:
            return
        fifo = self.fifo[layer]
        if isinstance(pending, _FusedPush):
            _ivf().fifo_push(fifo, pending.tensors, pending.n_probed)  # the push and the share, one launch
        else:
            query, lst, share = pending
            fifo.push(query, lst)
            fifo.share += share
        self._steps[layer] = self._steps.get(layer, 0) + 1

    def stats(self):
        if not self._steps:
            return {}
        layers = sorted(self._steps)
        shares = torch.cat([self.fifo[layer].share / self._steps[layer] for layer in layers]).cpu().tolist()
        return {"fifo_pushes": max(self._steps.values()), "fifo_probe_share": sum(shares) / len(shares)}

    def close(self):
        self._pending.clear()


@register
class CTkvr(SparseMethod):
    name = "ctkvr"
    plans_ahead = True  # KL to dense at 8K, default model: 0.006 true query k 512, 0.005 ahead k 768
    Params = CTkvrParams
    has_index = True

    def build(self, prefill: PrefillCapture, params: CTkvrParams, env=None) -> dict[str, torch.Tensor]:
        if prefill.q is None:
            raise ValueError("ctkvr builds from the prefill queries: capture them (prefill(keep_q=True))")
        q, k = prefill.q, prefill.k  # [L, H, N, D], [L, KVH, N, D]
        n_layers, h, n, d = q.shape
        kvh = k.shape[1]
        g = h // kvh
        c = params.n_centroids_for(n)
        rho = min(params.list_size, n)
        qc = q[:, :, n - c:].reshape(n_layers, kvh, g, c, d)  # q head i*G + j belongs to kv head i
        centroids = F.normalize(qc.float(), dim=-1).to(q.dtype).permute(0, 1, 3, 2, 4).contiguous()
        lists = torch.empty(n_layers, kvh, c, rho, dtype=torch.int32)
        for layer in range(n_layers):
            lists[layer] = centroid_lists(qc[layer], k[layer], rho).cpu()
        return {"centroids": centroids.cpu(), "lists": lists}

    def open(self, index, params, ctx):
        return _CTkvrPlanner(index, params, ctx)
