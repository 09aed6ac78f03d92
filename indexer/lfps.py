"""`lfps`: Learn From the Past for Sparse indexing (papers/lfps.txt §4, App. B).

Long because the method is a reconstruction: the paper's equations were lost, so this docstring
records each RECONSTRUCTED or ADAPTED choice next to the code that makes it (the code itself is
under 500 lines); the pure table functions are public and tested one by one.

The paper's equations were lost in extraction; this is a reconstruction from its prose. Each choice
the prose leaves open is marked RECONSTRUCTED, with the reason; each change forced by the decode
frame or by fixed-shape planning is marked ADAPTED.

Score tables. Per KV head, a *vertical* table V[j] (importance of absolute position j) and a
*slash* table S[o] (importance of relative offset o = t - j), both exponentially decayed sums of
past attention weights.
  RECONSTRUCTED (GQA): the paper keeps tables "for each attention head" of a GQA model without
  saying how the group's query heads share a selection. Here a KV head's tables accumulate the mean
  of its query heads' weights (the selection is shared by the group anyway). On the captured 2K
  document, pooled tables at lam 0.1 hold 0.791 of the group's exact top-5% in 18.8% of positions;
  per-query-head tables unioned over the group hold 0.758 in 17.3% (lam 0.4) and 0.889 in 30.6%
  (lam 0.1): the same trade-off curve, at a third of the memory.

Prefill (`build`), per layer and KV head:
* tables from the last `init_steps` [64] prefill queries (the paper's "most recent steps", value
  lost): w_i = attention weights of query i (group mean), with the first `table_sink` [4]
  positions removed and the rest renormalised to 1 (the paper keeps sink tokens out of the tables:
  "to prevent bias"), then
      V[j] = c · sum_i gamma^(r-1-i) w_i[j],   S[o] = c · sum_i gamma^(r-1-i) w_i[p_i - o],
  with c = 0.5 / (1 - gamma^r).
  RECONSTRUCTED (normalisation): the decode update adds half the normalised weights (mass 0.5 per
  step) after decaying by gamma, so the tables' stationary sum is 0.5 / (1 - gamma) ("the sum of
  the scores equals" the accumulated weight sum, App. B.2); c makes the initial tables have exactly
  that sum, so prefill and decode scores are on one scale.
* mean key and mean value over the non-sink context (`mean_k`, `mean_v` [L, KVH, D]);
* per query head, the ratio of the variance of the last prefill query's logits to that query's
  squared norm, Var_j(q·k_j) / |q|^2 (`var_ratio` [L, H]), "a global prior reused during decoding".

Decode: the planner plans, a backend runs (`indexer.base`). The backend attends the frame: the
first n_sink = min(`sink`, N) context tokens, the context part of the recent `window` and every
request-local token (question + generated). `plan(layer, q, kv)` only reads the tables and returns
what else to attend; `update(layer, ...)` commits the table update the layer's last plan computed.
Per layer, KV head and query token t (batched over heads and tokens, fixed shapes, no host sync):
1. Head sparsity (per query head): sink mass A_s = sum over the sink tokens of exp(s_j) (exact),
   local mass A_l = sum over the last `local` [5] positions (exact; they are request-local rows
   or context rows depending on the position, gathered with a fixed shape), global mass from a
   log-normal model of the logits: s ~ N(mu, sigma^2) with mu = q·mean_k·scale and
   sigma^2 = var_ratio·|q|^2·scale^2, so A_g = (t + 1 - n_sink) · exp(mu + sigma^2 / 2).
   RECONSTRUCTED (Eq. 6): sparsity = A_s / (A_s + max(A_g, A_l)): "by dynamically comparing" the
   global estimate (better for flat heads) and the local mass (better for concentrated heads), the
   larger one stands for the non-sink mass. A head with sparsity > `bypass_threshold` [0.85] is
   highly sparse: the plan marks it in `Plan.bypass` [KVH, G, T] (it attends the frame only, not
   the plan's positions) and it takes no part in the group's ranking or the table update.
   RECONSTRUCTED (bypass output, "the sink value combined with the mean of the other values"): a
   bypassed head attends the frame plus one pseudo-token (mean_k, mean_v) standing for the n_rest
   context tokens outside the frame, with weight n_rest·exp(mu + sigma^2/2) (the same log-normal
   estimate): `Plan.rest_logit` = log(n_rest) + mu + sigma^2/2 for bypassed heads (-inf for the
   others), `Plan.rest_value` = mean_v [KVH, D]. The backend puts the pseudo-token into the softmax.
   ADAPTED (the frame): the exact part is the frame, so a request-local token outside the window is
   attended exactly and n_rest counts context tokens only. Before the frame existed the exact part
   was sink + window (request tokens included) and the pseudo-token also stood for request tokens
   older than the window; while a request has fewer than `window` tokens the two are the same.
2. Initial candidates: C0 = {j : V[j] > tau_V} ∪ {j : S[t - j] > tau_S}, j over the non-sink
   context positions.
   RECONSTRUCTED (Eq. 8): tau = mean + lam·(max - mean)·sqrt(3 / kurtosis), kurtosis the 4th
   standardised moment of the table over the non-sink context positions, 3 the kurtosis of a
   Gaussian. It has the three properties the prose states: larger lam -> higher threshold -> fewer
   candidates; higher kurtosis (sharper pattern) -> lower threshold -> larger budget; lam in
   [0.1, 0.4]. And tau >= mean, so every initial candidate survives step 3 at offset 0. Measured on
   the captured 2K document (one decode query, every 3rd layer, all KV heads): lam 0.1 / 0.2 / 0.3
   / 0.4 -> 18.8 / 14.5 / 11.6 / 9.7% of positions after expansion, holding 79 / 73 / 66 / 61% of
   the exact top-5% (the small model's attention is flatter than the paper's Llama-3.1-8B, where it
   reports 1.2-8%).
   ADAPTED: the statistics run over the context's non-sink positions (the window's context part
   included); request-local tokens are attended by the frame, never candidates, and have no
   vertical entry. Before, they counted too: the request's recent tokens, heavily attended, raised
   the tables' maximum and so the thresholds; without them the candidate set is somewhat larger
   and recall somewhat higher (benchmarks/RESULTS_psa_lfps.md).
3. Expansion: E = {j + d : j in C0, d in {-1, 0, +1, +2}, V[j + d] > mean(V) or
   S[t - j - d] > mean(S)}, restricted to the positions a plan may select (outside the sink and the
   window: the frame attends those anyway).
   ADAPTED (fixed width): E is a mask over the N context positions whose size depends on the data.
   Its `max_candidates`·N [0.3] members of largest table score V[j] + S[t - j] (both tables carry
   the same total mass, so the sum is the tables' prediction of j's weight) are kept, in one
   `topk`: the candidate block is [KVH, T, C] with C fixed by (params, N). On the 2K document E
   averages 14% of the context per (KV head, step), its 99th percentile is 30%, so 0.3 cuts ~1% of
   the rows and changes no measured number (benchmarks/RESULTS_psa_lfps.md). The price of the fixed
   width: the exact scoring costs C rows at every step whatever E's real size. At 128K and 0.3 that
   is 39322 key rows per KV head and step (30% of a full K read) plus a top-39322 over 131072 table
   scores; the paper's 1.2-2% candidates at 128K would fit a cap of ~0.05.
4. Exact q·k on the candidates, the sink, the window's context rows and the request-local rows;
   the group's score of a candidate is the sum over its non-bypassed heads of its softmax weight
   over all of these (as `topk`; every head when the whole group is bypassed). The top-K
   candidates, K = `budget(N)` (ratio [5%] of the context, or `k`), are the plan's positions
   [KVH, T, K] int32 (-1 where fewer candidates exist).
5. Table update with the attention of that plan (frame + top-K): per head, the weights with the
   sink removed and renormalised, averaged over the group's non-bypassed heads, halved:
   V <- gamma·V + w/2 at the positions, S <- gamma·S + w/2 at the offsets t - j. A KV head whose
   whole group is bypassed is neither decayed nor updated (the paper: highly sparse heads "skip
   steps 2) 3) and 4)"). plan() computes the update, update() applies it (tokens of a multi-token
   step in order, decay gamma per token).
   ADAPTED: only context positions are written. The weights are normalised over everything the
   step attended (request-local tokens included, as before the frame), but a request-local
   token's vertical entry would never be read (it is never a candidate) and its slash offset
   o <= (tokens the request has) is smaller than the offset of any context position at any later
   step, so it would never be read either.

The question (a step of T > 1 tokens). ADAPTED: in the paper the prompt, question included, is
prefilled with full attention and the tables come from its last steps, i.e. from the question. Here
the context is prefilled once without any question, so with `dense_prompt` [on] a multi-token step
is treated as the end of the prefill: the plan is dense (`Plan.dense()`) and update() writes each
token's exact weights (over every visible token, sink removed, renormalised, group mean, halved)
into the tables in order. Measured on the passkey document (560 tokens, 5 keys): without it LFPS
answered 0/5 (the tables only know the noise at the end of the context, and a position that is
never a candidate is never attended, so it never enters the tables); with it 5/5 (2/5 while the
tables' statistics still counted the request's tokens; full attention 4/5, exact top-5% 5/5; see
benchmarks/RESULTS_psa_lfps.md). With `dense_prompt` off, the T tokens are planned from the same
tables and their T updates are applied in order.

State isolation: the persisted tables are shared (IndexReader, tiers) and never written. A planner
copies a layer's tables at its first plan into private buffers of fixed capacity: vertical over the
N context positions, slash over offsets up to N + `ctx.max_local` (the farthest offset a request
token can have), KVH·(2N + max_local)·4 bytes per layer. Offsets past the capacity (a request
longer than max_local) are neither read nor written.

Offload mode: the planner runs where the context lives (host memory) while the request-local rows
stay on the GPU; the few local rows it needs (the local-mass probe, the softmax denominators) are
gathered on their device and moved to the query's.

On a GPU the one-token search and its update run fused (`indexer/kernels/lfps.py`): the table
moments, thresholds, expansion and capped-candidate scores in two launches over the tables (the
frame's exact logits and the bypass estimate ride in the second), the fused radix select
(`indexer/kernels/select.py`) for the C candidates and again for the K plan positions, the
candidates' exact logits for the whole GQA group (straight from the candidate list, each key row
read once, on tensor cores for bf16 keys with the query split into three bf16 pieces: as accurate as
fp32; the same launch flags them and sums their softmax states), the group mass in one more, the
chosen rows' softmax state in two, and update() as a decay launch plus one scatter launch per token:
16 launches at T = 1 instead of a dozen passes over [KVH, T, N] tensors, two torch.topk and a C-row
gather. This torch code is the reference and the CPU path (and the question step's `_prompt_search`
stays torch); the fused search gives the same candidate sets and plan rows (as sets: the kernels
list positions in another order), the same bypass decisions, and tables equal up to rounding (table
moments in float64 there, so a value within ~1e-7 of a threshold may change sides; the kernel
module's docstring).
`planner.fused`: None = fused for CUDA tensors (the default), True = also on the CPU through
Triton's interpreter (tests), False = always torch; `CTXCACHE_FUSED_LFPS=0` keeps every planner on
torch. Timings against the torch plan and dense SDPA: benchmarks/RESULTS.md, "Fused searches (issue 12) and the batched runner".

Reporting: `stats()` gives the candidate fraction (exact q·k per visible token: candidates + the
frame; a fully bypassed KV head counts the frame only), the bypassed fraction of query heads, the
fraction of (KV head, token) rows whose expanded set was cut by `max_candidates`, per layer too,
and the number of dense question steps. Accumulated on the device, read back in `stats()` only.
`search(layer, q, kv)` is plan() without its bookkeeping: the plan, the pending update, the
candidates and the sparsity estimates (tests and benchmarks inspect them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field

from indexer.selection import gather_context, gather_rows
from indexer.base import BudgetParams, Plan, Planner, SparseMethod, frame_bounds, register

OFFSETS = (-1, 0, 1, 2)
NEG_INF = float("-inf")


class LFPSParams(BudgetParams):
    init_steps: int = Field(64, ge=1, le=1 << 16, description="last prefill queries that initialise the tables (build)")
    table_sink: int = Field(4, ge=0, le=4096, description="first positions kept out of the tables and means (build)")
    gamma: float = Field(0.95, gt=0.0, lt=1.0, description="decay of the score tables (build and decode)")
    lam: float = Field(0.2, ge=0.1, le=0.4, description="candidate threshold hyper-parameter (paper: 0.1-0.4)")
    ratio: float = Field(0.05, gt=0.0, le=1.0, description="top-K budget as a fraction of the context")
    k: int | None = Field(None, ge=1, le=1 << 22, description="top-K budget in tokens; overrides ratio")
    max_candidates: float = Field(
        0.3, gt=0.0, le=1.0,
        description="most candidates scored exactly per step, as a fraction of the context (a fixed width; "
                    "a larger expanded set keeps its members of largest table score). At least the top-K budget",
    )
    bypass: bool = Field(True, description="skip the search for highly sparse heads (sink + mean output)")
    bypass_threshold: float = Field(0.85, gt=0.0, le=1.0, description="sparsity above which a head is bypassed")
    local: int = Field(5, ge=1, le=4096, description="recent positions in the local mass of the sparsity estimate")
    dense_prompt: bool = Field(
        True, description="a step of several tokens (the question) attends densely and feeds the tables"
    )

    build_fields = frozenset({"init_steps", "table_sink", "gamma"})

    def candidate_width(self, n_ctx: int) -> int:
        """C: candidate slots per (KV head, token), at least K, at most N."""
        return max(self.budget(n_ctx), min(n_ctx, math.ceil(self.max_candidates * n_ctx)))


# ---------------------------------------------------------------------------------------------
# Build


def init_tables(q: torch.Tensor, k: torch.Tensor, steps: int, gamma: float, table_sink: int):
    """One layer, one KV head. q [G, N, D], k [N, D] -> vertical [N], slash [N] (offsets 0..N-1)."""
    g, n, d = q.shape
    r = min(steps, n)
    dev = k.device
    p = torch.arange(n - r, n, device=dev)  # positions of the queries used
    s = torch.einsum("grd,nd->grn", q[:, n - r:].float(), k.float()) * d ** -0.5
    s = s.masked_fill(torch.arange(n, device=dev)[None, None, :] > p[None, :, None], float("-inf"))
    w = torch.softmax(s, dim=-1).mean(0)  # [r, N] group mean
    w[:, :table_sink] = 0
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    coef = 0.5 * gamma ** torch.arange(r - 1, -1, -1, dtype=torch.float64, device=dev) / (1 - gamma ** r)  # [r]
    wc = w * coef.float()[:, None]
    vertical = wc.sum(0)
    off = p[:, None] - torch.arange(n, device=dev)[None, :]  # [r, N]
    ok = off >= 0
    slash = torch.zeros(n + 1, device=dev).index_add_(0, torch.where(ok, off, n).reshape(-1), wc.reshape(-1))[:n]
    return vertical, slash


# ---------------------------------------------------------------------------------------------
# Decode pieces (pure functions, tested on hand-made tables)


def _masked_moments(x: torch.Tensor, valid: torch.Tensor):
    """Mean, max, kurtosis and variance of x over `valid` along the last dim."""
    cnt = valid.sum(-1).clamp(min=1).to(x.dtype)
    mean = (x * valid).sum(-1) / cnt
    c = torch.where(valid, x - mean[..., None], torch.zeros_like(x))
    c2 = c * c
    var = c2.sum(-1) / cnt
    m4 = (c2 * c2).sum(-1) / cnt
    kurt = m4 / (var * var).clamp_min(1e-300 if x.dtype == torch.float64 else 1e-30)
    xmax = x.masked_fill(~valid, float("-inf")).amax(-1)
    return mean, xmax, kurt, var


def kurtosis_threshold(x: torch.Tensor, valid: torch.Tensor, lam: float):
    """tau = mean + lam·(max - mean)·sqrt(3 / kurtosis) over `valid`; +inf for a constant table.
    Returns (tau, mean)."""
    mean, xmax, kurt, var = _masked_moments(x, valid)
    tau = mean + lam * (xmax - mean) * torch.sqrt(3.0 / kurt.clamp_min(1e-30))
    return torch.where(var > 0, tau, torch.full_like(tau, float("inf"))), mean


def initial_candidates(vert: torch.Tensor, slash_at: torch.Tensor, valid: torch.Tensor, lam: float):
    """vert, slash_at [..., P] (slash_at[j] = S[t - j]), valid [..., P] -> (C0, keep) bool [..., P].
    keep: positions whose vertical or slash score is above its mean (the expansion's filter)."""
    tau_v, mean_v = kurtosis_threshold(vert, valid, lam)
    tau_s, mean_s = kurtosis_threshold(slash_at, valid, lam)
    c0 = valid & ((vert > tau_v[..., None]) | (slash_at > tau_s[..., None]))
    keep = valid & ((vert > mean_v[..., None]) | (slash_at > mean_s[..., None]))
    return c0, keep


def expand_candidates(c0: torch.Tensor, keep: torch.Tensor, offsets=OFFSETS) -> torch.Tensor:
    """{j + d : j in c0, d in offsets} ∩ keep, as masks over positions (last dim)."""
    out = torch.zeros_like(c0)
    for dlt in offsets:
        if dlt > 0:
            out |= F.pad(c0[..., :-dlt], (dlt, 0))
        elif dlt < 0:
            out |= F.pad(c0[..., -dlt:], (0, -dlt))
        else:
            out |= c0
    return out & keep


def cap_candidates(mask: torch.Tensor, score: torch.Tensor, width: int) -> torch.Tensor:
    """mask [..., N] bool, score [..., N] -> [..., width] positions of the `width` members of largest
    score (all of them when there are fewer), -1 for empty slots; any order. Fixed shape."""
    val, idx = torch.topk(score.masked_fill(~mask, NEG_INF), min(width, mask.shape[-1]), dim=-1, sorted=False)
    return torch.where(val > NEG_INF, idx, -1)


def local_rows(kv, pos: torch.Tensor, device) -> torch.Tensor:
    """pos [T, P] absolute positions (any valid or not: clamped) -> key rows [KVH, T, P, D] on `device`:
    context rows below N, request-local rows from N on, chosen per position with `torch.where` (a fixed
    shape; invalid positions get an arbitrary row). The request-local rows are gathered on their own
    device (the GPU in offload mode, where the planner runs on the host) and only those rows move."""
    n, m = kv.n_ctx, kv.loc_k.shape[1]
    kvh = kv.ctx_k.shape[0]
    t, p = pos.shape
    flat = pos.reshape(1, t * p).expand(kvh, t * p)
    rows = gather_rows(kv.ctx_k, flat.clamp(0, n - 1))  # [KVH, T·P, D]
    if m > 0:
        li = (flat - n).clamp(0, m - 1).to(kv.loc_k.device)
        loc = gather_rows(kv.loc_k, li).to(device=device, dtype=rows.dtype)
        rows = torch.where((flat < n)[..., None], rows, loc)
    return rows.view(kvh, t, p, -1)


# ---------------------------------------------------------------------------------------------
# Planner


@dataclass
class TableUpdate:
    """What update() adds to a layer's tables: both are multiplied by `decay` [KVH], then the weights
    are scatter-added: vertical at `vert_at` [KVH, X], slash at `slash_at` [KVH, Y] (valid indexes;
    weight 0 where nothing is added)."""

    decay: torch.Tensor
    vert_at: torch.Tensor
    vert_w: torch.Tensor
    slash_at: torch.Tensor
    slash_w: torch.Tensor


@dataclass
class Search:
    """One layer's plan and everything behind it (tests and benchmarks inspect it)."""

    plan: Plan
    update: TableUpdate
    candidates: torch.Tensor | None = None  # [KVH, T, C] positions scored exactly besides the frame (-1 empty)
    sparsity: torch.Tensor | None = None  # [KVH, G, T] estimated sink share (None: bypass off)
    stats: torch.Tensor | None = None  # [3]: mean candidate fraction, bypassed fraction, capped fraction


def _kernels():
    """The fused search (indexer/kernels/lfps.py), or None where Triton is missing."""
    try:
        from indexer.kernels import lfps
    except ImportError:
        return None
    return lfps


class _LFPSPlanner(Planner):
    """One request: private copies of the score tables (made at a layer's first plan), the pending
    table update of each layer's last plan, and device-side statistics."""

    def __init__(self, index, params: LFPSParams, ctx):
        self.index = index
        self.params = params
        self.n_ctx = n = ctx.n_ctx
        self.sink, self.window = params.frame(n)
        self.n_sink = min(params.sink, n)  # the frame's sink (queries are request tokens: q_pos >= N)
        self.k = params.budget(n)
        self.width = params.candidate_width(n)
        self.slash_cap = n + ctx.max_local  # offsets 0 .. N + max_local - 1
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (vertical [KVH, N], slash)
        self._pending: dict[int, TableUpdate] = {}
        self._acc: dict[int, torch.Tensor] = {}  # layer -> [3] device sums of Search.stats
        self._steps: dict[int, int] = {}  # layer -> sparse steps accumulated
        self._prompt_steps: dict[int, int] = {}  # layer -> dense question steps
        self.fused: bool | None = None  # None: fused kernels for CUDA tensors; True: also on CPU (interpreter)

    # -- tables -------------------------------------------------------------------------------------

    def tables(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """This request's (vertical [KVH, N], slash [KVH, N + max_local]) of a layer, fp32: copied from
        the persisted arrays (never written) at the first call, once, at full capacity."""
        own = self._tables.get(layer)
        if own is None:
            v0, s0 = self.index.layer("vertical", layer), self.index.layer("slash", layer)
            kvh = v0.shape[0]
            vert = torch.zeros(kvh, self.n_ctx, dtype=torch.float32, device=device)
            slash = torch.zeros(kvh, self.slash_cap, dtype=torch.float32, device=device)
            nv, ns = min(self.n_ctx, v0.shape[1]), min(self.slash_cap, s0.shape[1])
            vert[:, :nv].copy_(v0[:, :nv])
            slash[:, :ns].copy_(s0[:, :ns])
            own = self._tables[layer] = (vert, slash)
        return own

    # -- the step -------------------------------------------------------------------------------------

    def plan(self, layer, q, kv):
        s = self.search(layer, q, kv)
        self._pending[layer] = s.update
        if s.plan.is_dense:
            self._prompt_steps[layer] = self._prompt_steps.get(layer, 0) + 1
        if s.stats is not None:
            acc = self._acc.get(layer)
            self._acc[layer] = s.stats if acc is None else acc + s.stats
            self._steps[layer] = self._steps.get(layer, 0) + 1
        return s.plan

    def update(self, layer, k, v, positions):
        u = self._pending.pop(layer, None)
        if u is None:
            return
        vert, slash = self._tables[layer]
        if not isinstance(u, TableUpdate):  # a fused plan's: decay + one launch per token
            _kernels().apply_update(vert, slash, u, gamma=self.params.gamma, n_sink=self.n_sink, window=self.window)
            return
        vert.mul_(u.decay[:, None]).scatter_add_(1, u.vert_at, u.vert_w)
        slash.mul_(u.decay[:, None]).scatter_add_(1, u.slash_at, u.slash_w)

    def _fused_ok(self, q, kv) -> bool:
        if self.fused is False or (self.fused is None and not q.is_cuda):
            return False
        kern = _kernels()
        return kern is not None and not kern.unsupported(q, kv)

    def _search_fused(self, layer, q, kv) -> Search:
        """`search` in Triton launches (indexer/kernels/lfps.py): the same plan rows and candidate
        sets (as sets), the same update up to rounding; `update` is a fused update."""
        p = self.params
        vert, slash = self.tables(layer, q.device)
        mean_k = var_ratio = None
        if p.bypass:
            mean_k = self.index.layer("mean_k", layer).float()  # [KVH, D]
            var_ratio = self.index.layer("var_ratio", layer).float().reshape(-1)  # [KVH·G]
        positions, bypass, rest_logit, sparsity, cand, stats, upd = _kernels().search(
            q, kv, vert, slash, mean_k=mean_k, var_ratio=var_ratio, n_sink=self.n_sink, window=self.window,
            local=p.local, lam=p.lam, bypass=p.bypass, threshold=p.bypass_threshold, width=self.width, k=self.k)
        plan = Plan(positions)
        if p.bypass:
            plan = Plan(positions, bypass=bypass, rest_logit=rest_logit, rest_value=self.index.layer("mean_v", layer))
        return Search(plan, upd, candidates=cand, sparsity=sparsity, stats=stats)

    def search(self, layer: int, q: torch.Tensor, kv) -> Search:
        """The plan for one layer and step, and the table update it implies. Reads state only."""
        if q.shape[2] > 1 and self.params.dense_prompt:
            return self._prompt_search(layer, q, kv)
        if self._fused_ok(q, kv):
            return self._search_fused(layer, q, kv)
        p = self.params
        dev = q.device
        kvh, g, t, d = q.shape
        n, ns = self.n_ctx, self.n_sink
        scale = d ** -0.5
        qf = q.float()
        q_pos = kv.q_pos.long()  # [T]
        vert, slash = self.tables(layer, dev)
        s_end, w_lo = frame_bounds(q_pos, n, self.sink, self.window)  # s_end == ns
        n_loc = (q_pos - n + 1).clamp(min=0)  # [T] request-local tokens visible to each query

        # 1) head sparsity (per query head) -> bypass --------------------------------------------
        s_sink = torch.einsum("hgtd,hsd->hgts", qf, kv.ctx_k[:, :ns].float()) * scale  # [KVH, G, T, ns]
        bypass = sparsity = rest_logit = None
        if p.bypass:
            mean_k = self.index.layer("mean_k", layer).float()  # [KVH, D]
            var_ratio = self.index.layer("var_ratio", layer).float().view(kvh, g)
            lp = q_pos[:, None] - torch.arange(p.local, device=dev)[None, :]  # [T, local] the last positions
            s_lp = torch.einsum("hgtd,htld->hgtl", qf, local_rows(kv, lp, dev).float()) * scale
            log_sink = torch.logsumexp(s_sink, dim=-1)  # -inf without a sink: never bypassed
            log_local = torch.logsumexp(s_lp.masked_fill(~(lp >= ns)[None, None], NEG_INF), dim=-1)
            mu = torch.einsum("hgtd,hd->hgt", qf, mean_k) * scale
            sig2 = var_ratio[..., None] * (qf * qf).sum(-1) * (scale * scale)
            log_global = torch.log((q_pos + 1 - ns).clamp(min=1).float()) + mu + sig2 / 2
            sparsity = torch.sigmoid(log_sink - torch.maximum(log_global, log_local))  # [KVH, G, T]
            bypass = sparsity > p.bypass_threshold
            n_rest = (w_lo - s_end).float()  # [T] context tokens outside the frame
            log_rest = torch.log(n_rest.clamp(min=1)) + mu + sig2 / 2
            rest_logit = torch.where(bypass & (n_rest > 0), log_rest, NEG_INF)
            active = ~bypass
        else:
            active = torch.ones(kvh, g, t, dtype=torch.bool, device=dev)
        group_active = active.any(1)  # [KVH, T]

        # 2-3) candidates from the tables, capped to a fixed width ---------------------------------
        j = torch.arange(n, device=dev)
        off = q_pos[:, None] - j[None, :]  # [T, N] offsets t - j (>= 1)
        slash_at = slash.index_select(1, off.clamp(max=self.slash_cap - 1).reshape(-1)).view(kvh, t, n)
        slash_at = torch.where(off < self.slash_cap, slash_at, 0.0)  # S[t - j]; 0 past the capacity
        vert_t = vert[:, None, :].expand(kvh, t, n)
        region = (j >= ns).expand(kvh, t, n)  # the tables' statistics: non-sink context positions
        c0, keep = initial_candidates(vert_t, slash_at, region, p.lam)
        sel_ok = (j[None, :] >= s_end) & (j[None, :] < w_lo[:, None])  # [T, N] a plan may select
        expanded = expand_candidates(c0, keep) & sel_ok[None]  # [KVH, T, N]
        count = expanded.sum(-1)  # [KVH, T]
        cand = cap_candidates(expanded, vert_t + slash_at, self.width)  # [KVH, T, C]
        cand_ok = cand >= 0

        # 4) exact scores over candidates + frame -> group mass -> top-K ---------------------------
        wpos = w_lo[:, None] + torch.arange(self.window, device=dev)[None, :]  # [T, W] window rows
        w_ok = wpos < n
        s_win = torch.einsum("hgtd,htwd->hgtw", qf,
                             gather_context(kv.ctx_k, wpos.expand(kvh, t, -1)).float()) * scale
        s_win = s_win.masked_fill(~w_ok[None, None], NEG_INF)
        loc_vis = (n + torch.arange(kv.loc_k.shape[1], device=dev))[None, :] <= q_pos[:, None]  # [T, M]
        s_loc = torch.einsum("hgtd,hmd->hgtm", qf, kv.loc_k.to(dev).float()) * scale
        s_loc = s_loc.masked_fill(~loc_vis[None, None], NEG_INF)
        s_cand = torch.einsum("hgtd,htcd->hgtc", qf, gather_context(kv.ctx_k, cand).float()) * scale
        s_cand = s_cand.masked_fill(~cand_ok[:, None], NEG_INF)
        s_all = torch.cat([s_sink, s_win, s_loc, s_cand], dim=-1)  # [KVH, G, T, ns + W + M + C]
        heads = torch.where(group_active[:, None], active, True).float()  # all bypassed: rank with all
        c = cand.shape[-1]
        mass = (torch.softmax(s_all, dim=-1)[..., -c:] * heads[..., None]).sum(1)  # [KVH, T, C]
        val, at = torch.topk(torch.where(cand_ok, mass, -1.0), min(self.k, c), dim=-1, sorted=False)
        picked = val >= 0
        positions = torch.where(picked, cand.gather(-1, at), -1).to(torch.int32)  # [KVH, T, K]
        chosen = torch.zeros_like(cand_ok).scatter_(-1, at, picked)  # [KVH, T, C]

        # 5) the table update: attention over frame + top-K, sink removed, renormalised, halved ----
        attended = torch.cat([w_ok.expand(kvh, t, -1), loc_vis.expand(kvh, t, -1), chosen], dim=-1)
        att = torch.softmax(s_all[..., ns:].masked_fill(~attended[:, None], NEG_INF), dim=-1)  # sink removed
        act = active.float()
        w = (att * act[..., None]).sum(1) / act.sum(1).clamp(min=1)[..., None]  # [KVH, T, W + M + C]
        m = kv.loc_k.shape[1]
        ctx_pos = torch.cat([torch.where(w_ok, wpos, -1).expand(kvh, t, -1), cand], dim=-1)  # [KVH, T, W + C]
        ctx_w = torch.cat([w[..., :self.window], w[..., self.window + m:]], dim=-1)
        upd = self._token_update(ctx_pos, ctx_w, group_active, q_pos)

        # statistics (device): exact q·k per visible token, bypassed heads, cut candidate sets
        frame = s_end + w_ok.sum(-1) + n_loc  # [T]
        scored = frame[None] + torch.where(group_active, cand_ok.sum(-1), 0)
        zero = torch.zeros((), device=dev)
        stats = torch.stack([
            (scored.float() / (q_pos + 1).float()[None]).mean(),
            bypass.float().mean() if bypass is not None else zero,
            (count > c).float().mean(),
        ])
        plan = Plan(positions)
        if p.bypass:
            mean_v = self.index.layer("mean_v", layer)
            plan = Plan(positions, bypass=bypass, rest_logit=rest_logit, rest_value=mean_v)
        return Search(plan, upd, candidates=cand, sparsity=sparsity, stats=stats)

    def _token_update(self, pos, w, upd, q_pos) -> TableUpdate:
        """pos [KVH, T, X] context positions attended (-1 none), w [KVH, T, X] their weights (sink
        removed, renormalised, group mean), upd [KVH, T] which (head, token) update. Tokens in order:
        a token's weights are decayed by the later updating tokens; both tables by all of them."""
        kvh, t, x = pos.shape
        u = upd.float()
        later = torch.flip(torch.cumsum(torch.flip(u, [1]), 1), [1]) - u  # updating tokens after t
        coef = 0.5 * self.params.gamma ** later * u  # [KVH, T]
        ww = torch.where(pos >= 0, w * coef[..., None], 0.0)
        off = q_pos[None, :, None] - pos  # [KVH, T, X] offsets t - j
        off_ok = (pos >= 0) & (off < self.slash_cap)
        return TableUpdate(
            decay=self.params.gamma ** u.sum(1),
            vert_at=pos.clamp(0, self.n_ctx - 1).reshape(kvh, -1), vert_w=ww.reshape(kvh, -1),
            slash_at=off.clamp(0, self.slash_cap - 1).reshape(kvh, -1),
            slash_w=torch.where(off_ok, ww, 0.0).reshape(kvh, -1),
        )

    def _prompt_search(self, layer, q, kv) -> Search:
        """A step of T > 1 tokens (the question) ends the paper's prefill: a dense plan, and the tokens'
        exact weights enter the tables in order. Tokens are processed in chunks so the [KVH, G, T', N]
        score block stays bounded; the update is summed into table-sized deltas."""
        dev = q.device
        kvh, g, t, d = q.shape
        n, ns = self.n_ctx, self.n_sink
        scale = d ** -0.5
        vert, slash = self.tables(layer, dev)
        q_pos = kv.q_pos.long()
        m = kv.loc_k.shape[1]
        loc_k = kv.loc_k.to(dev).float()
        ctx_k = kv.ctx_k  # scored in its own dtype (a bf16 context is not copied to fp32 whole)
        gamma = self.params.gamma
        vert_w = torch.zeros(kvh, n, device=dev)
        slash_w = torch.zeros(kvh, self.slash_cap, device=dev)
        j = torch.arange(n, device=dev)
        chunk = max(1, (1 << 26) // (kvh * g * (n + m)))  # score blocks of at most 256 MB (fp32)
        for a in range(0, t, chunk):
            qc, pc = q[:, :, a:a + chunk].float(), q_pos[a:a + chunk]
            tc = qc.shape[2]
            s = torch.cat([torch.einsum("hgtd,hnd->hgtn", qc.to(ctx_k.dtype), ctx_k).float(),
                           torch.einsum("hgtd,hmd->hgtm", qc, loc_k)], dim=-1) * scale
            loc_vis = (n + torch.arange(m, device=dev))[None, :] <= pc[:, None]
            s[..., n:] = s[..., n:].masked_fill(~loc_vis[None, None], NEG_INF)
            w = torch.softmax(s[..., ns:], dim=-1).mean(1)[..., :n - ns]  # [KVH, T', N - ns]: sink removed
            coef = 0.5 * gamma ** (t - 1 - torch.arange(a, a + tc, device=dev)).float()  # [T']
            wc = w * coef[None, :, None]
            vert_w[:, ns:] += wc.sum(1)
            off = (pc[:, None] - j[None, ns:]).clamp(max=self.slash_cap - 1)  # [T', N - ns]
            ok = (pc[:, None] - j[None, ns:]) < self.slash_cap
            slash_w.scatter_add_(1, off.reshape(1, -1).expand(kvh, -1),
                                 torch.where(ok[None], wc, 0.0).reshape(kvh, -1))
        every = torch.arange(self.slash_cap, device=dev).expand(kvh, -1)
        upd = TableUpdate(decay=torch.full((kvh,), gamma ** t, device=dev), vert_at=j.expand(kvh, -1), vert_w=vert_w,
                          slash_at=every, slash_w=slash_w)
        return Search(Plan.dense(), upd)

    def stats(self) -> dict:
        per = {layer: (acc / self._steps[layer]).tolist() for layer, acc in sorted(self._acc.items())}
        nl = max(len(per), 1)
        ps = self._prompt_steps
        return {
            "candidate_fraction": sum(v[0] for v in per.values()) / nl,
            "bypass_fraction": sum(v[1] for v in per.values()) / nl,
            "capped_fraction": sum(v[2] for v in per.values()) / nl,
            "candidate_fraction_per_layer": [round(v[0], 4) for v in per.values()],
            "bypass_fraction_per_layer": [round(v[1], 4) for v in per.values()],
            "dense_prompt_steps": sum(ps.values()) // max(len(ps), 1),
        }

    def close(self) -> None:
        self._tables.clear()
        self._pending.clear()


@register
class LFPS(SparseMethod):
    name = "lfps"
    Params = LFPSParams
    has_index = True

    def validate_configuration(self, spec, params, env=None):
        return [] if spec.num_heads % spec.num_kv_heads == 0 else ["query heads must be a multiple of KV heads"]

    @torch.no_grad()
    def build(self, prefill, params, env=None):
        q, k, v = prefill.q, prefill.k, prefill.v  # [L, H, N, D], [L, KVH, N, D]
        nl, h, n, d = q.shape
        kvh = k.shape[1]
        g = h // kvh
        ts = min(params.table_sink, n - 1)
        vert = torch.zeros(nl, kvh, n, device=k.device)
        slash = torch.zeros(nl, kvh, n, device=k.device)
        var_ratio = torch.zeros(nl, h, device=k.device)
        for layer in range(nl):
            for kh in range(kvh):
                qg = q[layer, kh * g:(kh + 1) * g]  # [G, N, D]
                vert[layer, kh], slash[layer, kh] = init_tables(qg, k[layer, kh], params.init_steps, params.gamma, ts)
                logits = qg[:, -1].float() @ k[layer, kh, ts:].float().T  # [G, N - ts], last prefill query
                q_norm2 = (qg[:, -1].float() ** 2).sum(-1).clamp_min(1e-30)
                var_ratio[layer, kh * g:(kh + 1) * g] = logits.var(-1, unbiased=False) / q_norm2
        mean_k = k[:, :, ts:].float().mean(2)
        mean_v = v[:, :, ts:].float().mean(2)
        return {"vertical": vert, "slash": slash, "mean_k": mean_k, "mean_v": mean_v, "var_ratio": var_ratio}

    def open(self, index, params, ctx):
        if index is None:
            raise ValueError("lfps needs its index (score tables); build it at prefill")
        return _LFPSPlanner(index, params, ctx)
