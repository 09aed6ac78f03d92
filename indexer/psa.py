"""`psa`: Progressive Sparse Attention (papers/psa.txt §3.2, Algorithm 1), as a fixed-shape plan.

Prefill (`build`): the context keys are cut into blocks of `block_size` tokens [32]; per block and
KV head we persist its bounding cuboid and mean, `block_meta` [L, KVH, blocks, 3, D] fp16 with rows
(min, max, mean). fp16 rounding is directed (min rounded down, max rounded up), so the cuboid still
contains every key of the block and the criticality below stays an upper bound. The last block may
be partial.

Decode. The paper walks the blocks in descending criticality, microbatch by microbatch, merging
each block's attention into a running output and stopping once the estimated attention mass
reaches eps. Its output is exact attention over the processed blocks, so here the planner returns
the *set* of processed context tokens and the backend attends it with the frame (frame ∪ plan =
the progressive output O_acc / AS_acc). The walk itself is replaced by cumulative ops over a fixed
number of candidates, so a plan has a fixed shape and never waits on the device:

1. Dense part (always processed, counted in AS_acc, not ranked): every request-local token the
   query sees and every context block holding a sink token or a context token of the recent
   window (its tokens outside the frame are planned; the frame attends the rest). The blocks that
   can hold a window token are the last few of the context, known from n_ctx and `window`.
2. Criticality of every other context block (one pass over the metadata). `criticality="cuboid"`
   (default): the exact upper bound of q·k over the cuboid, sum_d max(q_d·min_d, q_d·max_d) =
   q⁺·max + q⁻·min (Quest-style); `"center"`: q·(min + max)/2 (our reading of ArkVale's
   "cuboid-mean", which the paper names as its default without defining it); `"mean"`: q·mean of
   the block's keys (InfLLM-style). GQA pooling (the G query heads of a KV head share one block
   order, because a block is loaded per KV head): per head, softmax over blocks of the scaled bound,
   summed over the group's heads -- the same pooling as `topk`'s group attention mass, so heads with
   different logit scales stay comparable. Measured on the captured 2K document (8 queries x 30
   layers, eps 0.9 / 0.95, recall of the exact top-5%): this pooling 0.870 / 0.908 recall, 0.071 /
   0.052 output error; the alternative "max over heads of the logit relative to the head's best
   block" 0.862 / 0.903 and 0.075 / 0.056, at the same KV touched (0.41 / 0.51).
3. The B_max best blocks, in order (B_max = ceil(`max_ratio` · blocks), a host int from the params
   and n_ctx: the plan's width), get their exact sums AS_b = sum exp(q·k·scale) per query head in
   one vectorized pass. After i + 1 blocks: AS_acc = dense part + cumsum, AS_min = cummin of the
   block sums (a partial block's sum scaled to a full block first, so it never pulls AS_min down by
   being short), N_left = ranked blocks not yet processed (all of them, not only the B_max), and
   P_acc = AS_acc / (AS_acc + AS_min·N_left). The rule is checked where the paper checks it, after
   every `microbatch` blocks (and after the last ranked block); the KV head stops at the first check
   where every query head of its group has P_acc >= eps (stopping per group is what a block loader
   shared by the group does). Blocks after the stop point become -1. eps = 1 processes every block,
   i.e. exact attention (AS_min can underflow to 0, so eps = 1 means "until no block is left").
   A head that has not reached eps after B_max blocks stops there (`max_ratio` < 1 only; the
   default 1.0 is the paper's uncapped rule; `stats()["capped_fraction"]` counts those).

`rule="budget"`: the plan is every one of the B_max best blocks (steps 1-3 without the sums: Quest's
fixed budget over the same criticality and group score), in block order; eps and microbatch are not
used, P_acc is not estimated (`mass_est` NaN, `stats()["mass_est_mean"]` None), `capped` marks rows
with more ranked blocks than B_max. It is the set the progressive rule keeps at eps = 1 under the same
cap, planned without reading a key: on the GPU two launches (criticality, then a select that writes
the plan) instead of four, and the attention reads all B_max blocks instead of the stop's prefix (on
the GPU benchmark's data at ρ 5% the stop keeps 32-48% of them at 32K-128K). H200, one 8B layer, ρ 5%
(benchmarks/RESULTS.md, session 36): 32K 26.4 -> 22.1-22.5 µs, 128K 50-51 -> 41-43 µs, 512K 139 -> 129 µs,
128K B = 8 142-169 -> 130 µs; its fidelity against the progressive rule at the same cap:
benchmarks/RESULTS_psa_lfps.md. The GPU search's cost scales with the number of blocks (every block's metadata
scored, every block's key ranked), the attention's with the tokens attended: blocks of 128 tokens (`block_size`, a
build field) quarter the search at the same budget (128K: 41-43 -> 31.5-33 µs, 8 requests 97 µs, 512K 67 µs) with
the same recall and model fidelity for the same KV on the 8K document (RESULTS.md and RESULTS_psa_lfps.md, session 38);
with the budget plan written as block ids (`BlockList`, session 39) 30.4-31.4 µs at 128K, 62 µs at 512K; with the
criticality's loads issued together (session 40) 29.8-30.4 µs at 128K (5.00-5.16× SDPA), 61.4-61.7 µs at 512K
(session 41: 4.91-5.06× at 128K over six runs). `criticality="mean"` reads one metadata row per block instead of two:
512K 59.1-59.2 µs against 61.2-61.4, the same at 128K, with the same recall and top-1 agreement on the 8K document
(benchmarks/RESULTS.md, session 41); cuboid stays the default.

Cost: one pass over the block metadata (criticality, a sort of the blocks) plus exact q·k over the
B_max candidate blocks and the dense part. The fixed shape is the price of no host sync: the plan
scores all B_max candidates, also those after the stop point, so `max_ratio` is what bounds the work
of a step. At the default (1.0, the paper's uncapped rule) that is every key of the context, as for
dense attention; a serving config sets it to the processed fraction it expects, with a margin. When
max_ratio·T >= 1 the plan scores every key in one GEMM and sums blocks by a reshape (cheaper than
gathering the candidates); otherwise it gathers the candidate blocks' keys only.

AS_min·N_left is the paper's estimate of the unprocessed mass. It is an upper bound only when
blocks arrive in decreasing order of their true sums (tested on synthetic data where they do). The
cuboid bound of 64-dim keys is loose, so on real data the order is only approximate and the true
mass of the processed set can end under eps for some heads (measured: RESULTS_psa_lfps.md).

Plan: positions [KVH, T, (F + B_max)·block_size] int32: the dense-part blocks' planned tokens (F =
blocks that can hold a sink or window token), then the processed ranked blocks' tokens, -1 padded.
Request-local tokens are never planned (the frame attends all of them).

GPU: the plan runs fused (`indexer/kernels/psa.py`): the criticality of every block with its
per-tile softmax state, the B_max best blocks by an integer-key threshold search (no sort), their
exact per-block sums (each candidate block's keys read once for the GQA group) with their rank in
the order, and the stop rule + positions: 4 launches per chunk of query tokens, no host sync,
deterministic (ties: lowest block id first). Asked by its caller (`KVView.attend_scale`: the runner
for a request alone in its step, under the `triton` backend) it also attends the plan from the
scores and values of the blocks it sums, for short candidate lists (`Plan.attended`: the backend then
runs nothing; `indexer/kernels/psa.py`, "The plan's attention"). This torch code is the reference
and the CPU path; the fused plan selects the same blocks in the same order (up to near-ties of the
fp16 criticality: the kernel module's docstring). `planner.fused`: None = fused for CUDA tensors (the default), True =
also on CPU (Triton's interpreter, tests), False = torch. Its speed against the torch plan and
dense attention: benchmarks/RESULTS.md, "Fused searches (issue 12) and the batched runner".

Stats (`stats()`): blocks processed per (layer, KV head, token) step, dense-part blocks included;
the mean estimated mass P_acc at the stop; the fraction of (KV head, token) steps cut by
`max_ratio`. `plan` keeps its numbers aside, `update` adds them to device accumulators (a plan that
is thrown away is not counted), `stats()` reads them back once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from indexer.selection import gather_rows
from indexer.base import (Attended, BlockList, MethodParams, Plan, Planner, SparseMethod, budget, frame_bounds,
                          graph_capturing, register)

META_MIN, META_MAX, META_MEAN = 0, 1, 2
FP16_MAX = 65504.0
NEG_INF = float("-inf")


class PSAParams(MethodParams):
    block_size: int = Field(32, ge=1, le=4096, description="tokens per KV block (build)")
    eps: float = Field(0.95, gt=0.0, le=1.0, description="stop once the estimated attention mass reaches eps")
    microbatch: int = Field(4, ge=1, le=1 << 16, description="blocks processed between two checks of the stop rule")
    criticality: Literal["cuboid", "center", "mean"] = Field(
        "cuboid", description="block score: cuboid upper bound, q·cuboid center, or q·mean"
    )
    rule: Literal["progressive", "budget"] = Field(
        "progressive",
        description="progressive: the paper's stop once the estimated mass reaches eps; budget: every one of the "
                    "max_ratio best blocks (Quest's fixed budget: no exact sums, eps unused, faster on a GPU)",
    )
    max_ratio: float = Field(
        1.0, gt=0.0, le=1.0,
        description="most ranked context blocks processed per step, as a fraction of the context's blocks "
                    "(fixes the plan's width and the work per step; 1.0 = the paper's uncapped rule)",
    )

    build_fields = frozenset({"block_size"})

    def _widen(self, factor: float) -> "PSAParams":
        """The mass left out, 1 - eps, divided by `factor`, and the block cap `max_ratio` times it."""
        return self.with_overrides({"eps": round(1.0 - (1.0 - self.eps) / factor, 12),
                                    "max_ratio": min(1.0, round(self.max_ratio * factor, 12))})

    def max_blocks(self, n_ctx: int) -> int:
        """B_max: ranked blocks a plan holds at most, for a context of n_ctx tokens."""
        nb = -(-n_ctx // self.block_size)
        return min(budget(nb, ratio=self.max_ratio), nb) if nb else 0


# ---------------------------------------------------------------------------------------------
# Build


def _round_half(x: torch.Tensor, direction: float) -> torch.Tensor:
    """fp16 copy of x rounded toward `direction` (-inf: every value <= x; +inf: >= x)."""
    x = x.clamp(-FP16_MAX, FP16_MAX)
    h = x.half()
    wrong = (h.float() > x) if direction < 0 else (h.float() < x)
    toward = torch.full_like(h, direction)
    return torch.where(wrong, torch.nextafter(h, toward), h).clamp(-FP16_MAX, FP16_MAX)


def block_metadata(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """k [KVH, N, D] -> [KVH, blocks, 3, D] fp32 (min, max, mean); the last block may be partial."""
    kvh, n, d = k.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    kf = k.float()
    kmin = F.pad(kf, (0, 0, 0, pad), value=float("inf")).view(kvh, nb, block_size, d).amin(2)
    kmax = F.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(kvh, nb, block_size, d).amax(2)
    cnt = torch.full((nb,), float(block_size), device=k.device)
    cnt[-1] = n - (nb - 1) * block_size
    mean = F.pad(kf, (0, 0, 0, pad)).view(kvh, nb, block_size, d).sum(2) / cnt[None, :, None]
    return torch.stack([kmin, kmax, mean], dim=2)


# ---------------------------------------------------------------------------------------------
# Decode: the progressive rule, fixed shape


def block_criticality(q: torch.Tensor, meta: torch.Tensor, kind: str) -> torch.Tensor:
    """q [KVH, G, T, D], meta [KVH, B, 3, D] -> per-head score [KVH, G, T, B] fp32 (q·k scale, unscaled).

    One GEMM over the metadata as stored: the cuboid bound q⁺·max + q⁻·min is [q⁻ | q⁺]·[min | max]
    (rows 0 and 1 of a block's metadata are adjacent, so [min | max] is a view). On a GPU the GEMM
    reads the fp16 metadata in place (fp32 accumulation, fp16 result: the bound holds to fp16
    rounding); on the CPU it runs in fp32."""
    cdt = meta.dtype if q.is_cuda else torch.float32
    if kind == "mean":
        qq, mm = q, meta[:, :, META_MEAN]  # [KVH, B, D] view
    else:
        qq = torch.cat([q.clamp(max=0), q.clamp(min=0)] if kind == "cuboid" else [0.5 * q, 0.5 * q], dim=-1)
        mm = meta[:, :, META_MIN:META_MAX + 1].flatten(2)  # [KVH, B, 2D] view: (min, max)
    return torch.einsum("hgtd,hbd->hgtb", qq.to(cdt), mm.to(cdt)).float()


def group_order(crit: torch.Tensor, scale: float) -> torch.Tensor:
    """[KVH, G, T, B] per-head criticality -> [KVH, T, B] group score: sum over the group's heads of
    softmax over blocks of the scaled bound (see the module docstring)."""
    return torch.softmax(crit * scale, dim=-1).sum(1)


def dense_part_blocks(n_ctx: int, block_size: int, sink: int, window: int) -> tuple[int, int]:
    """Host ints (sink blocks, first block that can hold a context token of the window): the blocks
    [0, sink blocks) and [first, blocks) can belong to a step's dense part; no other can. A query
    sits at q_pos >= n_ctx, so the window's context part lies in [n_ctx - window + 1, n_ctx)."""
    nb = -(-n_ctx // block_size)
    n_sb = -(-min(sink, n_ctx) // block_size)
    first = (max(n_ctx - window + 1, 0) // block_size) if window >= 2 else nb
    return n_sb, max(first, n_sb)


@dataclass
class ProgressivePlan:
    # [KVH, T, (F + B_max)·bs] int32: planned context positions, -1 = none; or the blocks they are (the fused
    # budget plan: a BlockList of F + B_max ids, `positions` expands it)
    selection: torch.Tensor | BlockList
    blocks: torch.Tensor  # [KVH, T] int64: blocks processed (dense-part blocks + ranked ones)
    # [KVH, T, B_max] int64: the candidate blocks, best first (past n_ranked: any); the fused budget plan's:
    # int32, a view of its block list's ids, in block order
    ranked: torch.Tensor
    used: torch.Tensor  # [KVH, T] int64: how many of them were processed
    mass_est: torch.Tensor  # [KVH, G, T] fp32: P_acc at the stop
    capped: torch.Tensor  # [KVH, T] bool: stopped by B_max before the rule was met
    lengths: torch.Tensor  # [KVH, T] int32: (dense-part blocks + used)·bs, positions past it are -1
    out: torch.Tensor | None = None  # [KVH, G, T, D]: the attention over the plan (the fused plan, when asked)

    @property
    def positions(self) -> torch.Tensor:
        return self.selection.positions if isinstance(self.selection, BlockList) else self.selection


def _amax(x: torch.Tensor) -> torch.Tensor:
    """Max over the last dim; -inf where it is empty (no request-local rows: a plan made before the
    step's own key exists, or no dense-part block)."""
    return x.amax(-1) if x.shape[-1] else x.new_full(x.shape[:-1], NEG_INF)


@torch.no_grad()
def progressive_plan(
    q: torch.Tensor,  # [KVH, G, T, D]
    ctx_k: torch.Tensor,  # [KVH, N, D]
    loc_k: torch.Tensor,  # [KVH, M, D] request-local keys (slot j at position N + j)
    q_pos: torch.Tensor,  # [T]
    meta: torch.Tensor,  # [KVH, blocks, 3, D] persisted block metadata
    block_size: int,
    *,
    eps: float,
    microbatch: int,
    sink: int,
    window: int,
    max_blocks: int,
    criticality: str = "cuboid",
    rule: str = "progressive",
    score_all: bool | None = None,
) -> ProgressivePlan:
    """Algorithm 1 of the PSA paper over the B_max best-ranked blocks, batched over KV heads and
    query tokens, without a loop (see the module docstring). `rule="budget"`: the B_max best blocks
    in block order, no exact sums and no stop (eps and microbatch unused). `score_all`: compute q·k for
    every context key instead of gathering the candidate blocks (same result; default: when
    max_blocks·T >= blocks, where it is the cheaper of the two)."""
    dev = q.device
    kvh, g, t, d = q.shape
    n = ctx_k.shape[1]
    bs = block_size
    nb = meta.shape[1]
    bm = min(max_blocks, nb)
    if bm == 0:  # an empty context: nothing to plan
        z = torch.zeros(kvh, t, dtype=torch.int64, device=dev)
        return ProgressivePlan(torch.full((kvh, t, 0), -1, dtype=torch.int32, device=dev), z,
                               z[..., :0], z, torch.ones(kvh, g, t, device=dev), z.bool(), z.int())
    scale = d ** -0.5
    s_end, w_lo = frame_bounds(q_pos, n, sink, window)  # sink [0, s_end), window [w_lo[t], n)
    n_sb, first_w = dense_part_blocks(n, bs, sink, window)

    bidx = torch.arange(nb, device=dev)
    b_end = ((bidx + 1) * bs).clamp(max=n)  # [B] one past each block's last position
    full_scale = bs / (b_end - bidx * bs).float()  # [B] scales a partial block's sum to full size
    forced = (bidx < n_sb)[None, :] | ((b_end[None, :] > w_lo[:, None]) & (w_lo[:, None] < n))  # [T, B]
    n_ranked = nb - forced.sum(-1)  # [T] blocks in the ranked order

    # -- rank: one pass over the metadata ------------------------------------------------------
    crit = block_criticality(q, meta, criticality).masked_fill(forced[None, None], NEG_INF)  # [KVH, G, T, B]
    score = group_order(crit, scale).masked_fill(forced[None], -1.0)  # [KVH, T, B]; all-forced rows: -1
    val, top = torch.sort(score, dim=-1, descending=True)  # faster than a sorted top-k on a GPU
    val, top = val[..., :bm], top[..., :bm]  # [KVH, T, B_max], best first
    top_ok = val >= 0
    ar = torch.arange(bs, device=dev)
    f_ids = torch.cat([torch.arange(n_sb, device=dev), torch.arange(first_w, nb, device=dev)])  # [F]
    f_tok = f_ids[:, None] * bs + ar  # [F, bs]
    f_keep = forced[:, f_ids]  # [T, F]: the static dense-part blocks that are this query's
    if rule == "budget":  # every candidate, in block order; P_acc is not estimated
        used = top_ok.sum(-1)  # [KVH, T]
        keep = torch.arange(bm, device=dev)[None, None, :] < used[..., None]
        top = torch.where(keep, top, nb).sort(-1).values
        mass_est = torch.full((kvh, g, t), math.nan, device=dev)
        capped = (used > 0) & (used < n_ranked[None, :])
        return _plan_of(top, keep, used, mass_est, capped, f_tok, f_keep, s_end, w_lo, n, nb, n_ranked, bs,
                        ranked=torch.where(keep, top, -1))

    # -- exact sums: dense part and the candidates ---------------------------------------------
    loc_vis = (n + torch.arange(loc_k.shape[1], device=dev))[None, :] <= q_pos[:, None]  # [T, M]
    s_loc = torch.einsum("hgtd,hmd->hgtm", q, loc_k.to(dev, q.dtype)).float() * scale  # (offload: rows on the GPU)
    s_loc = s_loc.masked_fill(~loc_vis[None, None], NEG_INF)
    if score_all is None:
        score_all = bm * t >= nb
    if score_all:  # q·k of every key; block sums by a reshape
        s = torch.einsum("hgtd,hnd->hgtn", q, ctx_k.to(q.dtype)).float() * scale
        s = F.pad(s, (0, nb * bs - n), value=NEG_INF).view(kvh, g, t, nb, bs)
        m = torch.maximum(s.amax((-1, -2)), _amax(s_loc))  # [KVH, G, T]
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        blk = torch.exp(s - m[..., None, None]).sum(-1)  # [KVH, G, T, B]
        dense = (blk * forced[None, None]).sum(-1)
        top_sum = blk.gather(-1, top[:, None].expand(kvh, g, t, bm))
    else:  # gather the candidate blocks (and the dense-part blocks) only
        tok = top[..., None] * bs + ar  # [KVH, T, B_max, bs]
        k_c = gather_rows(ctx_k, tok.clamp(max=n - 1).view(kvh, -1)).view(kvh, t, bm * bs, d)
        s_c = torch.einsum("hgtd,htpd->hgtp", q, k_c.to(q.dtype)).float() * scale
        s_c = s_c.masked_fill(~(top_ok[..., None] & (tok < n)).view(kvh, 1, t, bm * bs), NEG_INF)
        k_f = gather_rows(ctx_k, f_tok.clamp(max=n - 1).view(1, -1).expand(kvh, -1))  # [KVH, F·bs, D]
        s_f = torch.einsum("hgtd,hpd->hgtp", q, k_f.to(q.dtype)).float() * scale
        f_ok = (f_keep[..., None] & (f_tok < n)[None]).view(t, -1)  # [T, F·bs]
        s_f = s_f.masked_fill(~f_ok[None, None], NEG_INF)
        m = torch.maximum(torch.maximum(s_c.amax(-1), _amax(s_f)), _amax(s_loc))
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        top_sum = torch.exp(s_c - m[..., None]).view(kvh, g, t, bm, bs).sum(-1)  # [KVH, G, T, B_max]
        dense = torch.exp(s_f - m[..., None]).sum(-1)
    dense = dense + torch.exp(s_loc - m[..., None]).sum(-1)  # [KVH, G, T]; > 0 once a query sees its own key

    # -- the stop rule, by cumulative ops -------------------------------------------------------
    top_sum = torch.where(top_ok[:, None], top_sum, torch.zeros_like(top_sum))
    done = torch.arange(1, bm + 1, device=dev)  # blocks processed after candidate i
    as_acc = dense[..., None] + top_sum.cumsum(-1)  # [KVH, G, T, B_max]
    as_min = torch.where(top_ok[:, None], top_sum * full_scale[top][:, None], torch.full_like(top_sum, math.inf))
    as_min = as_min.cummin(-1).values
    n_left = (n_ranked[:, None] - done[None, :]).clamp(min=0)  # [T, B_max]
    rest = torch.where(n_left[None, None] > 0, as_min * n_left[None, None].float(), torch.zeros_like(as_min))
    p_acc = torch.where(rest > 0, as_acc / (as_acc + rest), torch.ones_like(as_acc))
    head_ok = (n_left <= 0)[None, None].expand_as(p_acc) if eps >= 1.0 else p_acc >= eps
    check = (done % microbatch == 0) | (done == bm) | (done[None, :] == n_ranked[:, None])  # [T, B_max]
    stop = head_ok.all(1) & check[None] & top_ok  # [KVH, T, B_max]
    stopped = stop.any(-1)
    first = stop.to(torch.int32).argmax(-1).long()  # the first stop point
    used = torch.where(stopped, first + 1, top_ok.sum(-1))  # [KVH, T]
    at = (used - 1).clamp(min=0)[:, None, :, None].expand(kvh, g, t, 1)
    mass_est = torch.where(used[:, None] > 0, p_acc.gather(-1, at)[..., 0], torch.ones_like(dense))

    keep = torch.arange(bm, device=dev)[None, None, :] < used[..., None]  # [KVH, T, B_max]
    return _plan_of(top, keep, used, mass_est, ~stopped & (used > 0), f_tok, f_keep, s_end, w_lo, n, nb, n_ranked,
                    bs, ranked=top)


def _plan_of(top, keep, used, mass_est, capped, f_tok, f_keep, s_end, w_lo, n, nb, n_ranked, bs, *, ranked):
    """The plan's positions: the dense-part blocks' tokens outside the frame, then the kept candidates'
    tokens (top [KVH, T, B_max] block ids in plan order, keep: its first `used`), -1 elsewhere."""
    kvh, t, bm = top.shape
    tok = top[..., None] * bs + torch.arange(bs, device=top.device)
    pos_r = torch.where(keep[..., None] & (tok < n), tok, -1).view(kvh, t, bm * bs)
    f_sel = f_keep[..., None] & (f_tok[None] >= s_end) & (f_tok[None] < w_lo[:, None, None])  # [T, F, bs]
    pos_f = torch.where(f_sel, f_tok[None], -1).view(1, t, -1).expand(kvh, t, -1)
    positions = torch.cat([pos_f, pos_r], dim=-1).to(torch.int32)
    blocks = used + (nb - n_ranked)[None, :]
    lengths = ((used + pos_f.shape[-1] // bs) * bs).to(torch.int32)
    return ProgressivePlan(positions, blocks, ranked, used, mass_est, capped, lengths)


# ---------------------------------------------------------------------------------------------
# Planner


def _kernels():
    """The fused plan's module (indexer/kernels/psa.py), or None where Triton is missing."""
    try:
        from indexer.kernels import psa
    except ImportError:
        return None
    return psa


class _PSAPlanner(Planner):
    def __init__(self, index, params: PSAParams, n_ctx: int):
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self.sink, self.window = params.frame(n_ctx)
        self.max_blocks = params.max_blocks(n_ctx)
        self._last: dict[int, ProgressivePlan] = {}  # layer -> its last plan (committed by update)
        self._acc: dict[int, torch.Tensor] = {}  # layer -> [3] float64 sums: blocks, mass at stop, capped
        self._rows: dict[int, int] = {}  # layer -> (kv head, token) rows summed
        self._heads: dict[int, int] = {}  # layer -> (query head, token) pairs summed
        self.fused: bool | None = None  # None: fused kernels for CUDA tensors; True: also on CPU (interpreter)

    def _fused(self, q, meta):
        """The fused plan's module when it runs for this query, else None (the torch path)."""
        if self.fused is False or (self.fused is None and not q.is_cuda):
            return None
        kernels = _kernels()
        return None if kernels is None or kernels.unsupported(q, meta, self.params.block_size) else kernels

    def plan(self, layer, q, kv):
        p = self.params
        meta = self.index.layer("block_meta", layer)  # persisted, shared: read only
        kernels = self._fused(q, meta)
        args = (q, kv.ctx_k, kv.loc_k, kv.q_pos, meta, p.block_size)
        kw = dict(eps=p.eps, microbatch=p.microbatch, sink=self.sink, window=self.window,
                  max_blocks=self.max_blocks, criticality=p.criticality, rule=p.rule)
        if kernels is None:
            res = progressive_plan(*args, **kw)
        else:  # with the plan's attention where the caller asks and it pays (`kernels.attends`)
            res = kernels.progressive_plan(*args, **kw, ctx_v=kv.ctx_v, loc_v=kv.loc_v, attend_scale=kv.attend_scale)
        self._last[layer] = res
        attended = None
        if res.out is not None:
            attended = Attended(q, self.sink, self.window, kv.attend_scale, res.out)
        return Plan(res.selection, lengths=res.lengths, attended=attended)

    def update(self, layer, k, v, positions):
        res = self._last.pop(layer, None)
        if res is None or graph_capturing(res.lengths):
            # stats() is diagnostics: ~8 small kernels per layer, not replayed in every graphed token
            # (the counts cover the steps run eagerly; `Planner` says so)
            return
        add = torch.stack([res.blocks.double().sum(), res.mass_est.double().sum(), res.capped.double().sum()])
        if layer in self._acc:
            self._acc[layer] += add
        else:
            self._acc[layer] = add
        self._rows[layer] = self._rows.get(layer, 0) + res.blocks.numel()
        self._heads[layer] = self._heads.get(layer, 0) + res.mass_est.numel()

    def stats(self) -> dict:
        layers = sorted(self._acc)
        if not layers:
            return {"blocks_per_step": 0.0, "blocks_per_step_per_layer": [], "mass_est_mean": None,
                    "capped_fraction": 0.0, "max_blocks": self.max_blocks}
        acc = torch.stack([self._acc[l] for l in layers]).cpu().tolist()  # one read back
        per_layer = [a[0] / self._rows[l] for a, l in zip(acc, layers)]
        return {
            "blocks_per_step": sum(per_layer) / len(per_layer),
            "blocks_per_step_per_layer": [round(v, 2) for v in per_layer],
            "mass_est_mean": (None if self.params.rule == "budget"  # not estimated (no exact sums)
                              else sum(a[1] for a in acc) / sum(self._heads[l] for l in layers)),
            "capped_fraction": sum(a[2] for a in acc) / sum(self._rows[l] for l in layers),
            "max_blocks": self.max_blocks,
        }

    def close(self):
        self._last.clear()


@register
class PSA(SparseMethod):
    name = "psa"
    Params = PSAParams
    has_index = True

    def build(self, prefill, params, env=None):
        k = prefill.k  # [L, KVH, N, D]
        metas = []
        for layer in range(k.shape[0]):  # per layer: bounded temporary memory
            m = block_metadata(k[layer], params.block_size)
            metas.append(torch.stack([
                _round_half(m[:, :, META_MIN], -math.inf),
                _round_half(m[:, :, META_MAX], math.inf),
                m[:, :, META_MEAN].clamp(-FP16_MAX, FP16_MAX).half(),
            ], dim=2))
        return {"block_meta": torch.stack(metas)}  # [L, KVH, blocks, 3, D] fp16

    def open(self, index, params, ctx):
        if index is None:
            raise ValueError("psa needs its index (block metadata); build it at prefill")
        return _PSAPlanner(index, params, ctx.n_ctx)
