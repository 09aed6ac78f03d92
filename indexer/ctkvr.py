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

Decode (`select`, per layer and step; all KV heads and query tokens batched, no Python loops)
  1. recall: cosine of each query head to its centroid head, max over the group (paper Alg. 2
     lines 1-2) -> the C' = `probe` [4] best centroids per KV head and query token -> gather their
     lists -> deduplicated union (a scatter into a per-row table, no sort; `dedup_positions`).
  2. the request's own tokens (question + generated, positions n..n+M-1) are always candidates too:
     they are few, and nothing else could ever select one that has left the recent window.
  3. rerank: exact scores over the candidates, pooled over the group as in `indexer/topk.py` -- sum
     over the group's heads of softmax(q·k / sqrt(D)) taken over the candidate set. (The paper uses
     the max over the group; the sum is used here so that, when the candidates are every visible
     token, the selection is exactly the oracle's.) Top-ρ' -> positions [KVH, T, K'] (int64, -1 =
     empty slot); K' = min(budget, candidates). The budget is `k` if set, else ceil(`ratio` x
     visible tokens) if set, else 512 (the paper's ρ'); same precedence as `topk` (k over ratio).
     The decode frame adds sink + recent window.
  4. dynamic centroid update (paper §3.1.3): after the step, the last query of the step (unit-norm
     per head) and its rerank top-ρ (which may include request-local positions) are pushed into
     the session's qcIVF, evicting its oldest entry. The session's qcIVF is the persisted C
     entries followed by a private ring of capacity F = min(`fifo`, C) [64]: a push evicts the
     oldest persisted centroid until the ring is full, then the oldest pushed one, so the index
     always holds C entries (a strict FIFO when F = C; F bounds the per-request memory to
     F x KVH x (G·D·4 + ρ·8) bytes per layer). `fifo` = 0 turns the update off. The persisted
     arrays are only read (through `IndexReader`); evicted persisted entries are masked, never
     overwritten, so concurrent sessions on the same index never see each other's updates.

Cost per layer and step: C·G·D for the cosines, C'·ρ·log for the union, (C'·ρ + M)·G·D for the
rerank; independent of n except through C and ρ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from indexer._select import candidate_mass, dedup_positions, gather_rows, local_positions, top_positions
from indexer.base import MethodParams, MethodSession, PrefillCapture, SparseMethod, register

DEFAULT_BUDGET = 512  # ρ' of the paper
_SCORE_CHUNK = 1 << 24  # scores materialised at once by the build (64 MiB of fp32)


class CTkvrParams(MethodParams):
    n_centroids: int | None = Field(
        None, ge=1, le=65536, description="C: last prefill queries kept as centroids; None = min(2048, n // 16)"
    )
    list_size: int = Field(
        1280, ge=1, le=1 << 22, description="ρ: key ids kept per centroid and KV head (2.5 x the default budget); capped at n"
    )
    probe: int = Field(4, ge=1, le=65536, description="C': centroids whose lists are recalled per step")
    k: int | None = Field(None, ge=1, le=1 << 22, description="ρ': tokens selected per step after the rerank; overrides ratio")
    ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="fraction of visible tokens selected per step (when k is unset)"
    )
    fifo: int = Field(
        64, ge=0, le=65536, description="dynamic centroid update: pushed (query, list) entries kept per request; 0 = off"
    )

    build_fields = frozenset({"n_centroids", "list_size"})

    def n_centroids_for(self, n: int) -> int:
        c = self.n_centroids if self.n_centroids is not None else min(2048, n // 16)
        return max(1, min(c, n))

    def budget(self, n_visible: int) -> int:
        if self.k is not None:
            k = self.k
        elif self.ratio is not None:
            k = math.ceil(self.ratio * n_visible)
        else:
            k = DEFAULT_BUDGET
        return max(1, min(k, n_visible))


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
# Session


class _Fifo:
    """One layer's private qcIVF entries (dynamic centroid update): a ring of `cap` slots."""

    def __init__(self, kvh: int, g: int, d: int, rho: int, cap: int, dtype, device):
        self.cent = torch.zeros(kvh, cap, g, d, dtype=dtype, device=device)  # unit-norm queries
        self.lists = torch.full((kvh, cap, rho), -1, dtype=torch.int64, device=device)
        self.cap = cap
        self.pushes = 0

    @property
    def filled(self) -> int:
        return min(self.pushes, self.cap)

    def push(self, cent: torch.Tensor, lst: torch.Tensor) -> None:  # [KVH, G, D], [KVH, <= rho]
        slot = self.pushes % self.cap
        self.cent[:, slot] = cent
        self.lists[:, slot] = -1
        self.lists[:, slot, : lst.shape[-1]] = lst
        self.pushes += 1


class _CTkvrSession(MethodSession):
    def __init__(self, index, params: CTkvrParams, n_ctx: int):
        if index is None:
            raise ValueError("ctkvr needs its built index (qcIVF); build it at registration")
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self.fifo: dict[int, _Fifo] = {}

    def select(self, layer, q, kv):
        kvh, g, t, d = q.shape
        cent = self.index.layer("centroids", layer).to(q.device, q.dtype)  # [KVH, C, G, D], shared: read only
        lists = self.index.layer("lists", layer).to(q.device)  # [KVH, C, rho] int32, shared: read only
        c, rho = cent.shape[1], lists.shape[2]
        qn = F.normalize(q, dim=-1)

        # 1. recall: cosine per query head vs the same head of each centroid, max over the group
        cos = torch.einsum("hgtd,hcgd->htcg", qn, cent).amax(-1)  # [KVH, T, C]
        fifo = self.fifo.get(layer)
        if fifo is not None and fifo.filled:
            f = fifo.filled
            cos[..., :f] = float("-inf")  # the f oldest persisted centroids were evicted by pushes
            cos_f = torch.einsum("hgtd,hfgd->htfg", qn, fifo.cent[:, :f]).amax(-1)  # [KVH, T, f]
            cos = torch.cat([cos, cos_f], dim=-1)
        p = min(self.params.probe, c)
        top = torch.topk(cos, p, dim=-1).indices.reshape(kvh, t * p)  # [KVH, T*P] entry ids
        ids = gather_rows(lists, top.clamp(max=c - 1)).long()  # [KVH, T*P, rho]
        if fifo is not None and fifo.filled:
            from_fifo = (top >= c)[..., None]
            ids = torch.where(from_fifo, gather_rows(fifo.lists, (top - c).clamp(min=0)), ids)

        # 2. candidates: dedup union of the recalled lists + the request's own tokens
        cand = torch.cat([ids.view(kvh, t, p * rho), local_positions(kv, kvh, t)], dim=-1)
        cand = dedup_positions(cand, kv.n_ctx + kv.n_local)  # [KVH, T, U]

        # 3. rerank by exact group mass over the candidates; one sorted top-K serves both the
        #    selection (top-rho') and the update (top-rho)
        mass = candidate_mass(q, cand, kv)  # [KVH, T, U]
        k = self.params.budget(int(kv.q_pos.max()) + 1)
        ranked = top_positions(mass, cand, max(k, rho) if self.params.fifo > 0 else k)  # best first

        # 4. dynamic centroid update: the step's last query and its rerank top-rho
        if self.params.fifo > 0:
            if fifo is None:
                fifo = self.fifo[layer] = _Fifo(kvh, g, d, rho, min(self.params.fifo, c), q.dtype, q.device)
            fifo.push(qn[:, :, -1], ranked[:, -1, :rho])
        return ranked[..., :k]


@register
class CTkvr(SparseMethod):
    name = "ctkvr"
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

    def open(self, index, params, n_ctx, env=None):
        return _CTkvrSession(index, params, n_ctx)
