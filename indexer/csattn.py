"""`csattn` (CSAttention, papers/csattention.txt §3, App. C/D): query-centric subspace lookup tables.

The head dimension d is split into m uniform subspaces of ds = d/m dims; q·k = sum over subspaces
b of the partials q⁽ᵇ⁾·k⁽ᵇ⁾. Shapes: Ly layers, KVH kv heads, G query heads per kv head, m
subspaces, C centroids, Lk list length, N context tokens, T query tokens.

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
   by score descending. Scores use the fp16-rounded centroids.

Persisted: `centroids` [Ly, KVH, m, C, ds] fp16, `idx` [Ly, KVH, m, C, Lk] int32, `score`
[Ly, KVH, m, C, Lk] fp16. Read at decode through the `IndexReader`, already on the planning device.

Plan (`plan`, per layer and step, all heads batched, fixed shapes, no host sync; `search`):

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
   The reduction is a scatter into a dense [KVH, T, N + 1] buffer (untouched keys stay -inf; the
   spare column takes the entries of lists a subspace did not back off to).
4. Positions the plan may not select (the frame's sink and window, `selection.selectable_mask`) are
   masked, then top-K, K = `budget(N)`: ceil(rho·N) [rho 0.05] or a fixed `k`, from the context
   length alone, so plans are [KVH, T, K] int32 at every step (-1 where fewer keys scored).
   The backend attends the frame besides: the sink, the context part of the window and every
   request-local token.
5. Schedules "keep ratio + search period": presets 0.05-step-1, 0.15-step-4, 0.20-step-8 set rho
   and `period` P; a one-token step reuses the layer's previous plan for P-1 steps (host-side
   counters: whether to search never depends on a device value); multi-token chunks always search.
   `plan` only reads this state; `update` commits it (so a plan can be thrown away).

Two deliberate departures from the paper:
* No streaming update (paper §3.3 (5): try-insert each appended key into the Top-L lists). The
  decode frame (`indexer/base.py`) attends every request-local token exactly, so an appended key in
  a list cannot change what a query attends; it could only evict a context key from the list (and
  raise the list's minimum). Plans select context positions only, and `update` learns nothing from
  appended keys (it only advances the search period). The persisted tables are read-only and
  requests share nothing.
* No CPU<->GPU mode of its own (paper §3.4). Keeping the context K/V in host memory is the generic
  `offload` attention backend (`decoder/backends/offload.py`), for every method: the K/V stay in
  pinned DRAM, mapped into the GPU's address space, while the tables, the search and the
  attention stay on the GPU and read the chosen rows in place. The paper's one-step lookahead
  (search for step t+1 with step t's query while the GPU attends) is dropped: it cost quality
  (recall of the exact top-5% 0.554 vs 0.629, top-1 agreement 0.52 vs 0.83 on SmolLM2;
  RESULTS_csattn.md), and with the search on the GPU there is no host search to hide.
GPU: the search runs fused (`indexer/kernels/csattn.py`): one launch chooses the centroids and list
weights, one walks the chosen lists straight from the persisted `idx` / `score` tables (no gathered
copies) and adds each entry into an int64 fixed-point accumulator per (kv head, token) with integer
atomics (exact, so the scores do not depend on the order of the adds, unlike torch's CUDA
`scatter_reduce_`), one decodes it into the masked fp32 score buffer and zeroes it again, then the
fused radix select (`indexer/kernels/select.py`) takes the top-K: 7 launches, no gathered copy of
the lists (timings against the torch plan and dense SDPA: benchmarks/RESULTS.md, "Fused searches (issue 12) and the batched runner"). This torch code is the
reference and the CPU path; the fused search selects the same positions per row (as a set; scores
agree to ~1e-7 relative, ties and rounding: the kernel module's docstring). `planner.fused`: None =
fused for CUDA tensors (the default), True = also on CPU (Triton's interpreter, tests), False = torch.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import Field

from indexer.selection import selectable_mask
from indexer.base import BudgetParams, Plan, Planner, SparseMethod, register
from indexer.kernels.select import topk_positions

SCHEDULES: dict[str, tuple[float, int]] = {  # name -> (keep ratio rho, search period P)
    "0.05-step-1": (0.05, 1),
    "0.15-step-4": (0.15, 4),
    "0.20-step-8": (0.20, 8),
}
SEED_SAMPLES_PER_CENTROID = 16  # k-means++ seeding sample: 16 * C points per (kv head, subspace)
_ENTRIES_PER_CHUNK = 1 << 24  # gathered list entries per search chunk of query tokens (bounds memory for long T)
_SCORES_PER_CHUNK = 1 << 26  # dense score buffer entries per search chunk (256 MiB of fp32)


class CSAttnParams(BudgetParams):
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
    rho: float | None = Field(None, gt=0.0, le=1.0, description="keep ratio: K = rho * context tokens; default 0.05")
    k: int | None = Field(None, ge=1, le=1 << 24, description="fixed number of selected context tokens; overrides rho")
    period: int | None = Field(None, ge=1, le=64, description="search every P one-token steps; default 1")
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

    build_fields: ClassVar[frozenset[str]] = frozenset(
        {"m", "n_centroids", "alpha", "list_len", "min_list_len", "iterations", "seed", "train_queries"})

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

    ratio_field = "rho"
    budget_ratio = keep_ratio  # K = `k`, else ceil(keep_ratio · n_ctx) (`BudgetParams.budget`)

    @property
    def search_period(self) -> int:
        if self.period is not None:
            return self.period
        return SCHEDULES[self.schedule][1] if self.schedule else 1


# ---------------------------------------------------------------------------------------------
# Build


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def cosine_kmeans(x: torch.Tensor, c: int, iterations: int, gen: torch.Generator) -> torch.Tensor:
    """x: [B, n, ds] unit vectors -> [B, C, ds] unit centroids (k-means++ seeds, Lloyd steps).

    Not `indexer/clustering.py`'s k-means (faiss's) with normalised points: k-means++ seeds from a
    sample, B small problems in one batch, an empty cluster keeps its centroid, every draw from a
    torch generator (the same on any device); csattn's tables are built with this one only."""
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


def search(
    cent: torch.Tensor,  # [KVH, m, C, ds] fp16 unit centroids
    idx: torch.Tensor,  # [KVH, m, C, Lk] int32 context positions
    score: torch.Tensor,  # [KVH, m, C, Lk] fp16, each list sorted descending
    q: torch.Tensor,  # [KVH, G, T, D] post-RoPE queries, on the tables' device
    q_pos: torch.Tensor,  # [T] absolute positions of the queries (same device)
    n_ctx: int,
    k: int,  # plan width K (<= n_ctx)
    params: CSAttnParams,
    sink: int,
    window: int,
) -> torch.Tensor:  # [KVH, T, K] int32 context positions, -1 = empty
    """The lookup-table search: nearest centroid per subspace (with backoff), reduce-by-key of the
    gathered lists into a dense score buffer, mask what the plan may not select, top-K. Shapes
    depend on (q.shape, the tables, n_ctx, k) only; nothing is read back on the host."""
    kvh, g, t, d = q.shape
    m, c, lk = cent.shape[1], cent.shape[2], idx.shape[-1]
    ds = d // m
    dev = q.device
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
    wl = w * lw

    width = n_ctx + 1  # the last column collects the entries of unused (not backed-off) lists
    ok = selectable_mask(q_pos, n_ctx, sink, window)  # [T, N]
    h_ar = torch.arange(kvh, device=dev).view(kvh, 1, 1, 1, 1)
    b_ar = torch.arange(m, device=dev).view(1, 1, 1, m, 1)
    gp = cid.shape[1]
    step = max(1, min(_ENTRIES_PER_CHUNK // (kvh * gp * m * tau * lk), _SCORES_PER_CHUNK // (kvh * width)))
    out = []
    for t0 in range(0, t, step):  # host ints only: T is the query's shape
        sl = slice(t0, min(t, t0 + step))
        ci = cid[:, :, sl]
        li = idx[h_ar, b_ar, ci]  # [KVH, G', t', m, tau, Lk]
        ls = score[h_ar, b_ar, ci].float()
        if params.missing_score == "list_min":  # a key absent from a list scores at most the list's minimum
            ls = ls - ls[..., -1:]
        ls = ls * wl[:, :, sl, :, :, None]
        li = torch.where(use[:, :, sl, :, :, None], li.long(), n_ctx)
        tc = ci.shape[2]
        li = li.permute(0, 2, 1, 3, 4, 5).reshape(kvh, tc, -1)
        ls = ls.permute(0, 2, 1, 3, 4, 5).reshape(kvh, tc, -1)
        acc = torch.full((kvh, tc, width), float("-inf"), device=dev)
        acc.scatter_reduce_(-1, li, ls, reduce="sum", include_self=False)  # reduce-by-key
        acc = acc[..., :n_ctx].masked_fill(~ok[sl], float("-inf"))
        out.append(topk_positions(acc, k))  # -1 where fewer than k keys scored; fused kernel on CUDA
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


# ---------------------------------------------------------------------------------------------
# Planner


def _fused_search(q: torch.Tensor, cent: torch.Tensor):
    """The fused `search` (indexer/kernels/csattn.py) when it can run here, else None (no Triton,
    or the kernel module's `unsupported` gives reasons: then the torch path)."""
    try:
        from indexer.kernels import csattn as kernels
    except ImportError:
        return None
    return None if kernels.unsupported(q, cent) else kernels.search


class _CSAttnPlanner(Planner):
    """One request: the search over the shared, read-only tables, plus the search period's state
    (host-side: which plan a layer reuses, and for how many steps it has served)."""

    def __init__(self, index, params: CSAttnParams, n_ctx: int):
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self.k = params.budget(n_ctx)
        self.sink, self.window = params.frame(n_ctx)
        self.period = params.search_period
        self.graph_safe = self.period == 1  # a period > 1 reuses plans by a host-side count (base.Planner)
        self._last: dict[int, tuple[Plan, int]] = {}  # layer -> (its last one-token searched plan, steps served)
        self._made: dict[int, tuple[Plan, bool]] = {}  # layer -> (this step's plan, searched?), committed by update
        self._searches = 0
        self._reused = 0
        self.fused: bool | None = None  # None: fused kernels for CUDA tensors; True: also on CPU (interpreter)

    def plan(self, layer, q, kv):
        t = q.shape[2]
        last = self._last.get(layer)
        if t == 1 and last is not None and last[1] < self.period:
            self._made[layer] = (last[0], False)
            return last[0]
        cent, idx, score = (self.index.layer(name, layer) for name in ("centroids", "idx", "score"))
        fn = _fused_search(q, cent) if self.fused is not False and (self.fused or q.is_cuda) else None
        plan = Plan((fn or search)(cent, idx, score, q, kv.q_pos, self.n_ctx, self.k, self.params, self.sink,
                                   self.window))
        self._made[layer] = (plan, True)
        return plan

    def update(self, layer, k, v, positions):
        # Appended keys are not inserted into the lists: the frame attends them anyway (module docstring).
        made = self._made.pop(layer, None)
        if made is None:
            return
        plan, searched = made
        if not searched:
            self._last[layer] = (plan, self._last[layer][1] + 1)
            self._reused += 1
            return
        self._searches += 1
        if plan.positions.shape[1] == 1 and self.period > 1:
            self._last[layer] = (plan, 1)
        else:  # a chunk's plan is never reused; the next one-token step searches
            self._last.pop(layer, None)

    def stats(self):
        return {"searches": self._searches, "reused_plans": self._reused}


@register
class CSAttention(SparseMethod):
    name = "csattn"
    plans_ahead = True  # KL to dense at 8K, default model: 0.317 true query rho 5%, 0.240 ahead 7.5%
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

    def open(self, index, params, ctx):
        if index is None:
            raise ValueError("csattn needs its built index")
        return _CSAttnPlanner(index, params, ctx.n_ctx)
