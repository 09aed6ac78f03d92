"""`lfps`: Learn From the Past for Sparse indexing (papers/lfps.txt §4, App. B).

The paper's equations were lost in extraction; this is a reconstruction from its prose. Each choice
the prose leaves open is marked RECONSTRUCTED, with the reason.

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

Decode step, per layer, KV head and query token t (batched over heads and tokens):
1. Head sparsity (per query head): sink mass A_s = sum over sink tokens of exp(s_j) (exact), local
   mass A_l = sum over the last `local` [5] positions (exact), global mass from a log-normal model
   of the logits: s ~ N(mu, sigma^2) with mu = q·mean_k·scale and sigma^2 = var_ratio·|q|^2·scale^2,
   so A_g = n_nonsink · exp(mu + sigma^2 / 2) (the mean of a log-normal).
   RECONSTRUCTED (Eq. 6): sparsity = A_s / (A_s + max(A_g, A_l)): "by dynamically comparing" the
   global estimate (better for flat heads) and the local mass (better for concentrated heads), the
   larger one stands for the non-sink mass. A head with sparsity > `bypass_threshold` [0.85] is
   highly sparse: it skips steps 2-4 (no search, no table update) and its output is
   RECONSTRUCTED (bypass output): exact attention over sink + window plus one pseudo-token
   (mean_k, mean_v) standing for the n_rest unattended positions, with weight n_rest·exp(mu +
   sigma^2/2) (the same log-normal estimate), i.e. "the sink value combined with the mean of the
   other values". It needs `attend()`; layers with no bypassed head use `select()`.
2. Initial candidates: C0 = {j : V[j] > tau_V} ∪ {j : S[t - j] > tau_S}, j over the visible
   non-sink positions.
   RECONSTRUCTED (Eq. 8): tau = mean + lam·(max - mean)·sqrt(3 / kurtosis), kurtosis the 4th
   standardised moment of the table over the visible positions, 3 the kurtosis of a Gaussian. It
   has the three properties the prose states: larger lam -> higher threshold -> fewer candidates;
   higher kurtosis (sharper pattern) -> lower threshold -> larger budget; lam in [0.1, 0.4]. And
   tau >= mean, so every initial candidate survives step 3 at offset 0. Measured on the captured 2K
   document (one decode query, every 3rd layer, all KV heads): lam 0.1 / 0.2 / 0.3 / 0.4 -> 18.8 /
   14.5 / 11.6 / 9.7% of positions after expansion, holding 79 / 73 / 66 / 61% of the exact top-5%;
   the session's candidate fraction over 16 queries x 30 layers at lam 0.2 is 13.4% (the small
   model's attention is flatter than the paper's Llama-3.1-8B, where it reports 1.2-8%).
3. Expansion: E = {j + d : j in C0, d in {-1, 0, +1, +2}, V[j + d] > mean(V) or
   S[t - j - d] > mean(S)} (means over the visible non-sink positions).
4. Candidates = E ∪ sink ∪ window (what gets an exact q·k; its size / visible is the reported
   candidate fraction). Exact group scores on them (sum over the group's non-bypassed heads of
   softmax over the candidates, as `topk`) -> top-K of the non-sink, non-window candidates, K =
   ratio·visible [5%] (or `k`) -> attention over sink ∪ window ∪ top-K (the frame).
5. Table update with that attention: per head, the weights over the attended set with the sink
   removed and renormalised, averaged over the group's non-bypassed heads, halved:
   V <- gamma·V + w/2 at the positions, S <- gamma·S + w/2 at the offsets t - j.

The question (a step of T > 1 tokens). ADAPTED: in the paper the prompt, question included, is
prefilled with full attention and the tables come from its last steps, i.e. from the question. Here
the context is prefilled once without any question, so with `dense_prompt` [on] a multi-token step
is treated as the end of the prefill: dense attention (`select` returns None) and each token's
exact weights (sink removed, renormalised, group mean, halved) update the tables in order. Measured
on the passkey document (560 tokens, 5 keys): without it LFPS answered 0/5 (the tables only know
the noise at the end of the context, and a position that is never a candidate is never attended,
so it never enters the tables); with it 2/5 (full attention 4/5, exact top-5% 5/5; see
benchmarks/RESULTS_psa_lfps.md). With `dense_prompt` off, the T tokens are planned from the same
tables and the T updates are applied in order (decay gamma per token).

State isolation: the persisted tables are shared (IndexReader, DRAM tier) and never written. A
session copies a layer's tables on its first update (copy-on-write) into private buffers that grow
with the request (vertical over positions, slash over offsets): 2·KVH·(N + M)·4 bytes per layer.

Reporting: `session.stats()` gives the candidate fraction (exact q·k per visible position, a fully
bypassed KV head counts its sink + window), the bypassed fraction of query heads, per layer too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field

from indexer._select import gather_positions
from indexer.base import MethodParams, MethodSession, SparseMethod, register

OFFSETS = (-1, 0, 1, 2)


class LFPSParams(MethodParams):
    init_steps: int = Field(64, ge=1, le=1 << 16, description="last prefill queries that initialise the tables (build)")
    table_sink: int = Field(4, ge=0, le=4096, description="first positions kept out of the tables and means (build)")
    gamma: float = Field(0.95, gt=0.0, lt=1.0, description="decay of the score tables (build and decode)")
    lam: float = Field(0.2, ge=0.1, le=0.4, description="candidate threshold hyper-parameter (paper: 0.1-0.4)")
    ratio: float = Field(0.05, gt=0.0, le=1.0, description="top-K budget as a fraction of visible tokens")
    k: int | None = Field(None, ge=1, le=1 << 22, description="top-K budget in tokens; overrides ratio")
    bypass: bool = Field(True, description="skip the search for highly sparse heads (sink + mean output)")
    bypass_threshold: float = Field(0.85, gt=0.0, le=1.0, description="sparsity above which a head is bypassed")
    local: int = Field(5, ge=1, le=4096, description="recent positions in the local mass of the sparsity estimate")
    dense_prompt: bool = Field(
        True, description="a step of several tokens (the question) attends densely and feeds the tables"
    )

    build_fields = frozenset({"init_steps", "table_sink", "gamma"})

    def budget(self, n_visible: int) -> int:
        k = self.k if self.k is not None else math.ceil(self.ratio * n_visible)
        return max(1, min(k, n_visible))


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
    """Mean, max and kurtosis of x over `valid` along the last dim."""
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


def mask_to_index(mask: torch.Tensor) -> torch.Tensor:
    """[..., P] bool -> [..., C] positions of the True entries in increasing order, -1 padded."""
    shape = mask.shape
    flat = mask.reshape(-1, shape[-1])
    rank = torch.cumsum(flat, dim=-1) - 1  # slot of each True entry
    c = int(rank[:, -1].max()) + 1 if flat.numel() else 0
    out = torch.full((flat.shape[0], c + 1), -1, dtype=torch.long, device=mask.device)  # last column: dump
    cols = torch.arange(shape[-1], device=mask.device).expand_as(flat)
    out.scatter_(1, torch.where(flat, rank, c), cols)
    return out[:, :c].reshape(*shape[:-1], c)


def _logsumexp_masked(s: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(s.masked_fill(~valid, float("-inf")), dim=-1)


# ---------------------------------------------------------------------------------------------
# Session


class _Plan:
    __slots__ = ("sel", "bypass", "out", "frac", "candidates", "sparsity")

    def __init__(self, sel, bypass, out, frac, candidates, sparsity):
        self.sel, self.bypass, self.out, self.frac = sel, bypass, out, frac
        self.candidates = candidates  # [KVH, T, C] positions that got an exact q·k (-1 padded)
        self.sparsity = sparsity  # [KVH, G, T] estimated sink share of the attention


class _LFPSSession(MethodSession):
    def __init__(self, index, params: LFPSParams, n_ctx: int):
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self._tables: dict[int, list[torch.Tensor]] = {}  # layer -> [vertical, slash] private copies
        self._pending: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (layer, q_pos, sel)
        self._acc: dict[int, list[float]] = {}  # layer -> [cand frac sum, bypass frac sum, steps]
        self.last: dict[int, _Plan] = {}  # layer -> the latest step's plan (inspection, tests)
        self._prompt_steps: dict[int, int] = {}  # layer -> dense prompt steps

    # -- tables -----------------------------------------------------------------------------------

    def _view(self, layer: int, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables covering positions / offsets [0, need): the private copy if this session has one,
        else the persisted arrays (read only), zero-padded."""
        own = self._tables.get(layer)
        if own is not None:
            self._reserve(layer, need)
            return own[0][:, :need], own[1][:, :need]
        vert, slash = self.index.layer("vertical", layer), self.index.layer("slash", layer)
        if need > vert.shape[1]:
            vert = F.pad(vert, (0, need - vert.shape[1]))
            slash = F.pad(slash, (0, need - slash.shape[1]))
        return vert[:, :need], slash[:, :need]

    def _reserve(self, layer: int, need: int) -> list[torch.Tensor]:
        own = self._tables.get(layer)
        if own is None:  # copy on first write: the persisted tables are shared and stay untouched
            vert, slash = self.index.layer("vertical", layer), self.index.layer("slash", layer)
            cap = max(need, vert.shape[1]) + 256
            own = [F.pad(vert.float(), (0, cap - vert.shape[1])), F.pad(slash.float(), (0, cap - slash.shape[1]))]
            self._tables[layer] = own
        elif need > own[0].shape[1]:
            grow = max(need, 2 * own[0].shape[1]) - own[0].shape[1]
            own[0] = F.pad(own[0], (0, grow))
            own[1] = F.pad(own[1], (0, grow))
        return own

    def _update(self, layer: int, pos: torch.Tensor, w: torch.Tensor, upd: torch.Tensor, q_pos: torch.Tensor):
        """pos [KVH, T, C] attended positions (-1 none), w [KVH, T, C] update weights (already halved,
        sink removed), upd [KVH, T] whether this (head, token) updates. Tokens applied in order."""
        p = self.params
        own = self._reserve(layer, int(q_pos.max()) + 1)
        vert, slash = own
        kvh, t, c = pos.shape
        u = upd.to(vert.dtype)
        later = torch.flip(torch.cumsum(torch.flip(u, [1]), 1), [1]) - u  # updates after token t
        decay_total = p.gamma ** u.sum(1)  # [KVH]
        scale = (p.gamma ** later) * u  # [KVH, T]
        ww = torch.where(pos >= 0, w * scale[..., None], torch.zeros_like(w)).reshape(kvh, -1)
        pj = pos.clamp(min=0).reshape(kvh, -1)
        off = (q_pos[None, :, None] - pos).clamp(min=0).reshape(kvh, -1)
        vert.mul_(decay_total[:, None]).scatter_add_(1, pj, ww)
        slash.mul_(decay_total[:, None]).scatter_add_(1, off, ww)

    # -- the step ---------------------------------------------------------------------------------

    def _plan(self, layer: int, q: torch.Tensor, kv, want_output: bool) -> _Plan:
        p = self.params
        dev = q.device
        kvh, g, t, d = q.shape
        scale = d ** -0.5
        q_pos = kv.q_pos
        nv = int(q_pos.max()) + 1
        vis = (q_pos + 1).to(torch.float32)  # [T]
        n_sink = min(p.sink, int(q_pos.min()) + 1)
        j = torch.arange(nv, device=dev)
        visible = j[None, :] <= q_pos[:, None]  # [T, nv]
        is_sink = j < n_sink
        in_window = (j[None, :] > q_pos[:, None] - p.window) & visible  # [T, nv]
        region = visible & ~is_sink[None, :]  # non-sink visible positions
        if t > 1 and p.dense_prompt:
            return self._prompt_step(layer, q, kv, nv, n_sink, visible)

        # 1) head sparsity (per query head) -----------------------------------------------------
        mean_k = self.index.layer("mean_k", layer).to(q.dtype)  # [KVH, D]
        mean_v = self.index.layer("mean_v", layer).to(q.dtype)
        var_ratio = self.index.layer("var_ratio", layer).to(q.dtype).view(kvh, g)  # [KVH, G]
        lp = q_pos[:, None] - torch.arange(p.local, device=dev)[None, :]  # [T, local]
        lp = torch.where(lp >= n_sink, lp, -1)
        sw = torch.arange(n_sink, device=dev)[None, :].expand(t, n_sink)
        probe = torch.cat([sw, lp], dim=-1).expand(kvh, t, -1)  # sink, then local positions
        s_probe = torch.einsum("hgtd,htpd->hgtp", q, gather_positions(probe, kv.ctx_k, kv.loc_k)).float() * scale
        log_sink = _logsumexp_masked(s_probe[..., :n_sink], torch.ones_like(s_probe[..., :n_sink], dtype=torch.bool))
        log_local = _logsumexp_masked(s_probe[..., n_sink:], (lp >= 0)[None, None].expand_as(s_probe[..., n_sink:]))
        mu = torch.einsum("hgtd,hd->hgt", q, mean_k).float() * scale
        sig2 = var_ratio[..., None].float() * (q.float() ** 2).sum(-1) * scale * scale
        n_rest_all = (vis - n_sink).clamp(min=1)  # [T]
        log_global = torch.log(n_rest_all) + mu + sig2 / 2
        sparsity = torch.sigmoid(log_sink - torch.maximum(log_global, log_local))  # [KVH, G, T]
        if p.bypass and n_sink > 0:
            bypass = sparsity > p.bypass_threshold
        else:
            bypass = torch.zeros_like(sparsity, dtype=torch.bool)
        active = ~bypass  # heads that search
        group_active = active.any(1)  # [KVH, T]

        # 2-3) candidates from the tables ---------------------------------------------------------
        vert, slash = self._view(layer, nv)  # [KVH, nv]
        if t == 1:  # slash_at[j] = S[t - j]: the table read backwards
            slash_at = slash.flip(-1)[:, None]  # [KVH, 1, nv]
        else:
            slash_at = slash[:, (q_pos[:, None] - j[None, :]).clamp(min=0)]  # [KVH, T, nv]
        vert_t = vert[:, None, :].expand(kvh, t, nv)
        c0, keep = initial_candidates(vert_t.float(), slash_at.float(), region[None].expand(kvh, t, nv), p.lam)
        cand = expand_candidates(c0, keep) | is_sink[None, None] | in_window[None]  # [KVH, T, nv]
        cand = cand & visible[None]
        n_sw = (is_sink[None] | in_window).sum(-1).float()  # [T]
        cand_frac = torch.where(group_active, cand.sum(-1).float(), n_sw[None]) / vis[None]

        # 4) exact scores on the candidates -> top-K ---------------------------------------------
        idx = mask_to_index(cand)  # [KVH, T, C]
        ok = idx >= 0
        kk = gather_positions(idx, kv.ctx_k, kv.loc_k)
        s = torch.einsum("hgtd,htcd->hgtc", q, kk).float() * scale
        s = s.masked_fill(~ok[:, None], float("-inf"))
        pc = idx.clamp(min=0)
        fixed = ok & ((pc < n_sink) | (pc > q_pos[None, :, None] - p.window))  # sink or window
        mass = torch.softmax(s, dim=-1)
        heads = torch.where(group_active[:, None], active, torch.ones_like(active))  # all-bypassed: any
        gmass = (mass * heads[..., None]).sum(1)  # [KVH, T, C]
        budget = p.budget(nv)
        rank = gmass.masked_fill(~ok | fixed, float("-inf"))
        kk_ = min(budget, rank.shape[-1])
        top = torch.topk(rank, kk_, dim=-1)
        chosen = torch.zeros_like(ok).scatter_(-1, top.indices, torch.isfinite(top.values))
        sel = torch.where(torch.isfinite(top.values), torch.gather(idx, -1, top.indices), -1)  # [KVH, T, K]

        # 5) table update with the attention over sink + window + top-K ---------------------------
        attended = fixed | chosen  # [KVH, T, C]
        att = torch.softmax(s.masked_fill(~attended[:, None], float("-inf")), dim=-1)  # [KVH, G, T, C]
        w = att.masked_fill((pc < n_sink)[:, None], 0.0)
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-30)  # sink removed, renormalised
        w = (w * active[..., None]).sum(1) / active.sum(1).clamp(min=1)[..., None]  # [KVH, T, C] group mean
        if bool(group_active.any()):
            self._update(layer, idx, 0.5 * w, group_active, q_pos)

        out = None
        frac = torch.where(group_active, attended.sum(-1).float(), n_sw[None] + 1) / vis[None]
        if want_output and bool(bypass.any()):
            vv = gather_positions(idx, kv.ctx_v, kv.loc_v).float()  # [KVH, T, C, D]
            out_sparse = torch.einsum("hgtc,htcd->hgtd", att, vv)  # = the frame's attention over the selection
            # bypass: sink + window exact, plus the mean pseudo-token for the n_rest other positions
            n_rest = vis[None] - fixed.sum(-1).float()  # [KVH, T]
            log_mean = torch.log(n_rest.clamp(min=1))[:, None] + mu + sig2 / 2  # [KVH, G, T]
            log_mean = torch.where(n_rest[:, None] > 0, log_mean, torch.full_like(log_mean, float("-inf")))
            s_b = torch.cat([s.masked_fill(~fixed[:, None], float("-inf")), log_mean[..., None]], dim=-1)
            p_b = torch.softmax(s_b, dim=-1)
            out_bypass = torch.einsum("hgtc,htcd->hgtd", p_b[..., :-1], vv)
            out_bypass = out_bypass + p_b[..., -1:] * mean_v.float()[:, None, None]
            out = torch.where(bypass[..., None], out_bypass, out_sparse).to(q.dtype)

        acc = self._acc.setdefault(layer, [0.0, 0.0, 0])
        acc[0] += float(cand_frac.mean())
        acc[1] += float(bypass.float().mean())
        acc[2] += 1
        plan = _Plan(sel, bypass, out, frac, idx, sparsity)
        self.last[layer] = plan
        return plan

    def _prompt_step(self, layer, q, kv, nv, n_sink, visible) -> _Plan:
        """A step of T > 1 tokens (the question) ends the paper's prefill: dense attention (the frame's,
        select returns None), and the tokens' exact weights enter the tables in order."""
        kvh, g, t, d = q.shape
        k_all = torch.cat([kv.ctx_k, kv.loc_k], dim=1)[:, :nv]  # [KVH, nv, D]
        s = torch.einsum("hgtd,hnd->hgtn", q, k_all).float() * d ** -0.5
        w = torch.softmax(s.masked_fill(~visible[None, None], float("-inf")), dim=-1)
        w[..., :n_sink] = 0
        w = (w / w.sum(-1, keepdim=True).clamp_min(1e-30)).mean(1)  # [KVH, T, nv]
        idx = torch.arange(nv, device=q.device).expand(kvh, t, nv)
        self._update(layer, idx, 0.5 * w, torch.ones(kvh, t, dtype=torch.bool, device=q.device), kv.q_pos)
        self._prompt_steps[layer] = self._prompt_steps.get(layer, 0) + 1
        none = torch.zeros(kvh, g, t, dtype=torch.bool, device=q.device)
        plan = _Plan(None, none, None, None, idx, torch.zeros(kvh, g, t, device=q.device))
        self.last[layer] = plan
        return plan

    def attend(self, layer, q, kv):
        plan = self._plan(layer, q, kv, want_output=True)
        if plan.out is None:  # no bypassed head: plain attention over the selection (the frame)
            self._pending = (layer, kv.q_pos, plan.sel)
            return None
        return plan.out, plan.frac

    def select(self, layer, q, kv):
        pend, self._pending = self._pending, None
        if pend is not None and pend[0] == layer and pend[1] is kv.q_pos:
            return pend[2]
        return self._plan(layer, q, kv, want_output=False).sel  # called without attend(): no bypass

    def stats(self) -> dict:
        per = {l: (a[0] / a[2], a[1] / a[2]) for l, a in sorted(self._acc.items()) if a[2]}
        nl = max(len(per), 1)
        return {
            "candidate_fraction": sum(v[0] for v in per.values()) / nl,
            "bypass_fraction": sum(v[1] for v in per.values()) / nl,
            "candidate_fraction_per_layer": [round(v[0], 4) for v in per.values()],
            "bypass_fraction_per_layer": [round(v[1], 4) for v in per.values()],
            "dense_prompt_steps": sum(self._prompt_steps.values()) // max(len(self._prompt_steps), 1),
        }


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

    def open(self, index, params, n_ctx, env=None):
        if index is None:
            raise ValueError("lfps needs its index (score tables); build it at prefill")
        return _LFPSSession(index, params, n_ctx)
