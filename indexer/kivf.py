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

Decode: `plan` (per layer and step; all KV heads and query tokens batched, fixed shapes, no host
sync) selects context positions only -- the frame (sink, recent window, every request-local token)
is attended by the backend anyway, so request keys are never assigned to clusters (`indexer.base`):
  1. probe: centroid scores pooled over the GQA group the way `indexer/topk.py` pools keys: sum
     over the group's heads of softmax(q·c / sqrt(D)) over the C centroids (per-head softmax, so a
     head with large logits does not drown the others). Measured on captured 2K Q/K (C = 45,
     5% / nprobe 8, 10% / nprobe 16): recall 0.866 / 0.920, vs 0.862 / 0.913 for the max over the
     group of raw q·c, 0.860 / 0.907 for the group-summed query and 0.862 / 0.916 for the max of
     the softmaxes. The `nprobe` best clusters per KV head and query token; when `nprobe` is unset,
     ceil(`scan` [4] x K x C / n) clusters, i.e. about `scan` x K keys scanned (CTkvr's default
     recall set is ~4 x K after deduplication, so the two are compared at a similar scan).
  2. candidates: every key of the probed clusters, expanded from the CSR slices into one padded
     [KVH, T, W] block (`selection.expand_clusters`). W is static: `selection.probe_width`, the sum of
     the nprobe largest clusters of the layer (max over heads), computed once per layer in `open`
     (the only host read of index data; never on the step path), so nothing is ever cut and the
     shape does not depend on which clusters a query probes. Positions the frame attends (sink,
     window) are masked out.
  3. exact rerank over the candidates by group mass (sum over the group of softmax(q·k / sqrt(D)),
     each head's softmax over the candidates and the frame's rows: `selection.candidate_mass` with
     `frame_lse`, as CTkvr), top-K -> `Plan.positions` [KVH, T, min(K, W)]
     int32 (-1 = empty slot); K = `k` if set, else ceil(`ratio` [0.05] x n_ctx)
     (`indexer.base.budget`: sized from the context, never from the request's length). With
     nprobe = C every selectable key is a candidate and the selection is the exact top-K of the
     same pooled score.

Cost per layer and step: C·G·D for the probe, (W + sink + window + request tokens)·G·D for the
rerank (W >= the keys actually probed: the padding is the price of a fixed shape; unbalanced
clusters widen it).

On a GPU the plan runs fused (`indexer/kernels/ivf.py`: probe logits, probe top-nprobe + CSR slices,
expansion + rerank logits, group mass + top-K: 4 launches); this torch code is the reference and the
CPU path. The fused plan selects the same positions per row (in candidate order rather than best
first; ties and rounding: the kernel module's docstring). `planner.fused`: None = fused for CUDA
tensors, True = also on the CPU through Triton's interpreter (tests), False = always torch.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from indexer.selection import candidate_mass, expand_clusters, frame_logsumexp, probe_width, selectable, top_positions
from indexer.base import BudgetParams, Plan, Planner, PrefillCapture, SparseMethod, register
from indexer.clustering import kmeans_with_assignment


class KIVFParams(BudgetParams):
    n_clusters: int | None = Field(
        None, ge=1, le=65536, description="C: k-means clusters per layer and KV head; None = 4·round(sqrt(n)) in [16, 4096]"
    )
    kmeans_iters: int = Field(10, ge=1, le=200, description="k-means (Lloyd) iterations")
    seed: int = Field(1234, ge=0, le=2**31 - 1, description="k-means seed")
    nprobe: int | None = Field(
        None, ge=1, le=65536, description="clusters probed per step (C = exact top-K); None = enough for scan x K keys"
    )
    scan: float = Field(4.0, ge=1.0, le=1000.0, description="when nprobe is unset: keys scanned per selected key, on average")
    k: int | None = Field(None, ge=1, le=1 << 22, description="context tokens selected per step; overrides ratio")
    ratio: float = Field(0.05, gt=0.0, le=1.0, description="fraction of the context selected per step")

    build_fields = frozenset({"n_clusters", "kmeans_iters", "seed"})

    def n_clusters_for(self, n: int) -> int:
        c = self.n_clusters if self.n_clusters is not None else min(4096, max(16, 4 * round(math.sqrt(n))))
        return max(1, min(c, n))

    def probes(self, budget: int, n: int, c: int) -> int:
        p = self.nprobe if self.nprobe is not None else math.ceil(self.scan * budget * c / max(n, 1))
        return max(1, min(p, c))


# ---------------------------------------------------------------------------------------------
# Build


def kmeans_ivf(keys: torch.Tensor, c: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [N, D] -> (centroids [C, D] fp32, order [N] int32, offsets [C + 1] int32), on the CPU."""
    cent, assign = kmeans_with_assignment(keys.detach().float().cpu(), c, iters, seed)
    order = torch.argsort(assign, stable=True)
    counts = torch.bincount(assign, minlength=c)
    offsets = torch.zeros(c + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return cent, order.to(torch.int32), offsets.to(torch.int32)


def probe_scores(q: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """q [KVH, G, T, D], cent [KVH, C, D] -> [KVH, T, C]: sum over the group of softmax(q·c / sqrt(D))."""
    s = torch.einsum("hgtd,hcd->hgtc", q.float(), cent) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1).sum(1)


# ---------------------------------------------------------------------------------------------
# Planner


class _KIVFPlanner(Planner):
    def __init__(self, index, params: KIVFParams, ctx):
        if index is None:
            raise ValueError("kivf needs its built index (k-means IVF); build it at registration")
        if ctx.spec is None:
            raise ValueError("kivf sizes its candidate blocks per layer at open: pass the model spec in DecodeContext")
        self.index = index
        self.n_ctx = ctx.n_ctx
        self.k = params.budget(ctx.n_ctx)
        self.sink, self.window = params.frame(ctx.n_ctx)
        c = index.layer("centroids", 0).shape[1]
        self.nprobe = params.probes(self.k, ctx.n_ctx, c)
        # static candidate width per layer: the nprobe largest clusters (host ints, read once here)
        self.width = [probe_width(index.layer("offsets", layer), self.nprobe) for layer in range(ctx.spec.num_layers)]
        self.fused: bool | None = None  # None: fused kernels for CUDA tensors; True: also on CPU (interpreter)

    def _fused_ok(self, q) -> bool:
        if self.fused is False or (self.fused is None and not q.is_cuda):
            return False
        try:
            from indexer.kernels import ivf
        except ImportError:  # no Triton: torch
            return False
        return not ivf.unsupported(q)

    def plan(self, layer, q, kv):
        cent = self.index.layer("centroids", layer)  # [KVH, C, D] fp32, shared: read only
        order = self.index.layer("order", layer)  # [KVH, N] int32
        offsets = self.index.layer("offsets", layer)  # [KVH, C + 1] int32
        if self._fused_ok(q):
            from indexer.kernels import ivf

            return Plan(ivf.kivf_plan(q, kv, cent, order, offsets, width=self.width[layer], sink=self.sink,
                                      window=self.window, k=self.k, nprobe=self.nprobe))

        # 1. probe: per-head softmax over the centroids, summed over the group
        probe = torch.topk(probe_scores(q, cent), self.nprobe, dim=-1).indices  # [KVH, T, P]

        # 2. candidates: keys of the probed clusters (distinct: each key sits in one cluster),
        #    a fixed-width block; positions the frame attends are dropped
        cand = expand_clusters(probe, order, offsets, self.width[layer])  # [KVH, T, W]
        ok = (cand >= 0) & selectable(cand, kv.q_pos, self.n_ctx, self.sink, self.window)

        # 3. exact rerank by group mass, top-K
        mass = candidate_mass(q, cand, kv.ctx_k, ok, frame_logsumexp(q, kv, self.sink, self.window))
        return Plan(top_positions(mass, cand, self.k))


@register
class KIVF(SparseMethod):
    name = "kivf"
    # not planned ahead by default: the fidelity holds (KL to dense at 8K, default model: 0.008 true
    # query 5%, 0.007 ahead 7.5%), but on the H200 at 128K its wider rerank costs 22% of the tokens/s
    # at B = 8 (257.9 -> 201.2) for 9% at B = 1 (11.33 -> 10.40 ms)
    plans_ahead = False
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

    def open(self, index, params, ctx):
        return _KIVFPlanner(index, params, ctx)
