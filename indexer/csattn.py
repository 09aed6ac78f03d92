"""`csattn` (CSAttention, papers/csattention.txt §3, App. C/D): query-centric subspace lookup tables.

The head dimension d is split into m uniform subspaces of ds = d/m dims; q·k = sum over subspaces
b of the partials q⁽ᵇ⁾·k⁽ᵇ⁾. Shapes: Ly layers, KVH kv heads, G query heads per kv head, m
subspaces, C centroids, Lk list length, N context tokens, M request-local tokens, T query tokens.

Build (prefill worker, once per context; `build` / `build_layer`, plain torch on the device the
capture lives on, every kv head and subspace batched, a Python loop over layers only):

1. Per kv head, the prefill queries of its whole GQA group (G·N of them, or a random sample of
   `train_queries` [32768] when there are more: our stand-in for the paper's mini-batch k-means)
   are cut into m sub-vectors and L2-normalised.
2. Cosine k-means per (kv head, subspace): k-means++ seeds (D² sampling, D² = 2 - 2cos, drawn from
   a sample of 16·C points), then `iterations` [10] Lloyd steps over all training points, C
   [`n_centroids`, 64] unit centroids. An empty cluster keeps its previous centroid. All random
   draws come from a CPU `torch.Generator(seed)`, so the same seed samples the same way on any
   device.
3. Every key is scored against every centroid of its subspace, s = c⁽ᵇ⁾·k⁽ᵇ⁾ (unit centroid, raw
   key: the key's magnitude stays in the score), in one batched matmul; the top Lk =
   ceil(alpha·N) [alpha 0.2] (or `list_len`) (key id, score) pairs per centroid are kept, sorted
   by score descending. Scores use the fp16-rounded centroids, as streaming updates do.

Persisted: `centroids` [Ly, KVH, m, C, ds] fp16, `idx` [Ly, KVH, m, C, Lk] int32, `score`
[Ly, KVH, m, C, Lk] fp16.

Decode (`select`, per layer and step, all heads batched, no host sync, CUDA-graph capturable):

1. GQA pooling [`pooling`="sum"]: per subspace, the group's normalised sub-queries are summed
   and the sum's direction picks one centroid for the whole group. "per_head": each query head
   picks its own (G·m lists; the partial scores of all of them are added).
2. Nearest centroid by cosine. Centroid backoff: where the best cosine is below `backoff` [0.7;
   on SmolLM2 (ds = 8) that is ~5% of searches] the top-`tau` [2] centroids are used; the lists of
   one subspace are then averaged with cosine weights (a plain sum double-counts keys found in
   both lists and measured worse).
3. Gather the lists and reduce by key: a key's score is the sum over gathered lists of
   w_b · (its partial score - the list's minimum); keys in no list are not candidates.
   Two choices the paper leaves open, each measured on SmolLM2 and each switchable back:
   * `subspace_weights` ["query_norm"]: w_b = |q⁽ᵇ⁾| (group mean), so the sum estimates q·k
     itself (the centroid stands for the query's direction only); "uniform" is the paper's w_b = 1.
   * `missing_score` ["list_min"]: a key absent from a list is credited that list's minimum
     (subtracting it from every entry is the same ranking); "zero" is the paper's implicit 0,
     which over-rewards keys that appear in many lists when lists are long.
   With the paper's scoring (uniform, zero) recall of the exact top-5% on SmolLM2 was 0.36 and
   teacher-forced top-1 agreement 0.42 (KL 2.2, close to sink+window only); with these defaults
   0.63 and 0.83 (KL 0.30). See benchmarks/RESULTS_csattn.md.
   The reduction is a scatter into a dense [KVH, T, N + M] buffer (untouched keys stay -inf).
4. Keys the decode frame attends anyway (the first `sink`, the last `window` [R = 32], anything
   after the query) are excluded, then top-K, K = ceil(rho·(N + M)) [rho 0.05] or a fixed `k`.
   The frame (decoder/attention.py::merge_selection) adds sink + window back: a query attends
   sink + window + K tokens, the same frame every method gets.
5. Schedules "keep ratio + search period": presets 0.05-step-1, 0.15-step-4, 0.20-step-8 set rho
   and `period` P; a one-token step reuses the layer's previous selection for P-1 steps (the
   moving window covers what was appended meanwhile); multi-token chunks always search.

Streaming update (`append`): each appended key is scored against every centroid of its kv head
and subspace. The request keeps these scores ([KVH, m, C, M] fp16) as its private state; the
persisted tables are never written and two sessions share nothing. A list's effective content is
top-Lk of (persisted list ∪ appended entries), which is exactly what sequential try-insert into the
fixed-capacity list produces (insert when larger than the minimum, evict the minimum; ties keep
the older entry): a copy-on-write overlay instead of a per-request copy of the tables (~10 GB for
an 8B model at 128K tokens; the overlay costs 8 KB per appended token and layer there). Since a
persisted list is sorted, only its last min(M, Lk) entries can be evicted, so a gathered list is
its head plus the best min(M, Lk) of (its tail ∪ the appended entries). `lists(layer)`
materialises a request's effective lists (sorted, bounded) for inspection.

Execution modes (`mode`): "auto" searches where the query lives; "gpu" (All-GPU) moves the tables
to the query's device (cached in the session, per layer); "offload" (CPU<->GPU) searches on the
CPU over host tables, and when the context K/V also stay on the host (ContextKV(device="cpu"))
while the model runs on a GPU, `attend` gathers only the selected K/V rows on the host (straight
into pinned buffers), ships them to the GPU with non_blocking copies and runs exact attention
there over the shipped rows + the request's own rows. Without a GPU every mode runs on the CPU.

Overlap (`overlap`, offload mode only; papers/csattention.txt §3.4: "GPU attention at step t
overlaps with CPU search and updates for step t+1"). Host work goes to the session's worker
threads (`ThreadPoolExecutor`s of one thread each; a layer's tasks always go to worker
layer % `host_workers`, so they run in order); the caller waits on futures only where it needs a
result. Device tensors reach the workers as pinned host copies made on a side stream, with an
event the worker waits on, so the caller never blocks on the GPU for them.
* "updates" (default in offload mode; exact): `append` queues the streaming update (scoring the
  new keys against every centroid into the request's overlay) instead of running it; a layer's
  next search, `lists`, first waits for that layer's queued tasks. Selections are identical to "off".
* "lookahead": one-step lookahead. A step's query for layer l is the newest query that exists
  while the GPU runs that step, so `append` (after the update) also queues the search for layer l
  of the next one-token step with this step's last query, at the next step's position (its
  allowed range and budget): the exact search the synchronous path would run there if given the
  previous query. The worker then gathers the frame's rows (merge_selection at the next position)
  into pinned buffers and copies them on a second side stream, recording an event; the next step
  makes its compute stream wait on that event and attends. The window (R = 32 newest tokens, on
  the GPU) covers what the stale selection cannot know. The question chunk (T > 1) and a step with
  no matching plan search synchronously. With a search period P only the step before a search
  step plans a search; the reuse steps in between still get their rows shipped ahead.
  Cost, measured on SmolLM2 (2K document, rho 5%): recall of the exact top-K 0.554 vs 0.629 with
  the current query, teacher-forced top-1 agreement 0.52 vs 0.83 (KL 1.64 vs 0.29), hence not the
  default. Likely cause: copy-like heads want the key after the one the previous token wanted
  (spending half the budget on the +1 neighbours of the stale selection gave top-1 0.67; not
  implemented). Speed (H200 + 16 host cores, 8 Llama-8B layers): "updates" is within run-to-run
  noise of "off"; "lookahead" with one worker is no faster than "off" (the plain-torch host
  search, 4-13 ms per layer, dwarfs the GPU work it could hide behind: a whole layer with full
  attention takes ~0.5 ms there); with
  `host_workers` 4-8 [4], which plan several layers at once, it is 1.5-2.6x faster than "off".
  Numbers: benchmarks/RESULTS_csattn.md.
Not done: fused kernels (this is plain torch: on an H100 and H200 it is slower than SDPA full
attention, and the offload path is host-bound; see the results file).
"""

from __future__ import annotations

import math
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from indexer.base import MethodParams, MethodSession, SparseMethod, register

SCHEDULES: dict[str, tuple[float, int]] = {  # name -> (keep ratio rho, search period P)
    "0.05-step-1": (0.05, 1),
    "0.15-step-4": (0.15, 4),
    "0.20-step-8": (0.20, 8),
}
SEED_SAMPLES_PER_CENTROID = 16  # k-means++ seeding sample: 16 * C points per (kv head, subspace)
_ENTRIES_PER_CHUNK = 1 << 24  # gathered list entries per select chunk (bounds memory for long T)


class CSAttnParams(MethodParams):
    # build (persisted; part of the index identity)
    m: int = Field(8, ge=1, le=256, description="subspaces; must divide head_dim")
    n_centroids: int = Field(64, ge=1, le=4096, description="query centroids per subspace (C)")
    alpha: float = Field(0.2, gt=0.0, le=1.0, description="list length Lk = ceil(alpha * N_prefill)")
    list_len: int | None = Field(None, ge=1, le=1 << 24, description="explicit list length; overrides alpha")
    min_list_len: int = Field(
        256, ge=1, le=1 << 24,
        description="floor of alpha * N: short contexts keep lists long enough to hold rare tokens (our addition)")
    iterations: int = Field(10, ge=0, le=100, description="Lloyd iterations of the cosine k-means")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="k-means++ / subsampling seed")
    train_queries: int = Field(32768, ge=1, le=1 << 24, description="queries per kv head used for k-means")
    # decode (per request)
    rho: float | None = Field(None, gt=0.0, le=1.0, description="keep ratio K = rho * visible; default 0.05")
    k: int | None = Field(None, ge=1, le=1 << 24, description="fixed number of selected tokens; overrides rho")
    period: int | None = Field(None, ge=1, le=64, description="search every P steps; default 1")
    schedule: Literal["0.05-step-1", "0.15-step-4", "0.20-step-8"] | None = Field(
        None, description="preset (rho, period); explicit rho / period win")
    tau: int = Field(2, ge=1, le=16, description="centroids per subspace when backing off")
    backoff: float | None = Field(0.7, ge=-1.0, le=1.0, description="back off when best cosine < this; None = never")
    pooling: Literal["sum", "per_head"] = Field(
        "sum", description="GQA: one centroid per subspace for the group ('sum') or per query head")
    subspace_weights: Literal["uniform", "query_norm"] = Field(
        "query_norm", description="w_b: 'uniform' (paper, w_b = 1) or the query's subspace norm")
    missing_score: Literal["zero", "list_min"] = Field(
        "list_min", description="score of a key absent from a gathered list: 'zero' (paper) or the list's minimum")
    mode: Literal["auto", "gpu", "offload"] = Field(
        "auto", description="where the search runs: with the query, All-GPU, or CPU<->GPU")
    overlap: Literal["off", "updates", "lookahead"] | None = Field(
        None, description="offload only: host work on background threads; 'updates' = streaming updates (exact), "
                          "'lookahead' = also the next step's search with this step's query (one step stale: "
                          "costs quality, see the results file); default 'updates' in offload mode, else 'off'")
    host_workers: int = Field(
        4, ge=1, le=16, description="lookahead: worker threads per session; layer l's tasks run on worker l % n")

    build_fields: ClassVar[frozenset[str]] = frozenset(
        {"m", "n_centroids", "alpha", "list_len", "min_list_len", "iterations", "seed", "train_queries"})

    @model_validator(mode="after")
    def _overlap_needs_offload(self):
        if self.overlap not in (None, "off") and self.mode != "offload":
            raise ValueError(f"overlap={self.overlap!r} needs mode='offload' (it overlaps the host search)")
        return self

    @property
    def overlap_level(self) -> str:
        if self.overlap is not None:
            return self.overlap
        return "updates" if self.mode == "offload" else "off"

    def list_size(self, n_prefill: int) -> int:
        # The paper's alpha = 0.2 is for 8K-128K prompts. At ~500 tokens it keeps ~110 keys per list,
        # all drawn towards the bulk of the text, and a needle is in none of them (measured: the
        # 560-token passkey is missed; alpha 0.5 finds it). The floor changes nothing from 1280 tokens up.
        lk = self.list_len if self.list_len is not None else max(math.ceil(self.alpha * n_prefill), self.min_list_len)
        return max(1, min(lk, n_prefill))

    @property
    def keep_ratio(self) -> float:
        if self.rho is not None:
            return self.rho
        return SCHEDULES[self.schedule][0] if self.schedule else 0.05

    @property
    def search_period(self) -> int:
        if self.period is not None:
            return self.period
        return SCHEDULES[self.schedule][1] if self.schedule else 1

    def budget(self, n_visible: int) -> int:
        k = self.k if self.k is not None else math.ceil(self.keep_ratio * n_visible)
        return max(1, min(k, n_visible))


# ---------------------------------------------------------------------------------------------
# Build


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def cosine_kmeans(x: torch.Tensor, c: int, iterations: int, gen: torch.Generator) -> torch.Tensor:
    """x: [B, n, ds] unit vectors -> [B, C, ds] unit centroids (k-means++ seeds, Lloyd steps)."""
    b, n_all, ds = x.shape
    dev = x.device
    rows = torch.arange(b, device=dev)
    cent = torch.empty(b, c, ds, device=dev, dtype=x.dtype)
    # seeds come from a sample of SEED_SAMPLES_PER_CENTROID * C points (C sequential passes over
    # all points would dominate the build); the Lloyd steps use every point
    pts = x
    if n_all > SEED_SAMPLES_PER_CENTROID * c:
        pts = x[:, torch.randperm(n_all, generator=gen)[: SEED_SAMPLES_PER_CENTROID * c].to(dev)]
    n = pts.shape[1]
    draws = torch.rand(b, c, generator=gen).to(dev)  # all seeding draws at once
    cent[:, 0] = pts[rows, (draws[:, 0] * n).long().clamp_max(n - 1)]
    # squared distance on the unit sphere: 2 - 2cos (clamped at 0), +1e-12 so that all-identical
    # points fall back to uniform sampling
    d2 = torch.baddbmm(torch.full((b, n, 1), 2 + 1e-12, device=dev), pts, cent[:, 0, :, None], alpha=-2).clamp_min_(0)
    for j in range(1, c):
        cum = d2.squeeze(-1).cumsum(-1)  # [B, n]
        pick = torch.searchsorted(cum, draws[:, j:j + 1] * cum[:, -1:]).clamp_max_(n - 1)[:, 0]
        cent[:, j] = pts[rows, pick]
        d2 = torch.minimum(d2, torch.baddbmm(d2, pts, cent[:, j, :, None], beta=0, alpha=-2).add_(2 + 1e-12))
    d2 = None
    for _ in range(iterations):
        assign = torch.bmm(x, cent.transpose(1, 2)).argmax(-1)  # [B, n]
        sums = torch.zeros_like(cent).scatter_add_(1, assign[..., None].expand(-1, -1, ds), x)
        norm = sums.norm(dim=-1, keepdim=True)
        cent = torch.where(norm > 1e-12, sums / norm.clamp_min(1e-12), cent)  # empty cluster: keep
    return cent


def build_layer(
    q: torch.Tensor,  # [H, N, D] post-RoPE prefill queries of one layer
    k: torch.Tensor,  # [KVH, N, D] post-RoPE keys
    params: CSAttnParams,
    gen: torch.Generator,  # CPU generator (device-independent sampling)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's tables: centroids [KVH, m, C, ds] fp16, idx/score [KVH, m, C, Lk] int32/fp16."""
    h, n, d = q.shape
    kvh = k.shape[0]
    g, m, c = h // kvh, params.m, params.n_centroids
    ds = d // m
    dev = q.device
    qg = q.reshape(kvh, g * n, d)  # head i*G + j belongs to kv head i
    if g * n > params.train_queries:
        sub = torch.randperm(g * n, generator=gen)[: params.train_queries].to(dev)
        qg = qg[:, sub]
    x = _unit(qg.float().reshape(kvh, -1, m, ds).permute(0, 2, 1, 3))  # [KVH, m, n', ds]
    cent = cosine_kmeans(x.reshape(kvh * m, -1, ds), c, params.iterations, gen)
    cent = cent.to(torch.float16).reshape(kvh, m, c, ds)
    ks = k.float().reshape(kvh, n, m, ds).permute(0, 2, 3, 1)  # [KVH, m, ds, N]
    scores = torch.matmul(cent.float(), ks)  # [KVH, m, C, N]
    top_s, top_i = scores.topk(params.list_size(n), dim=-1, sorted=True)
    return cent, top_i.to(torch.int32), top_s.to(torch.float16)


# ---------------------------------------------------------------------------------------------
# Search


def effective_lists(
    idx: torch.Tensor,  # [..., Lk] persisted list (sorted desc), int32/int64
    score: torch.Tensor,  # [..., Lk] float
    app_score: torch.Tensor | None,  # [..., M] appended keys' scores for the same centroids
    app_pos: torch.Tensor | None,  # [M] their positions
    sort: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """top-Lk of (persisted list ∪ appended entries) -> (idx int64, score, min score [..., 1]).

    Equals sequential try-insert of the appended keys into the fixed-capacity list (ties keep the
    older entry). Only the last r = min(M, Lk) persisted entries can be evicted, so only they are
    merged with the appended ones: the result is the first Lk - r persisted entries followed by
    the best r of (tail ∪ appended), each part sorted; `sort=False` (the search, which needs the
    set and its minimum only) skips the final merge of the two parts."""
    idx = idx.long()
    if app_score is None or app_score.shape[-1] == 0:
        return idx, score, score[..., -1:]
    lk, m_app = idx.shape[-1], app_score.shape[-1]
    r = min(m_app, lk)
    tail_s = torch.cat([score[..., lk - r:], app_score.to(score.dtype)], dim=-1)
    tail_i = torch.cat([idx[..., lk - r:], app_pos.expand(*app_score.shape)], dim=-1)
    tail_s, order = torch.sort(tail_s, dim=-1, descending=True, stable=True)  # persisted first on ties
    tail_s, tail_i = tail_s[..., :r], tail_i.gather(-1, order[..., :r])
    low = tail_s[..., -1:] if r == lk else torch.minimum(score[..., lk - r - 1:lk - r], tail_s[..., -1:])
    out_i = torch.cat([idx[..., : lk - r], tail_i], dim=-1)
    out_s = torch.cat([score[..., : lk - r], tail_s], dim=-1)
    if sort:
        out_s, order = torch.sort(out_s, dim=-1, descending=True, stable=True)
        out_i = out_i.gather(-1, order)
    return out_i, out_s, low


def search(
    cent: torch.Tensor,  # [KVH, m, C, ds] fp16 unit centroids
    idx: torch.Tensor,  # [KVH, m, C, Lk] int32
    score: torch.Tensor,  # [KVH, m, C, Lk] fp16
    q: torch.Tensor,  # [KVH, G, T, D] post-RoPE queries
    q_pos: torch.Tensor,  # [T] absolute positions of the queries
    n_visible: int,  # N + M: positions 0..n_visible-1 may be selected
    k: int,  # tokens to select per query
    params: CSAttnParams,
    app_score: torch.Tensor | None = None,  # [KVH, m, C, M_app] appended keys' scores
    app_pos: torch.Tensor | None = None,  # [M_app]
) -> torch.Tensor:  # [KVH, T, K] int64 positions, -1 = empty
    kvh, g, t, d = q.shape
    m, c = cent.shape[1], cent.shape[2]
    ds = d // m
    dev = cent.device
    q = q.to(dev)
    q_pos = q_pos.to(dev)
    qs = q.float().reshape(kvh, g, t, m, ds)
    qn = qs.norm(dim=-1, keepdim=True)  # [KVH, G, T, m, 1]
    qt = qs / qn.clamp_min(1e-12)
    if params.pooling == "sum":
        qt = _unit(qt.sum(1, keepdim=True))  # [KVH, 1, T, m, ds]: one centroid per subspace for the group
        qn = qn.mean(1, keepdim=True)
    tau = min(params.tau, c) if params.backoff is not None else 1
    cos = torch.einsum("hgtmd,hmcd->hgtmc", qt, cent.float())
    top_cos, cid = cos.topk(tau, dim=-1)  # [KVH, G', T, m, tau]
    use = torch.ones_like(top_cos, dtype=torch.bool)
    if tau > 1:
        use[..., 1:] = top_cos[..., :1] < params.backoff
    # a backed-off subspace averages its lists, weighted by cosine (one list: weight 1)
    lw = torch.where(use, top_cos.clamp_min(1e-6), 0.0)
    lw = lw / lw.sum(-1, keepdim=True)  # [KVH, G', T, m, tau]
    w = qn if params.subspace_weights == "query_norm" else torch.ones_like(qn)  # [KVH, G', T, m, 1]

    width = n_visible + 1  # last column collects unused (not backed-off) entries
    pos = torch.arange(n_visible, device=dev)
    allowed = (pos[None, :] >= params.sink) & (pos[None, :] <= q_pos[:, None] - params.window)  # [T, N+M]
    kk = min(k, n_visible)
    lk = idx.shape[-1]
    h_ar = torch.arange(kvh, device=dev).view(kvh, 1, 1, 1, 1)
    b_ar = torch.arange(m, device=dev).view(1, 1, 1, m, 1)
    gp = cid.shape[1]
    per_t = kvh * gp * m * tau * (lk + (0 if app_pos is None else app_pos.numel()))
    step = max(1, _ENTRIES_PER_CHUNK // max(per_t, 1))
    out = []
    for t0 in range(0, t, step):
        sl = slice(t0, min(t, t0 + step))
        ci = cid[:, :, sl]
        li, ls, low = effective_lists(
            idx[h_ar, b_ar, ci], score[h_ar, b_ar, ci].float(),
            None if app_score is None else app_score[h_ar, b_ar, ci], app_pos, sort=False)  # [KVH, G', t, m, tau, Lk]
        if params.missing_score == "list_min":  # a key absent from a list scores at most the list's minimum
            ls = ls - low
        ls = ls * (w[:, :, sl] * lw[:, :, sl])[..., None]
        li = torch.where(use[:, :, sl, :, :, None], li, n_visible)
        tc = ci.shape[2]
        li = li.permute(0, 2, 1, 3, 4, 5).reshape(kvh, tc, -1)
        ls = ls.permute(0, 2, 1, 3, 4, 5).reshape(kvh, tc, -1)
        acc = torch.full((kvh, tc, width), float("-inf"), device=dev)
        acc.scatter_reduce_(-1, li, ls, reduce="sum", include_self=False)  # reduce-by-key
        acc = acc[..., :n_visible].masked_fill(~allowed[sl], float("-inf"))
        val, sel = acc.topk(kk, dim=-1, sorted=False)
        out.append(torch.where(torch.isfinite(val), sel, -1))
    return torch.cat(out, dim=1)


# ---------------------------------------------------------------------------------------------
# Session


class _AppendLog:
    """A request's appended keys, scored against every centroid: positions [M], scores [KVH, m, C, M]."""

    def __init__(self, kvh: int, m: int, c: int, device):
        self.n = 0
        self.pos = torch.empty(0, dtype=torch.int64, device=device)
        self.score = torch.empty(kvh, m, c, 0, dtype=torch.float16, device=device)

    def add(self, pos: torch.Tensor, score: torch.Tensor) -> None:  # [T], [KVH, m, C, T]
        t = pos.numel()
        if self.n + t > self.pos.numel():  # amortised doubling
            cap = max(2 * self.pos.numel(), self.n + t, 16)
            new_pos = torch.empty(cap, dtype=torch.int64, device=self.pos.device)
            new_score = torch.empty(*self.score.shape[:3], cap, dtype=torch.float16, device=self.pos.device)
            new_pos[: self.n] = self.pos[: self.n]
            new_score[..., : self.n] = self.score[..., : self.n]
            self.pos, self.score = new_pos, new_score
        self.pos[self.n:self.n + t] = pos
        self.score[..., self.n:self.n + t] = score.to(torch.float16)
        self.n += t

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.score[..., : self.n], self.pos[: self.n]


# ---------------------------------------------------------------------------------------------
# CPU<->GPU (offload): ship the selected rows; plan the next step on a background thread


def rows_attention(
    q: torch.Tensor,  # [KVH, G, T, D]
    idx: torch.Tensor,  # [KVH, T, K'] rows of k/v, -1 = empty
    k: torch.Tensor,  # [KVH, R, D]
    v: torch.Tensor,
    scaling: float,
) -> torch.Tensor:  # [KVH, G, T, D]
    """Exact attention over the given rows of one compact K/V set: `decoder.attention.sparse_attention`
    without its host-side check for request-local rows (a device sync per layer, which would stop
    the host from running ahead of the GPU)."""
    heads = torch.arange(idx.shape[0], device=idx.device)[:, None, None]
    j = idx.clamp_min(0)
    k_sel, v_sel = k[heads, j], v[heads, j]  # [KVH, T, K', D]
    s = torch.einsum("hgtd,htkd->hgtk", q, k_sel) * scaling
    s = s.masked_fill(~(idx >= 0)[:, None], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.einsum("hgtk,htkd->hgtd", p, v_sel)


def ship_rows(
    sel: torch.Tensor,  # [KVH, T, K] host positions, -1 = empty
    q_pos: torch.Tensor,  # [T] host
    ctx_k: torch.Tensor,  # [KVH, N, D] host context K (contiguous)
    ctx_v: torch.Tensor,  # [KVH, N, D]
    sink: int,
    window: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU<->GPU: the rows one step attends, gathered on the host and copied to `device`.

    Returns k_rows, v_rows [KVH, T*K', D] and remap [KVH, T, K'] on `device` (slot of each frame
    position: compact row for a context position, T*K' + offset for a request-local one, -1 empty;
    the caller appends the request-local K/V to the rows) and frac [KVH, T] (host). The context rows
    are gathered straight into pinned buffers and copied with non_blocking on the caller's current
    stream: the caller records an event there (the pinned blocks are not reused before the copy)."""
    from decoder.attention import merge_selection

    idx = merge_selection(sel, q_pos, sink, window)  # [KVH, T, K']
    kvh, t, kp = idx.shape
    n, d = ctx_k.shape[1], ctx_k.shape[2]
    in_ctx = (idx >= 0) & (idx < n)
    flat = (torch.where(in_ctx, idx, 0) + n * torch.arange(kvh)[:, None, None]).reshape(-1)
    pin = device.type == "cuda"
    rows = []
    for src in (ctx_k, ctx_v):
        buf = torch.empty(kvh * t * kp, d, dtype=src.dtype, pin_memory=pin)
        torch.index_select(src.reshape(kvh * n, d), 0, flat, out=buf)
        rows.append(buf.view(kvh, t * kp, d).to(device, non_blocking=True))
    slot = torch.arange(t * kp).view(1, t, kp)
    remap = torch.where(in_ctx, slot, torch.where(idx >= n, idx - n + t * kp, -1))
    remap = (remap.pin_memory() if pin else remap).to(device, non_blocking=True)
    frac = (idx >= 0).sum(-1).double() / (q_pos[None, :].double() + 1)
    return rows[0], rows[1], remap, frac


def _host_q_pos(kv, t: int) -> torch.Tensor:
    """[T] query positions on the host without a device sync: KVView's convention is that the
    request's last T tokens are the queries, so they sit at N + M - T .. N + M - 1."""
    if kv.q_pos.device.type == "cpu":
        return kv.q_pos
    n_vis = kv.n_ctx + kv.n_local
    return torch.arange(n_vis - t, n_vis)


@dataclass
class _Ahead:
    """What a step leaves for the worker to plan the layer's next one-token step with."""

    q: torch.Tensor  # [KVH, G, 1, D] host copy of this step's last query
    ready: object  # torch.cuda.Event marking that the host copy landed, or None
    q_pos: torch.Tensor  # [1] the next step's query position
    n_visible: int  # the next step's N + M
    search: bool  # the next step searches (else it keeps `sel`: search period)
    sel: torch.Tensor  # this step's selection [KVH, T, K] (host)
    tables: tuple  # the layer's host tables (centroids, idx, score)
    ship: tuple | None  # (ctx_k, ctx_v, device, h2d stream): also ship the rows to the GPU


@dataclass
class _Plan:
    """A layer's selection for one step, made on the worker during the previous step."""

    n_visible: int  # the step it was made for (its query position is n_visible - 1)
    searched: bool
    sel: torch.Tensor  # [KVH, 1, K] host
    rows: tuple | None  # ship_rows' output on the GPU + the event that marks the copies done


def _intra_op_threads(n: int) -> None:
    torch.set_num_threads(n)
    torch.get_num_threads()  # fixes this thread's count now (it would otherwise be read on first use)


def _shutdown(pools: list[ThreadPoolExecutor], wait: bool) -> None:
    for pool in pools:
        pool.shutdown(wait=wait, cancel_futures=True)


class CSAttnSession(MethodSession):
    def __init__(self, index, params: CSAttnParams, n_ctx: int):
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self.overlap = params.overlap_level
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._log: dict[int, _AppendLog] = {}
        self._last: dict[int, list] = {}  # layer -> [selection, steps since search]
        self._on_q: dict[int, tuple] = {}  # layer -> (host selection, its copy on the query's device)
        # overlap (see the module docstring): worker threads (1; `host_workers` for lookahead),
        # started on first use; each layer's tasks run in order on one of them
        self._pools: list[ThreadPoolExecutor] = []
        self._finalizer = None
        self._queued: dict[int, Future] = {}  # layer -> the last task submitted for it
        self._next: dict[int, Future] = {}  # layer -> Future[_Plan] for its next step
        self._ahead: dict[int, _Ahead] = {}  # left by select/attend, submitted by append
        self._streams: dict[torch.device, tuple] = {}  # device -> (D2H stream, H2D stream)

    def _search_device(self, q_device: torch.device) -> torch.device:
        return torch.device("cpu") if self.params.mode == "offload" else q_device

    def tables(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The persisted (shared, read-only) tables of a layer on `device`, cached per session."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        got = self._tables.get(layer)
        if got is None or got[0].device != device:
            got = tuple(self.index.layer(name, layer).to(device) for name in ("centroids", "idx", "score"))
            self._tables[layer] = got
        return got

    def lists(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This request's effective lists (persisted ∪ its appended keys): idx int64, score float,
        [KVH, m, C, Lk], each sorted by score descending."""
        self._settle(layer)
        log = self._log.get(layer)
        dev = log.pos.device if log is not None else torch.device("cpu")
        _, idx, score = self.tables(layer, dev)
        app = log.view() if log is not None else (None, None)
        return effective_lists(idx, score.float(), *app)[:2]

    # -- background worker ----------------------------------------------------------------------

    def _submit(self, layer: int, fn, *args) -> Future:
        if not self._pools:
            self._start_workers()
        fut = self._pools[layer % len(self._pools)].submit(fn, *args)  # one layer, one worker: in order
        self._queued[layer] = fut
        return fut

    def _start_workers(self) -> None:
        # Intra-op threads are kept per OS thread (OpenMP). A worker that only scores appended keys
        # runs its ops on one thread (its own OpenMP team would compete with the caller's search);
        # lookahead workers, which search, split the caller's count. torch.set_num_threads also
        # sets the default that threads started later read: once the workers have set theirs, a
        # throwaway thread restores it, leaving the caller's own OpenMP/MKL settings untouched.
        n_caller = torch.get_num_threads()
        n = self.params.host_workers if self.overlap == "lookahead" else 1
        per = 1 if self.overlap == "updates" else max(1, n_caller // n)
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"csattn-host-{i}",
                                          initializer=_intra_op_threads, initargs=(per,))
                       for i in range(n)]
        for pool in self._pools:
            pool.submit(int).result()  # its initializer has run
        restore = threading.Thread(target=torch.set_num_threads, args=(n_caller,), name="csattn-threads")
        restore.start()
        restore.join()
        # a session dropped without close(): its threads exit once the session is collected
        self._finalizer = weakref.finalize(self, _shutdown, self._pools, False)

    def _settle(self, layer: int) -> None:
        """Wait for the layer's background tasks (its worker runs them in order: the last implies the rest)."""
        fut = self._queued.pop(layer, None)
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Stop the worker threads (queued tasks are cancelled, a running one finishes). Idempotent;
        a closed session that is used again starts new workers."""
        pools, self._pools = self._pools, []
        self._queued.clear()
        self._next.clear()
        self._ahead.clear()
        if pools:
            self._finalizer.detach()
            _shutdown(pools, True)

    def _copy_streams(self, device: torch.device) -> tuple:
        got = self._streams.get(device)
        if got is None:
            got = self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return got

    def _to_host(self, *xs: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """Host copies of device tensors without blocking the caller: pinned buffers filled on a
        side stream once the compute stream has produced them; returns (copies, event | None)."""
        if all(x.device.type == "cpu" for x in xs):
            return [x.clone() for x in xs], None
        dev = next(x.device for x in xs if x.device.type == "cuda")
        d2h = self._copy_streams(dev)[0]
        d2h.wait_stream(torch.cuda.current_stream(dev))
        out = []
        with torch.cuda.stream(d2h):
            for x in xs:
                h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                h.copy_(x, non_blocking=True)
                if x.device.type == "cuda":
                    x.record_stream(d2h)  # x's memory is not reused before the copy has run
                out.append(h)
            done = torch.cuda.Event()
            done.record(d2h)
        return out, done

    @staticmethod
    def _update(log: _AppendLog, cent: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, ready) -> None:
        """Streaming update: score the appended keys k [KVH, T, D] against every centroid."""
        if ready is not None:
            ready.synchronize()
        kvh, t, d = k.shape
        m = cent.shape[1]
        s = torch.einsum("hmcd,htmd->hmct", cent.float(), k.float().reshape(kvh, t, m, d // m))  # [KVH, m, C, T]
        log.add(pos, s)

    def _plan_ahead(self, layer: int, a: _Ahead) -> _Plan:
        """Worker: the layer's next step, planned with this step's query (and its rows shipped)."""
        if a.ready is not None:
            a.ready.synchronize()
        sel = a.sel
        if a.search:
            log = self._log.get(layer)
            app = log.view() if log is not None and log.n else (None, None)
            sel = search(*a.tables, a.q, a.q_pos, a.n_visible, self.params.budget(a.n_visible), self.params, *app)
        rows = None
        if a.ship is not None:
            ctx_k, ctx_v, dev, h2d = a.ship
            with torch.cuda.device(dev), torch.cuda.stream(h2d):
                rows = ship_rows(sel, a.q_pos, ctx_k, ctx_v, self.params.sink, self.params.window, dev)
                done = torch.cuda.Event()
                done.record(h2d)
            rows = (*rows, done)
        return _Plan(a.n_visible, a.search, sel, rows)

    # -- decode ---------------------------------------------------------------------------------

    def _plan(self, layer: int, q: torch.Tensor, kv, ship: tuple | None) -> tuple[torch.Tensor, _Plan | None]:
        """This step's selection (on the search device) and the _Plan it came from, if made ahead."""
        t = q.shape[2]
        n_vis = kv.n_ctx + kv.n_local
        period = self.params.search_period
        fut = self._next.pop(layer, None)
        plan = fut.result() if fut is not None else None
        last = self._last.get(layer)
        reuse = t == 1 and last is not None and last[0].shape[1] == 1 and last[1] + 1 < period
        if plan is not None and (t != 1 or plan.n_visible != n_vis or plan.searched == reuse):
            plan = None  # made for another step than this one
        if reuse:
            last[1] += 1
            sel = last[0]
        elif plan is not None:
            sel = plan.sel
            self._last[layer] = [sel, 0]
        else:  # search now, with this step's query
            self._settle(layer)
            dev = self._search_device(q.device)
            cent, idx, score = self.tables(layer, dev)
            log = self._log.get(layer)
            app = log.view() if log is not None and log.n else (None, None)
            q_pos = _host_q_pos(kv, t) if dev.type == "cpu" else kv.q_pos
            sel = search(cent, idx, score, q, q_pos, n_vis, self.params.budget(n_vis), self.params, *app)
            self._last[layer] = [sel, 0]
        if self.overlap == "lookahead":
            searches_next = not (sel.shape[1] == 1 and self._last[layer][1] + 1 < period)
            if searches_next or ship is not None:
                (q_last,), ready = self._to_host(q[:, :, -1:])
                q_next = _host_q_pos(kv, t)[-1:] + 1
                self._ahead[layer] = _Ahead(q_last, ready, q_next, n_vis + 1, searches_next, sel,
                                            self.tables(layer, "cpu"), ship)
        return sel, plan

    def select(self, layer, q, kv):
        sel, _ = self._plan(layer, q, kv, None)
        if sel.device == q.device:
            return sel
        got = self._on_q.get(layer)
        if got is None or got[0] is not sel:  # one copy per selection (kept over the search period)
            got = self._on_q[layer] = (sel, (sel.pin_memory() if q.device.type == "cuda" else sel).to(
                q.device, non_blocking=True))
        return got[1]

    def append(self, layer, k, v, positions):
        dev = self._search_device(k.device)
        cent = self.tables(layer, dev)[0]  # [KVH, m, C, ds]
        log = self._log.get(layer)
        if log is None:
            log = self._log[layer] = _AppendLog(k.shape[0], cent.shape[1], cent.shape[2], dev)
        if self.overlap == "off":
            self._update(log, cent, k.to(dev), positions.to(dev), None)
            return
        (k_host, pos_host), ready = self._to_host(k, positions)
        self._submit(layer, self._update, log, cent, k_host, pos_host, ready)
        ahead = self._ahead.pop(layer, None)
        if ahead is not None:  # after the update: the next step's search sees this step's keys
            self._next[layer] = self._submit(layer, self._plan_ahead, layer, ahead)

    def attend(self, layer, q, kv):
        """CPU<->GPU: context K/V on the host, queries on a GPU -> ship only the selected rows."""
        if self.params.mode != "offload" or q.device.type == "cpu" or kv.ctx_k.device.type != "cpu":
            return None
        dev = q.device if q.device.index is not None else torch.device("cuda", torch.cuda.current_device())
        h2d = self._copy_streams(dev)[1]
        t = q.shape[2]
        sel, plan = self._plan(layer, q, kv, (kv.ctx_k, kv.ctx_v, dev, h2d))
        if plan is not None and plan.rows is not None:  # shipped during the previous step
            k_rows, v_rows, remap, frac, done = plan.rows
            cur = torch.cuda.current_stream(dev)
            cur.wait_event(done)
            for x in (k_rows, v_rows, remap):
                x.record_stream(cur)  # made on the H2D stream, used (and freed) on this one
        else:
            k_rows, v_rows, remap, frac = ship_rows(sel, _host_q_pos(kv, t), kv.ctx_k, kv.ctx_v,
                                                    self.params.sink, self.params.window, dev)
        # compact context rows, then the request's own rows (remap points past the context rows)
        k_all = torch.cat([k_rows.to(q.dtype), kv.loc_k.to(q.dtype)], dim=1)
        v_all = torch.cat([v_rows.to(q.dtype), kv.loc_v.to(q.dtype)], dim=1)
        return rows_attention(q, remap, k_all, v_all, q.shape[-1] ** -0.5), frac


@register
class CSAttention(SparseMethod):
    name = "csattn"
    Params = CSAttnParams
    has_index = True

    def validate_configuration(self, spec, params: CSAttnParams, env=None) -> list[str]:
        reasons = []
        if spec.head_dim % params.m:
            reasons.append(f"m={params.m} subspaces do not divide head_dim {spec.head_dim}")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} kv heads")
        return reasons

    @torch.inference_mode()
    def build(self, prefill, params: CSAttnParams, env=None) -> dict[str, torch.Tensor]:
        reasons = self.validate_configuration(prefill.spec, params)
        if reasons:
            raise ValueError("; ".join(reasons))
        if prefill.q is None:
            raise ValueError("csattn needs the prefill queries (capture with keep_q=True)")
        gen = torch.Generator().manual_seed(params.seed)
        layers = [build_layer(prefill.q[i], prefill.k[i], params, gen) for i in range(prefill.q.shape[0])]
        return {name: torch.stack([lay[j] for lay in layers]) for j, name in enumerate(("centroids", "idx", "score"))}

    def host_resident(self, params: CSAttnParams) -> bool:
        return params.mode == "offload"  # CPU<->GPU: tables and context K/V stay in host memory

    def open(self, index, params, n_ctx, env=None):
        if index is None:
            raise ValueError("csattn needs its built index")
        return CSAttnSession(index, params, n_ctx)
