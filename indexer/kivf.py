"""`kivf`: key-centric IVF, the classic ANN baseline for CTkvr (cluster the keys, probe clusters).

Build (prefill worker; `build_fields`: `n_clusters`, `kmeans_iters`, `seed`)
  * per layer and KV head, faiss k-means (L2, `faiss.Kmeans`, seeded with `seed` + layer·KVH +
    head) over the n post-RoPE keys -- the vectors q·k is taken with, so no de-RoPE.
    C = `n_clusters` or, when unset, 4·round(sqrt(n)) clamped to [16, 4096] and never more than n
    (the usual IVF rule C ~ 4..16·sqrt(n); 180 at 2K, 360 at 8K). More clusters recall more for the
    same number of scanned keys (captured 2K Q/K, 5% budget, scan 4: C = 45 -> 0.90, 90 -> 0.92,
    180 -> 0.94, 256 -> 0.95) while the probe costs C·G·D, so C stays a small fraction of n.
    `kmeans_iters` [10] Lloyd iterations (SAAP's setting). Below 64K keys faiss runs on one thread
    (set around the call, restored after): OpenMP start-up costs more than a few-ms k-means.
  * each key belongs to its nearest centroid (faiss's final assignment). Stored CSR-style:
    `centroids` [L, KVH, C, D] fp32, `order` [L, KVH, N] int32 = key ids sorted by cluster (stable,
    so ascending ids inside a cluster), `offsets` [L, KVH, C + 1] int32 = where each cluster's
    slice of `order` starts (empty clusters are allowed: equal consecutive offsets).

Decode (`select`, per layer and step; all KV heads and query tokens batched, no Python loops)
  1. probe: centroid scores pooled over the GQA group the way `indexer/topk.py` pools keys: sum
     over the group's heads of softmax(q·c / sqrt(D)) over the C centroids (per-head softmax, so a
     head with large logits does not drown the others). Measured on captured 2K Q/K (C = 45,
     5% / nprobe 8, 10% / nprobe 16): recall 0.866 / 0.920, vs 0.862 / 0.913 for the max over the
     group of raw q·c, 0.860 / 0.907 for the group-summed query and 0.862 / 0.916 for the max of
     the softmaxes. The `nprobe` best clusters per KV head and query token; when `nprobe` is unset,
     ceil(`scan` [4] x K x C / n) clusters, i.e. about `scan` x K keys scanned (CTkvr's default
     recall set is ~4 x K after deduplication, so the two are compared at a similar scan).
  2. candidates: every key of the probed clusters (the CSR slices are expanded into one padded
     [KVH, T, U] block with a searchsorted over the probed clusters' cumulative sizes), plus the
     request's own keys that fall in a probed cluster. Request keys are assigned to their nearest
     (L2) centroid in the session's private state, on `append` (or at `select` for keys not
     appended yet, i.e. this step's); the persisted arrays are never written.
  3. exact rerank over the candidates by group mass (sum over the group of softmax(q·k / sqrt(D))
     over the candidates, `indexer._select.candidate_mass`), top-K with K = `k` if set, else
     ceil(`ratio` [0.05] x visible tokens) (the `topk` convention), capped by the number of
     candidates. The decode frame adds sink + recent window. With nprobe = C every key is a
     candidate and the selection is the exact oracle's.

Cost per layer and step: C·G·D for the probe, (scanned keys + M')·G·D for the rerank.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from pydantic import Field

from indexer._select import RequestBuckets, candidate_mass, expand_clusters, nearest_centroid, top_positions
from indexer.base import MethodParams, MethodSession, PrefillCapture, SparseMethod, register


# Below this many keys one k-means is a few ms of work and OpenMP's thread start/spin costs more than it
# saves (measured 2K keys x 45 clusters, 10 iterations, 2 busy cores: 8 ms on 1 thread, 98 ms on 2).
_FAISS_SERIAL_BELOW = 1 << 16


class KIVFParams(MethodParams):
    n_clusters: int | None = Field(
        None, ge=1, le=65536, description="C: k-means clusters per layer and KV head; None = 4·round(sqrt(n)) in [16, 4096]"
    )
    kmeans_iters: int = Field(10, ge=1, le=200, description="k-means (Lloyd) iterations")
    seed: int = Field(1234, ge=0, le=2**31 - 1, description="k-means seed")
    nprobe: int | None = Field(
        None, ge=1, le=65536, description="clusters probed per step (C = exact top-K); None = enough for scan x K keys"
    )
    scan: float = Field(4.0, ge=1.0, le=1000.0, description="when nprobe is unset: keys scanned per selected key, on average")
    k: int | None = Field(None, ge=1, le=1 << 22, description="tokens selected per step; overrides ratio")
    ratio: float = Field(0.05, gt=0.0, le=1.0, description="fraction of visible tokens selected per step")

    build_fields = frozenset({"n_clusters", "kmeans_iters", "seed"})

    def n_clusters_for(self, n: int) -> int:
        c = self.n_clusters if self.n_clusters is not None else min(4096, max(16, 4 * round(math.sqrt(n))))
        return max(1, min(c, n))

    def budget(self, n_visible: int) -> int:
        k = self.k if self.k is not None else math.ceil(self.ratio * n_visible)
        return max(1, min(k, n_visible))

    def probes(self, budget: int, n: int, c: int) -> int:
        p = self.nprobe if self.nprobe is not None else math.ceil(self.scan * budget * c / max(n, 1))
        return max(1, min(p, c))


# ---------------------------------------------------------------------------------------------
# Build


def kmeans_ivf(keys: torch.Tensor, c: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [N, D] -> (centroids [C, D] fp32, order [N] int32, offsets [C + 1] int32)."""
    import faiss

    x = np.ascontiguousarray(keys.detach().float().cpu().numpy())
    n, d = x.shape
    # faiss warns below 39 points per centroid and subsamples above 256; neither changes the result's meaning
    km = faiss.Kmeans(d, c, niter=iters, seed=seed, verbose=False, min_points_per_centroid=1, max_points_per_centroid=1 << 30)
    threads = faiss.omp_get_max_threads()
    if n < _FAISS_SERIAL_BELOW:
        faiss.omp_set_num_threads(1)  # scoped: restored below
    try:
        km.train(x)
        _, assign = km.index.search(x, 1)
    finally:
        faiss.omp_set_num_threads(threads)
    assign = torch.from_numpy(assign[:, 0].astype(np.int64))
    order = torch.argsort(assign, stable=True)
    counts = torch.bincount(assign, minlength=c)
    offsets = torch.zeros(c + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return torch.from_numpy(km.centroids.copy()), order.to(torch.int32), offsets.to(torch.int32)


def probe_scores(q: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """q [KVH, G, T, D], cent [KVH, C, D] -> [KVH, T, C]: sum over the group of softmax(q·c / sqrt(D))."""
    s = torch.einsum("hgtd,hcd->hgtc", q.float(), cent) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1).sum(1)


# ---------------------------------------------------------------------------------------------
# Session


class _KIVFSession(MethodSession):
    def __init__(self, index, params: KIVFParams, n_ctx: int):
        if index is None:
            raise ValueError("kivf needs its built index (k-means IVF); build it at registration")
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self.buckets = RequestBuckets()  # the cluster of each request key (private)

    @property
    def local_assign(self) -> dict[int, torch.Tensor]:
        """layer -> [KVH, M] cluster of each request key so far."""
        return self.buckets.as_dict()

    def append(self, layer, k, v, positions):
        todo = self.buckets.appended(layer, k.shape[1])  # select bucketed this step's keys already
        if todo:
            cent = self.index.layer("centroids", layer).to(k.device)
            self.buckets.add(layer, todo.start, nearest_centroid(k[:, k.shape[1] - len(todo):], cent))

    def select(self, layer, q, kv):
        kvh, g, t, d = q.shape
        cent = self.index.layer("centroids", layer).to(q.device)  # [KVH, C, D] fp32, shared: read only
        order = self.index.layer("order", layer).to(q.device)  # [KVH, N] int32 (not widened: O(N) per step)
        offsets = self.index.layer("offsets", layer).to(q.device).long()  # [KVH, C + 1]
        c = cent.shape[1]

        # 1. probe: per-head softmax over the centroids, summed over the group
        k = self.params.budget(int(kv.q_pos.max()) + 1)
        score = probe_scores(q, cent)  # [KVH, T, C]
        probe = torch.topk(score, self.params.probes(k, order.shape[1], c), dim=-1).indices  # [KVH, T, P]

        # 2. candidates: keys of the probed clusters + request keys assigned to a probed cluster
        cand = expand_clusters(probe, order, offsets)  # [KVH, T, U]
        m = kv.n_local
        if m > 0:
            todo = self.buckets.todo(layer, m)
            if todo:  # this step's keys (append comes after select)
                self.buckets.add(layer, todo.start, nearest_centroid(kv.loc_k[:, todo.start:m], cent))
            assign = self.buckets.view(layer, m)  # [KVH, M]
            probed = torch.zeros(kvh, t, c, dtype=torch.bool, device=q.device).scatter_(-1, probe, True)
            hit = probed.gather(-1, assign[:, None, :].expand(kvh, t, m))  # [KVH, T, M]
            loc = torch.arange(kv.n_ctx, kv.n_ctx + m, device=q.device).expand(kvh, t, m)
            cand = torch.cat([cand, torch.where(hit, loc, -1)], dim=-1)

        # 3. exact rerank by group mass, top-K
        mass = candidate_mass(q, cand, kv)
        return top_positions(mass, cand, k)


@register
class KIVF(SparseMethod):
    name = "kivf"
    Params = KIVFParams
    has_index = True

    def validate_configuration(self, spec, params, env=None) -> list[str]:
        import importlib.util

        return [] if importlib.util.find_spec("faiss") else ["kivf builds with faiss k-means: pip install faiss-cpu"]

    def build(self, prefill: PrefillCapture, params: KIVFParams, env=None) -> dict[str, torch.Tensor]:
        k = prefill.k  # [L, KVH, N, D]
        n_layers, kvh, n, d = k.shape
        c = params.n_clusters_for(n)
        cent = torch.empty(n_layers, kvh, c, d, dtype=torch.float32)
        order = torch.empty(n_layers, kvh, n, dtype=torch.int32)
        offsets = torch.empty(n_layers, kvh, c + 1, dtype=torch.int32)
        for layer in range(n_layers):  # build time, not the hot path
            for h in range(kvh):
                cent[layer, h], order[layer, h], offsets[layer, h] = kmeans_ivf(
                    k[layer, h], c, params.kmeans_iters, params.seed + layer * kvh + h
                )
        return {"centroids": cent, "order": order, "offsets": offsets}

    def open(self, index, params, n_ctx, env=None):
        return _KIVFSession(index, params, n_ctx)
