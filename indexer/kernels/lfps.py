"""LFPS's one-token decode search (`indexer/lfps.py`, `_LFPSPlanner.search`, steps 1-5 of its docstring)
and its table update as a few Triton launches. The torch code of the planner stays the reference and
the CPU path; the planner dispatches here for CUDA tensors (`planner.fused`, as CTkvr does), or on CPU
tensors through Triton's interpreter when a test sets `planner.fused = True`.

Long because a method's kernels stay together: LFPS's fused search and update are one pipeline of
launches sharing workspaces, with the cost model and register counts that justify them.

One layer and step; rows = KVH x T (one per KV head and query token), N context positions, G query
heads per KV head, C = the candidate cap (`max_candidates`·N), K = the plan's budget, W = window:

1. `_frame_row`, one program per row, run inside step 3's launch (below): the frame's exact logits
   for the whole group (each K row loaded once for the G heads): the sink, the window's context rows (their logits kept for the update) and the
   visible request-local rows -> per head the softmax state (max, sum) of the sink and of window +
   request rows. With bypass on also the head-sparsity estimate of step 1 (the `local` probe rows, the
   log-normal global mass from mean_k / var_ratio): `sparsity`, `Plan.bypass`, `Plan.rest_logit`, and
   the heads that rank (active, or all when the whole group is bypassed).
2. `_moments_kernel`, grid (ceil((N - sink) / BLOCK_M), rows): per tile of BLOCK_M non-sink positions
   of both tables (V[j] and S[t - j], 0 past the slash capacity) the count, mean, central 2nd/3rd/4th
   moment sums and the max, float64, two-pass inside the tile (it sits in registers).
3. `_frame_candidates_kernel`, grid (1 + P, rows): program 0 of a row runs step 1 (`_frame_row`), the
   P others step 3 (`_candidates_chunk`); the two are independent, so the frame (~9 us of one
   program's latency at 128K) runs beside the candidates instead of before them (one launch less on
   the step's path, since 2026-11-28; both branches compile into one kernel, so it takes the
   frame's registers). Every candidates program merges its row's tile moments (the exact shift
   formula: M_k = sum_p sum_i C(k, i) delta_p^(k-i) M_i,p, in float64, fixed order) into the two
   kurtosis thresholds tau_V, tau_S and the means, then over a chunk of positions evaluates C0 at
   j+1, j, j-1, j-2 (the expansion offsets -1..+2), keep(j) and "selectable" (outside sink and
   window), and writes the capped-candidate score V[j] + S[t - j] or -inf into a [rows, N] buffer;
   zeroes the row's candidate flags (int8 [rows, N]); counts the expanded set (statistics).
4. `topk_positions(buf, C)` (`indexer/kernels/select.py`, the fused radix select, 4 launches): the
   candidate set [KVH, T, C] int32 (`Search.candidates`), its row in index order.
5. `_score_kernel`, grid (ceil(C / (BLOCK_S x TILES)), rows): straight from the candidate list, TILES
   [4] tiles of BLOCK_S [64] slots per program: the slots' positions, then their key rows (a dense list:
   every load is a whole 2·D-byte row, 16 B per thread) -> the G logits of each candidate, stored at
   its position in a [rows, N, G_PAD] fp32 buffer (-inf in padded head columns; an empty slot, -1,
   loads and stores nothing). bf16 keys (`score_mma`, the default): one tensor-core dot per tile,
   [BLOCK_S, D] bf16 keys x [D, 3·G_PAD -> 16] bf16 query, whose columns hold the three bf16
   pieces of each head's fp32 query (q = hi + mid + lo, each the bf16 rounding of what the earlier
   pieces leave: 24 significand bits, so q to ~2^-24), fp32 accumulation, the three pieces' columns
   summed per head (sm_90: 8 wgmma m64n16k16 per tile). Other key dtypes or `score_mma=False`:
   fp32 products and sums on CUDA cores, one head at a time. The same program sets its candidates'
   flags (int8 [rows, N], zeroed by step 3) and writes the softmax state per head (max, sum of
   exp(x - max)) of its logits: an online state per slot of the tile across the program's tiles,
   reduced over the tile once at the end. Until 2026-11-28 the flags and the states were two more launches
   (`_mark_kernel`, and `_state_kernel` over chunks of positions in position order): the candidate
   list's order came from the select's atomic counters and changed from run to run, so per-program
   states would have rounded differently each run. The select now writes its row in index order (a
   function of the scores), so the programs' states are the same bits on every run.
6. `_mass_kernel`, grid (P, rows): merges the frame's and the score programs' softmax states into the
   per-head normaliser (an online merge in blocks of `block_states` states, fixed order) and writes
   the group mass (sum over ranking heads of exp(s - max) / sum)
   of every candidate, -inf elsewhere, into the [rows, N] buffer; its program (0, 0) also writes the
   step's statistics [3]. Then `topk_positions(mass, K)` (4 launches): the plan's positions.
7. `_chosen_max_kernel` / `_chosen_sum_kernel`, grid (ceil(K / BLOCK_K), rows): the chosen rows'
   logits copied out of the shared buffer into the pending update (per step, like the plan), their
   per-head max (float atomic max: exact, order-free), then sum of exp(s - max') with max' over
   window + request rows + chosen, as 64-bit fixed point (integer atomics: the same bits in any
   order; each term <= 1, scaled by 2^(62 - ceil(log2(K + 1))), so ~1e-15 absolute, and the sum is
   >= 1 because the max term is 1).

`update()`: `_decay_kernel`, grid (ceil(max(N, N + max_local) / BLOCK), KVH): both tables times
gamma^(tokens whose group is active); then per token (in order) `_add_kernel`, grid
(ceil((W + K) / BLOCK_K), KVH): the weights of the window's context rows and of the chosen positions
(softmax over window + request rows + chosen, sink removed, mean over the active heads, halved, times
gamma^(later updating tokens)) added to V[j] and S[t - j]. Within one launch every address has one
writer (a token's positions are distinct, and so are its offsets t - j): no float atomics anywhere,
so plans and tables are bit-identical run to run. 16 launches per layer-step at T = 1 (14 plan, 2
update).

What may differ from the torch path: rounding. The table moments are float64 here (the torch path's
are float32 on fp32 tables), so tau and the means differ by ~1e-7 relative and a position whose table
value lies that close to a threshold or a mean can change sides; logits are fp32 dot products of the
fp32 query with the fp32 or bf16 key in another summation order (~1e-7 relative: on CUDA cores an
fp32 reduction tree; on tensor cores, bf16 keys, exact products of the key with each bf16 piece of
the query summed in the MMA's fp32 accumulator and the three pieces added: the same ~1e-6 absolute
error as torch's own fp32 einsum at D 128, where a plain bf16 query would be ~1e-3 relative and
could move the top-K), and the normalisers are summed in another order. A logit does not depend on
its candidate's slot (one writer; each dot-product element is reduced in a fixed order whatever its
row in the tile); the normaliser is summed per score program in slot order, so it depends on the
candidate list's order: the select kernel's canonical order makes it the same bits on every run
(with torch.topk's order, where the select kernel is off, it is torch's; another order moves it by
fp32 rounding). Ties: equal capped scores or equal masses at the C-th / K-th place are broken by the
select kernel (lowest index first; torch.topk's choice is its own); a candidate set and a plan row
are sets, compared as sets by the tests against torch. Tables after `update` agree with the torch path's to
~1e-6 relative (tests/test_kernels_lfps.py states the tolerance).

Bytes per layer-step at 128K (Llama-3.1-8B layer: KVH 8, G 4, D 128, bf16 K, T 1, max_candidates 0.3,
ratio 0.05: C = 39322, K = 6554; 8 rows; the tables are fp32, 2 x 8 x 131072 x 4 B = 8.4 MB):

| launch | reads | writes | floor at ~3 TB/s |
|---|---|---|---|
| moments | tables 8.4 MB | 64 tiles x 8 rows x 96 B | ~3 us |
| frame + candidates | tables 8.4 MB (the +-2 shifts hit L1); the frame's ~40 K rows per KV head (sink 4, window 32, probe 5) + request rows | scores 4.2 MB, flags 1 MB | ~5 us |
| select C (4) | scores 4.2 MB (then L2) | 1.3 MB | ~12 us (select.py) |
| score | candidates 1.3 MB, K rows 8 x 39322 x 256 B = 80.5 MB | logits 5 MB (16 B rows), flags 0.3 MB, 615 x 8 states x 32 B | ~29 us |
| mass | flags 1 MB, logits 5 MB, states 0.16 MB | masses 4.2 MB | ~4 us |
| select K (4) | masses 4.2 MB | 0.2 MB | ~12 us |
| chosen max + sum | 2 x 0.84 MB (logits of the chosen) | 0.84 MB | ~3 us |
| decay + add | tables 8.4 MB + 0.2 MB scattered | 8.4 MB | ~7 us |

About 135 MB per layer-step, ~85 us at the bandwidth floor plus ~16 launch gaps. The K rows of the
candidates dominate (the unavoidable cost of `max_candidates` 0.3: a smaller cap scales it down
linearly); the two selects are next. Flops: 8 x 39322 x 4 x 128 x 2 = 0.3 Gflop.

The previous score kernel took most of the plan's time (its profile: benchmarks/RESULTS.md,
"Numbers moved out of module docstrings"). That kernel walked all N
positions of its chunk in position order (grid (P ~ 66, rows): ~4 programs per SM), 32 per tile:
a flag load, then the flagged rows' key loads that depend on it, ~10 rows (2.5 KB) per tile. So ~62
tiles one after another per program, each two dependent DRAM round trips, ~10 KB in flight per SM
(~0.75 TB/s: ~110 us), plus the CUDA-core products and shuffle reductions for all N positions,
flagged or not (~5.9e7 warp instructions, 3.3x what the candidates need). The list-driven kernel
loads only the candidates, 64 whole rows (16 KB) per tile, ~10 programs per SM (38 registers, 20 KB
shared) so ~160 KB in flight per SM, and its work is one dot per tile: it should run near the
80.5 MB floor, ~30-40 us; the state launch (since folded into it) added ~3-5 us. Expected: ~35-45
us instead of 153.5, plan + attention ~0.14-0.15 ms instead of 0.258. The CUDA-core fallback (`score_mma=False`, 96 registers at 64 rows) issues ~1.8e7 warp
instructions (products, 64 shuffles per warp and tile) for the same bytes: ~40-50 us expected.
Measured, the estimate against the device and the same positions as the torch plan: benchmarks/RESULTS.md, "Fused searches (issue 12) and the batched runner"
(the `score_mma=False` fallback: "Numbers moved out of module docstrings").

Workspaces (grow-only, per device and stream, shared by the layers of a step: everything in them is
consumed inside one plan): the tile moments, the score / mass buffer [rows, N] fp32, the flags
[rows, N] int8, the logits [rows, N, G_PAD] fp32 (16 MB at 128K), the score programs' softmax
states and the chunks' expanded counts. Outputs allocated per call like the torch path's (a caller may keep them): the plan
(positions, bypass, rest_logit), sparsity, statistics, the candidates, and the pending update (the
chosen rows' logits [rows, K, G_PAD], the window's [rows, W, G_PAD], per-row softmax states and
sums: ~0.9 MB per layer at 128K). Every launch size is a host int from shapes: no host sync,
CUDA-graph capturable.

Checked without a GPU (Triton 3.6, ahead-of-time compile for sm_90 with the JIT's 16-divisibility
of strides, default knobs, Llama-3.1-8B shapes: G 4, D 128 bf16): no register spills; registers per
thread (4 warps): frame + candidates 119 (the frame alone 95, 80 without bypass; the candidates alone
55), moments 95, score 64 with its flags and
states (the default 4 tiles of 64 slots, tensor cores, 20 KB shared; 40 at one tile; 38 at one tile
without flags and states, checked again 2026-11-28; the CUDA-core variant was 96, or 56 at 32 slots,
before them), mass 54 (blocks of 256 states; 40 before), chosen max 25, chosen sum 32, decay 54,
add 42.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import Workspaces, interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4
from indexer.kernels.ivf import _exp, _log  # shared device helpers (libdevice exp / log on a GPU)
from indexer.kernels.select import topk_positions

NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # initial running max: finite, so exp(m_old - m_new) is never nan
# per row and head: sink max, sink sum, window+request max, window+request sum, ranking weight
N_FRAME_STATS: tl.constexpr = tl.constexpr(5)
# per row and head (the pending update): window+request max, sum, active, chosen max
N_REC: tl.constexpr = tl.constexpr(4)

_WS = Workspaces()


@dataclass(frozen=True)
class LfpsConfig:
    """Launch knobs (tests shrink them so the interpreter runs several programs per row)."""

    block: int = 256  # positions per tile of the candidates and mass kernels (a chunk is whole tiles)
    block_score: int = 64  # candidates per tile of the score kernel (x D: its registers; >= 16 with score_mma)
    score_tiles: int = 4  # tiles per program of the score kernel (a loop, pipelined by score_stages)
    block_moments: int = 2048  # positions per program of the moments kernel
    block_k: int = 256  # slots per program of the chosen / add kernels
    block_decay: int = 1024
    block_states: int = 256  # score programs' softmax states merged per step of the mass kernel's loop
    programs_per_sm: int = 4  # programs per launch ~ programs_per_sm x SMs, split over the rows
    score_stages: int = 1  # software pipelining of the score kernel's loop over its tiles
    score_mma: bool = True  # bf16 keys: logits as one tensor-core dot with a 3-piece bf16 split of q
    num_warps: int = 4


DEFAULT_CONFIG = LfpsConfig()


@dataclass
class FusedUpdate:
    """What the fused plan leaves for update(): the plan's positions and the chosen and window rows'
    logits with the softmax states behind their weights (all per call; read by two launches)."""

    positions: torch.Tensor  # [KVH, T, K] int32
    chosen_logits: torch.Tensor  # [rows, K, G_PAD] fp32
    window_logits: torch.Tensor  # [rows, W, G_PAD] fp32
    rec: torch.Tensor  # [rows, N_REC, G_PAD] fp32
    sums: torch.Tensor  # [rows, G_PAD] int64 fixed point
    q_pos: torch.Tensor  # [T]
    shift: int  # fixed-point scale 2^shift


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _key_rows(KB, stride_n, rows, ok, D: tl.constexpr, DP: tl.constexpr):
    """rows [BR] (int64, any value where not ok) of a [*, D] key block -> [BR, DP] fp32, 0 where not ok."""
    ar_d = tl.arange(0, DP)
    return tl.load(KB + rows[:, None] * stride_n + ar_d[None, :], mask=ok[:, None] & (ar_d < D)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _group_logits(k, QROW, stride_qg, scale, BR: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr):
    """k [BR, DP] fp32 -> [BR, GP] logits q_g . k * scale of the G heads (fp32 products, like the
    torch path's einsum of q.float() with the rows .float()); -inf in padded head columns."""
    ar_d = tl.arange(0, DP)
    ar_g = tl.arange(0, GP)
    out = tl.full([BR, GP], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(QROW + g * stride_qg + ar_d, mask=ar_d < D, other=0.0).to(tl.float32)
        sg = tl.sum(k * qg[None, :], 1) * scale
        out = tl.where(ar_g[None, :] == g, sg[:, None], out)
    return out


@triton.jit
def _online(m, l, s, ok, PRECISE: tl.constexpr):
    """Softmax state per head (m [GP] running max, l [GP] sum of exp(x - m)) plus the rows of s
    [BR, GP] where ok [BR]."""
    sm = tl.where(ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(sm, 0))
    l = l * _exp(m - m_new, PRECISE) + tl.sum(_exp(sm - m_new[None, :], PRECISE), 0)
    return m_new, l


@triton.jit
def _log_state(m, l, PRECISE: tl.constexpr):
    """log-sum-exp of a softmax state; -inf where it holds nothing."""
    return tl.where(l > 0, m + _log(tl.where(l > 0, l, 1.0), PRECISE), float("-inf"))


@triton.jit
def _row_coords(QPOS, r, T, N, NS, W):
    kvh = r // T
    t = r % T
    qpos = tl.load(QPOS + t).to(tl.int64)
    w_lo = tl.minimum(tl.maximum(qpos - W + 1, NS), N)  # frame_bounds: the window's first context row
    return kvh, t, qpos, w_lo


# ---------------------------------------------------------------------------------------------
# 1. frame + head sparsity


@triton.jit
def _frame_row(r, Q, CK, LK, QPOS, MEANK, VARR, SPARS, BYP, REST, FST, WLOG, REC, SUMS,
               T, N, M, NS, W, LOCAL, sq_h, sq_g, sq_t, sck_h, sck_n, slk_h, slk_n, smk_h, scale, threshold,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
               BYPASS: tl.constexpr, PRECISE: tl.constexpr):
    """Step 1 for row r (the frame's softmax states, the window's logits, the bypass estimate)."""
    kvh, t, qpos, w_lo = _row_coords(QPOS, r, T, N, NS, W)
    QROW = Q + kvh * sq_h + t * sq_t
    CKH = CK + kvh * sck_h
    LKH = LK + kvh * slk_h
    ar = tl.arange(0, BR).to(tl.int64)
    ar_g = tl.arange(0, GP)
    ok_g = ar_g < G

    m_s = tl.full([GP], NEG_BIG, tl.float32)  # the sink
    l_s = tl.zeros([GP], tl.float32)
    for i0 in range(0, NS, BR):
        rows = i0 + ar
        ok = rows < NS
        s = _group_logits(_key_rows(CKH, sck_n, rows, ok, D, DP), QROW, sq_g, scale, BR, G, GP, D, DP)
        m_s, l_s = _online(m_s, l_s, s, ok, PRECISE)
    m_w = tl.full([GP], NEG_BIG, tl.float32)  # the window's context rows, then the visible request rows
    l_w = tl.zeros([GP], tl.float32)
    for i0 in range(0, W, BR):
        i = i0 + ar
        pos = w_lo + i
        ok = (i < W) & (pos < N)
        s = _group_logits(_key_rows(CKH, sck_n, pos, ok, D, DP), QROW, sq_g, scale, BR, G, GP, D, DP)
        tl.store(WLOG + (r * W + i)[:, None] * GP + ar_g[None, :], tl.where(ok[:, None], s, float("-inf")),
                 mask=(i < W)[:, None])
        m_w, l_w = _online(m_w, l_w, s, ok, PRECISE)
    n_loc = tl.minimum(tl.maximum(qpos - N + 1, 0), M)
    for i0 in range(0, n_loc, BR):
        rows = i0 + ar
        ok = rows < n_loc
        s = _group_logits(_key_rows(LKH, slk_n, rows, ok, D, DP), QROW, sq_g, scale, BR, G, GP, D, DP)
        m_w, l_w = _online(m_w, l_w, s, ok, PRECISE)

    if BYPASS:
        m_p = tl.full([GP], NEG_BIG, tl.float32)  # the last `local` positions (context or request rows)
        l_p = tl.zeros([GP], tl.float32)
        for i0 in range(0, LOCAL, BR):
            i = i0 + ar
            lp = qpos - i
            ok = (i < LOCAL) & (lp >= NS)
            in_ctx = lp < N
            k = _key_rows(CKH, sck_n, tl.minimum(tl.maximum(lp, 0), N - 1), ok & in_ctx, D, DP)
            k += _key_rows(LKH, slk_n, tl.minimum(tl.maximum(lp - N, 0), M - 1), ok & (lp >= N), D, DP)
            s = _group_logits(k, QROW, sq_g, scale, BR, G, GP, D, DP)
            m_p, l_p = _online(m_p, l_p, s, ok, PRECISE)
        log_sink = _log_state(m_s, l_s, PRECISE)  # -inf without a sink
        log_local = _log_state(m_p, l_p, PRECISE)
        ar_d = tl.arange(0, DP)
        qq = tl.load(QROW + ar_g[:, None] * sq_g + ar_d[None, :], mask=ok_g[:, None] & (ar_d < D)[None, :],
                     other=0.0).to(tl.float32)  # [GP, DP]
        mk = tl.load(MEANK + kvh * smk_h + ar_d, mask=ar_d < D, other=0.0).to(tl.float32)
        mu = tl.sum(qq * mk[None, :], 1) * scale
        vr = tl.load(VARR + kvh * G + ar_g, mask=ok_g, other=0.0).to(tl.float32)
        sig2 = vr * tl.sum(qq * qq, 1) * (scale * scale)
        n_glob = tl.maximum(qpos + 1 - NS, 1).to(tl.float32)
        log_global = _log(n_glob, PRECISE) + mu + sig2 / 2
        sparsity = 1.0 / (1.0 + _exp(-(log_sink - tl.maximum(log_global, log_local)), PRECISE))
        byp = (sparsity > threshold) & ok_g
        n_rest = w_lo - NS  # context tokens outside the frame
        log_rest = _log(tl.maximum(n_rest, 1).to(tl.float32), PRECISE) + mu + sig2 / 2
        rest = tl.where(byp & (n_rest > 0), log_rest, float("-inf"))
        out = (kvh * G + ar_g) * T + t  # [KVH, G, T]
        tl.store(SPARS + out, sparsity, mask=ok_g)
        tl.store(BYP + out, byp.to(tl.uint8), mask=ok_g)
        tl.store(REST + out, rest, mask=ok_g)
        act = ok_g & ~byp
    else:
        act = ok_g
    group = tl.sum(act.to(tl.int32), 0) > 0
    rank = tl.where(group, act, ok_g)  # heads that rank the candidates: every head of a bypassed group
    fst = FST + r * (N_FRAME_STATS * GP) + ar_g
    tl.store(fst, m_s)
    tl.store(fst + GP, l_s)
    tl.store(fst + 2 * GP, m_w)
    tl.store(fst + 3 * GP, l_w)
    tl.store(fst + 4 * GP, rank.to(tl.float32))
    rec = REC + r * (N_REC * GP) + ar_g
    tl.store(rec, m_w)
    tl.store(rec + GP, l_w)
    tl.store(rec + 2 * GP, act.to(tl.float32))
    tl.store(rec + 3 * GP, tl.full([GP], NEG_BIG, tl.float32))  # chosen max: atomic max target
    tl.store(SUMS + r * GP + ar_g, tl.zeros([GP], tl.int64))


# ---------------------------------------------------------------------------------------------
# 2-3. table moments -> thresholds -> capped-candidate scores


@triton.jit
def _slash_at(SLH, qpos, j, ok, SC):
    """S[t - j] where ok, 0 past the slash capacity (and where not ok)."""
    off = qpos - j
    return tl.load(SLH + off, mask=ok & (off < SC), other=0.0)


@triton.jit
def _tile_moments(x, ok):
    """x [B] fp32 -> (count, mean, M2, M3, M4, max) over ok, float64, central sums about the tile mean."""
    xd = x.to(tl.float64)
    n = tl.sum(ok.to(tl.float64), 0)
    mean = tl.sum(tl.where(ok, xd, 0.0), 0) / tl.maximum(n, 1.0)
    c = tl.where(ok, xd - mean, 0.0)
    c2 = c * c
    mx = tl.max(tl.where(ok, xd, float("-inf")), 0)
    return n, mean, tl.sum(c2, 0), tl.sum(c2 * c, 0), tl.sum(c2 * c2, 0), mx


@triton.jit(do_not_specialize=["T", "N", "NS", "W", "SC"])
def _moments_kernel(VERT, SLASH, QPOS, PART, T, N, NS, W, SC, s_vh, s_sh, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    kvh, t, qpos, w_lo = _row_coords(QPOS, r, T, N, NS, W)
    j = NS + p * BLOCK + tl.arange(0, BLOCK)
    ok = j < N
    v = tl.load(VERT + kvh * s_vh + j, mask=ok, other=0.0)
    s = _slash_at(SLASH + kvh * s_sh, qpos, j, ok, SC)
    dst = PART + (r * tl.num_programs(0) + p) * 16
    n, mean, m2, m3, m4, mx = _tile_moments(v, ok)
    tl.store(dst + 0, n)
    tl.store(dst + 1, mean)
    tl.store(dst + 2, m2)
    tl.store(dst + 3, m3)
    tl.store(dst + 4, m4)
    tl.store(dst + 5, mx)
    n, mean, m2, m3, m4, mx = _tile_moments(s, ok)
    tl.store(dst + 8, n)
    tl.store(dst + 9, mean)
    tl.store(dst + 10, m2)
    tl.store(dst + 11, m3)
    tl.store(dst + 12, m4)
    tl.store(dst + 13, mx)


@triton.jit
def _threshold(PART, n_parts, lam, PP: tl.constexpr):
    """Tile moments PART[p * 16 + 0..5] of one table -> (tau, mean) over the row (float64):
    tau = mean + lam (max - mean) sqrt(3 / kurtosis), +inf where the variance is 0 (the torch path's
    `kurtosis_threshold`, its clamps included)."""
    pp = tl.arange(0, PP)
    okp = pp < n_parts
    n_p = tl.load(PART + pp * 16, mask=okp, other=0.0)
    mu_p = tl.load(PART + pp * 16 + 1, mask=okp, other=0.0)
    m2_p = tl.load(PART + pp * 16 + 2, mask=okp, other=0.0)
    m3_p = tl.load(PART + pp * 16 + 3, mask=okp, other=0.0)
    m4_p = tl.load(PART + pp * 16 + 4, mask=okp, other=0.0)
    mx = tl.max(tl.load(PART + pp * 16 + 5, mask=okp, other=float("-inf")), 0)
    n = tl.sum(n_p, 0)
    cnt = tl.maximum(n, 1.0)
    mean = tl.sum(n_p * mu_p, 0) / cnt
    d = tl.where(n_p > 0, mu_p - mean, 0.0)
    d2 = d * d
    m2 = tl.sum(m2_p + n_p * d2, 0)
    m4 = tl.sum(m4_p + 4.0 * d * m3_p + 6.0 * d2 * m2_p + n_p * d2 * d2, 0)
    var = m2 / cnt
    kurt = (m4 / cnt) / tl.maximum(var * var, 1e-30)
    tau = mean + lam * (mx - mean) * tl.sqrt(3.0 / tl.maximum(kurt, 1e-30))
    return tl.where(var > 0, tau, float("inf")), mean


@triton.jit
def _candidates_chunk(p, r, n_chunks, VERT, SLASH, QPOS, PART, BUF, FLAG, CNT, T, N, NS, W, SC, n_parts, chunk,
                      s_vh, s_sh, lam, PP: tl.constexpr, BLOCK: tl.constexpr):
    """Step 3 for chunk p of row r's positions (one of n_chunks)."""
    kvh, t, qpos, w_lo = _row_coords(QPOS, r, T, N, NS, W)
    part = PART + r * n_parts * 16
    tau_v, mean_v = _threshold(part, n_parts, lam, PP)
    tau_s, mean_s = _threshold(part + 8, n_parts, lam, PP)
    VH = VERT + kvh * s_vh
    SH = SLASH + kvh * s_sh
    lo = p * chunk
    hi = tl.minimum(lo + chunk, N)
    count = tl.zeros([BLOCK], tl.int32)
    for j0 in range(lo, hi, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inr = j < hi
        near = j < 0  # C0 at j + 1, j, j - 1, j - 2 (expansion offsets -1, 0, +1, +2)
        keep = j < 0
        score = tl.zeros([BLOCK], tl.float32)
        for dd in tl.static_range(4):
            i = j + 1 - dd
            ok = (i >= NS) & (i < N)
            v = tl.load(VH + i, mask=ok, other=0.0)
            s = _slash_at(SH, qpos, i, ok, SC)
            near = near | (ok & ((v.to(tl.float64) > tau_v) | (s.to(tl.float64) > tau_s)))
            if dd == 1:
                keep = ok & ((v.to(tl.float64) > mean_v) | (s.to(tl.float64) > mean_s))
                score = v + s
        sel = near & keep & (j >= NS) & (j < w_lo) & inr
        tl.store(BUF + r * N + j, tl.where(sel, score, float("-inf")), mask=inr)
        tl.store(FLAG + r * N + j, tl.zeros([BLOCK], tl.int8), mask=inr)
        count += sel.to(tl.int32)
    tl.store(CNT + r * n_chunks + p, tl.sum(count, 0))


@triton.jit(do_not_specialize=["T", "N", "M", "NS", "W", "LOCAL", "SC", "n_parts", "chunk"])
def _frame_candidates_kernel(Q, CK, LK, QPOS, MEANK, VARR, SPARS, BYP, REST, FST, WLOG, REC, SUMS,
                             VERT, SLASH, PART, BUF, FLAG, CNT,
                             T, N, M, NS, W, LOCAL, SC, n_parts, chunk,
                             sq_h, sq_g, sq_t, sck_h, sck_n, slk_h, slk_n, smk_h, s_vh, s_sh, scale, threshold, lam,
                             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
                             BYPASS: tl.constexpr, PRECISE: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (1 + chunks, rows): program 0 of a row runs step 1 (`_frame_row`), the others step 3's
    chunks (`_candidates_chunk`). The two are independent (the frame's states are read from step 6
    on), so one launch runs them side by side; each row's frame program is the first of its row's
    programs in the grid's order, so it is not left for a late wave."""
    p = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    if p == 0:
        _frame_row(r, Q, CK, LK, QPOS, MEANK, VARR, SPARS, BYP, REST, FST, WLOG, REC, SUMS,
                   T, N, M, NS, W, LOCAL, sq_h, sq_g, sq_t, sck_h, sck_n, slk_h, slk_n, smk_h, scale, threshold,
                   G, GP, D, DP, BR, BYPASS, PRECISE)
    else:
        _candidates_chunk((p - 1).to(tl.int64), r, tl.num_programs(0) - 1, VERT, SLASH, QPOS, PART, BUF, FLAG, CNT,
                          T, N, NS, W, SC, n_parts, chunk, s_vh, s_sh, lam, PP, BLOCK)


# ---------------------------------------------------------------------------------------------
# 5-6. exact logits of the candidates -> group mass


@triton.jit
def _split_query(QROW, stride_qg, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                 NQ: tl.constexpr):
    """The G query rows as the B operand [DP, NQ] bf16 of one tensor-core dot: column piece·GP + g holds
    piece (0, 1, 2) of q_g = hi + mid + lo, each the bf16 rounding of what the earlier pieces leave
    (24 significand bits in three 8-bit pieces: the fp32 q to ~2^-24 relative; zero columns past 3·GP)."""
    ar_d = tl.arange(0, DP)
    col = tl.arange(0, NQ)
    g = col % GP
    piece = col // GP
    q = tl.load(QROW + g[None, :] * stride_qg + ar_d[:, None],
                mask=((g < G) & (piece < 3))[None, :] & (ar_d < D)[:, None], other=0.0).to(tl.float32)
    hi = q.to(tl.bfloat16)
    rest = q - hi.to(tl.float32)  # exact
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return tl.where(piece[None, :] == 0, hi, tl.where(piece[None, :] == 1, mid, lo))


@triton.jit(do_not_specialize=["T", "N", "C"])
def _score_kernel(Q, CK, CAND, LOGIT, FLAG, K4P, T, N, C, sq_h, sq_g, sq_t, sck_h, sck_n, scale,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr,
                  TILES: tl.constexpr, MMA: tl.constexpr, NQ: tl.constexpr, NUM_STAGES: tl.constexpr,
                  INTERPRETED: tl.constexpr, PRECISE: tl.constexpr):
    """TILES tiles of BR candidate slots of row r: the candidates' key rows (a dense list, so whole
    D-element rows) -> their G logits, stored at their positions in LOGIT (-inf in padded head
    columns), their flags set in FLAG, and the softmax state per head (max, sum of exp(x - max)) of
    the program's logits -> K4P [rows, programs, 2, GP]."""
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    kvh = r // T
    t = r % T
    QROW = Q + kvh * sq_h + t * sq_t
    CKH = CK + kvh * sck_h
    ar_d = tl.arange(0, DP)
    ar_g = tl.arange(0, GP)
    m = tl.full([BR, GP], NEG_BIG, tl.float32)  # softmax state per slot of the tile and head, over the tiles
    l = tl.zeros([BR, GP], tl.float32)
    if MMA:
        qs = _split_query(QROW, sq_g, G, GP, D, DP, NQ)
    for i in tl.range(0, TILES, num_stages=NUM_STAGES):
        slot = (p * TILES + i) * BR + tl.arange(0, BR)
        pos = tl.load(CAND + r * C + slot, mask=slot < C, other=-1).to(tl.int64)
        ok = pos >= 0
        if MMA:  # bf16 keys: [BR, DP] x [DP, NQ] on tensor cores (exact products, fp32 accumulation)
            k = tl.load(CKH + pos[:, None] * sck_n + ar_d[None, :], mask=ok[:, None] & (ar_d < D)[None, :],
                        other=0.0)
            if INTERPRETED:  # the interpreter's dot multiplies bf16 operands as raw uint16 bits (Triton 3.6),
                # and a BLAS matmul's order would depend on the row's place in the tile
                prod = tl.sum(k.to(tl.float32)[:, :, None] * qs.to(tl.float32)[None, :, :], 1)
            else:
                prod = tl.dot(k, qs)  # [BR, NQ] fp32
            s = tl.sum(tl.reshape(prod, (BR, NQ // GP, GP)), 1) * scale  # hi + mid + lo per head
            s = tl.where((ar_g < G)[None, :], s, float("-inf"))
        else:  # fp32 products and sums on CUDA cores, one head at a time
            s = _group_logits(_key_rows(CKH, sck_n, pos, ok, D, DP), QROW, sq_g, scale, BR, G, GP, D, DP)
        tl.store(LOGIT + (r * N + pos)[:, None] * GP + ar_g[None, :], s, mask=ok[:, None])
        tl.store(FLAG + r * N + pos, tl.full([BR], 1, tl.int8), mask=ok)
        x = tl.where(ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m, x)  # elementwise: no reduction across the tile's threads per tile
        l = l * _exp(m - m_new, PRECISE) + _exp(x - m_new, PRECISE)
        m = m_new
    mx = tl.max(m, 0)  # the program's state per head: one reduction at the end
    dst = K4P + ((r * tl.num_programs(0) + p) * 2) * GP + ar_g
    tl.store(dst, mx)
    tl.store(dst + GP, tl.sum(l * _exp(m - mx[None, :], PRECISE), 0))


@triton.jit(do_not_specialize=["T", "N", "NS", "W", "R", "C", "chunk", "n_parts", "n_cnt"])
def _mass_kernel(FLAG, LOGIT, K4P, FST, BUF, CNT, REC, QPOS, STATS, T, N, NS, W, R, C, chunk, n_parts, n_cnt,
                 G: tl.constexpr, GP: tl.constexpr, BR: tl.constexpr, PP: tl.constexpr, RP: tl.constexpr,
                 CP: tl.constexpr, BYPASS: tl.constexpr, PRECISE: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    ar_g = tl.arange(0, GP)
    fst = FST + r * (N_FRAME_STATS * GP) + ar_g
    m_s = tl.load(fst)
    l_s = tl.load(fst + GP)
    m_w = tl.load(fst + 2 * GP)
    l_w = tl.load(fst + 3 * GP)
    rank = tl.load(fst + 4 * GP)
    mx = tl.maximum(m_s, m_w)
    z = l_s * _exp(m_s - mx, PRECISE) + l_w * _exp(m_w - mx, PRECISE)
    pp = tl.arange(0, PP)
    for p0 in range(0, n_parts, PP):  # the score programs' states, merged in a fixed order
        okp = (p0 + pp < n_parts)[:, None]
        src = K4P + (r * n_parts + p0 + pp)[:, None] * (2 * GP) + ar_g[None, :]
        m_p = tl.load(src, mask=okp, other=NEG_BIG)  # [PP, GP]
        l_p = tl.load(src + GP, mask=okp, other=0.0)
        m_new = tl.maximum(mx, tl.max(m_p, 0))
        z = z * _exp(mx - m_new, PRECISE) + tl.sum(l_p * _exp(m_p - m_new[None, :], PRECISE), 0)
        mx = m_new
    z = tl.where(z > 0, z, 1.0)  # padded heads (rank 0) and empty rows
    lo = p * chunk
    hi = tl.minimum(lo + chunk, N)
    for j0 in range(lo, hi, BR):
        j = j0 + tl.arange(0, BR)
        inr = j < hi
        f = tl.load(FLAG + r * N + j, mask=inr, other=0) != 0
        lg = tl.load(LOGIT + (r * N + j)[:, None] * GP + ar_g[None, :], mask=f[:, None], other=float("-inf"))
        w = _exp(lg - mx[None, :], PRECISE) / z[None, :]
        mass = tl.sum(w * rank[None, :], 1)
        tl.store(BUF + r * N + j, tl.where(f, mass, float("-inf")), mask=inr)

    if (p == 0) & (r == 0):  # the step's statistics (the torch path's Search.stats)
        rr = tl.arange(0, RP)
        okr = rr < R
        cc = tl.arange(0, CP)
        cnt = tl.sum(tl.load(CNT + rr[:, None] * n_cnt + cc[None, :], mask=okr[:, None] & (cc < n_cnt)[None, :],
                             other=0), 1)  # [RP] expanded set sizes
        act = tl.load(REC + rr[:, None] * (N_REC * GP) + 2 * GP + ar_g[None, :], mask=okr[:, None], other=0.0)
        n_act = tl.sum(act, 1)
        qp = tl.load(QPOS + rr % T, mask=okr, other=0).to(tl.int64)
        w_lo = tl.minimum(tl.maximum(qp - W + 1, NS), N)
        frame = NS + tl.minimum(tl.maximum(N - w_lo, 0), W) + tl.maximum(qp - N + 1, 0)
        scored = frame + tl.where(n_act > 0, tl.minimum(cnt, C), 0)
        s0 = tl.sum(tl.where(okr, scored.to(tl.float32) / (qp + 1).to(tl.float32), 0.0), 0) / R
        if BYPASS:
            s1 = (R * G - tl.sum(n_act, 0)) / (R * G)
        else:
            s1 = 0.0
        s2 = tl.sum((okr & (cnt > C)).to(tl.float32), 0) / R
        tl.store(STATS, s0)
        tl.store(STATS + 1, s1)
        tl.store(STATS + 2, s2)


# ---------------------------------------------------------------------------------------------
# 7. the chosen rows' softmax state (the pending update)


@triton.jit(do_not_specialize=["N", "K"])
def _chosen_max_kernel(POS, LOGIT, LC, REC, N, K, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    ar_g = tl.arange(0, GP)
    slot = p * BLOCK + tl.arange(0, BLOCK)
    oks = slot < K
    pos = tl.load(POS + r * K + slot, mask=oks, other=-1).to(tl.int64)
    ok = pos >= 0
    lg = tl.load(LOGIT + (r * N + pos)[:, None] * GP + ar_g[None, :], mask=ok[:, None], other=float("-inf"))
    tl.store(LC + (r * K + slot)[:, None] * GP + ar_g[None, :], lg, mask=oks[:, None])
    if tl.sum(ok.to(tl.int32), 0) > 0:
        tl.atomic_max(REC + r * (N_REC * GP) + 3 * GP + ar_g, tl.max(lg, 0), mask=ar_g < G, sem="relaxed")


@triton.jit(do_not_specialize=["K"])
def _chosen_sum_kernel(LC, REC, SUMS, K, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr,
                       FX: tl.constexpr, PRECISE: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    ar_g = tl.arange(0, GP)
    slot = p * BLOCK + tl.arange(0, BLOCK)
    lg = tl.load(LC + (r * K + slot)[:, None] * GP + ar_g[None, :], mask=(slot < K)[:, None], other=float("-inf"))
    rec = REC + r * (N_REC * GP) + ar_g
    mx = tl.maximum(tl.load(rec), tl.load(rec + 3 * GP))  # over window + request rows + chosen
    e = _exp(lg - mx[None, :], PRECISE)  # <= 1
    fx = (e.to(tl.float64) * FX + 0.5).to(tl.int64)  # 64-bit fixed point: order-free integer sums
    tl.atomic_add(SUMS + r * GP + ar_g, tl.sum(fx, 0), mask=ar_g < G, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# update(): decay, then the weights of each token in order


@triton.jit
def _updating(REC, r, GP: tl.constexpr):
    """Whether row r's group updates the tables (some head is not bypassed)."""
    act = tl.load(REC + r * (N_REC * GP) + 2 * GP + tl.arange(0, GP))
    return tl.sum(act, 0) > 0


@triton.jit(do_not_specialize=["T", "N", "SC"])
def _decay_kernel(VERT, SLASH, REC, T, N, SC, s_vh, s_sh, gamma, GP: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    dec = gamma * 0 + 1.0
    for t in range(0, T):
        dec = tl.where(_updating(REC, kvh * T + t, GP), dec * gamma, dec)
    j = p * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(VERT + kvh * s_vh + j, mask=j < N)
    tl.store(VERT + kvh * s_vh + j, v * dec, mask=j < N)
    s = tl.load(SLASH + kvh * s_sh + j, mask=j < SC)
    tl.store(SLASH + kvh * s_sh + j, s * dec, mask=j < SC)


@triton.jit(do_not_specialize=["T", "t", "N", "NS", "W", "SC", "K"])
def _add_kernel(VERT, SLASH, POS, LC, WLOG, REC, SUMS, QPOS, T, t, N, NS, W, SC, K, s_vh, s_sh, gamma,
                G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr, IFX: tl.constexpr,
                PRECISE: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    r = kvh * T + t
    if _updating(REC, r, GP):
        later = gamma * 0 + 1.0  # gamma^(updating tokens after t)
        for u in range(t + 1, T):
            later = tl.where(_updating(REC, kvh * T + u, GP), later * gamma, later)
        coef = 0.5 * later
        kvh_, t_, qpos, w_lo = _row_coords(QPOS, r, T, N, NS, W)
        ar_g = tl.arange(0, GP)
        rec = REC + r * (N_REC * GP) + ar_g
        m_w = tl.load(rec)
        l_w = tl.load(rec + GP)
        act = tl.load(rec + 2 * GP)
        mx = tl.maximum(m_w, tl.load(rec + 3 * GP))
        z = l_w * _exp(m_w - mx, PRECISE) + (tl.load(SUMS + r * GP + ar_g).to(tl.float64) * IFX).to(tl.float32)
        z = tl.where(z > 0, z, 1.0)
        n_act = tl.maximum(tl.sum(act, 0), 1.0)
        slot = p * BLOCK + tl.arange(0, BLOCK)
        is_w = slot < W
        is_c = (slot >= W) & (slot < W + K)
        cs = tl.where(is_c, slot - W, 0)
        wpos = w_lo + slot
        cpos = tl.load(POS + r * K + cs, mask=is_c, other=-1).to(tl.int64)
        pos = tl.where(is_w, wpos, cpos)
        ok = (is_w & (wpos < N)) | (is_c & (cpos >= 0))
        lw = tl.load(WLOG + (r * W + slot)[:, None] * GP + ar_g[None, :], mask=is_w[:, None], other=float("-inf"))
        lc = tl.load(LC + (r * K + cs)[:, None] * GP + ar_g[None, :], mask=is_c[:, None], other=float("-inf"))
        lg = tl.where(is_w[:, None], lw, lc)
        att = _exp(lg - mx[None, :], PRECISE) / z[None, :]
        w = tl.sum(att * act[None, :], 1) / n_act * coef
        vp = VERT + kvh * s_vh + pos
        tl.store(vp, tl.load(vp, mask=ok) + w, mask=ok)
        off = qpos - pos
        oks = ok & (off < SC)
        sp = SLASH + kvh * s_sh + off
        tl.store(sp, tl.load(sp, mask=oks) + w, mask=oks)


# ---------------------------------------------------------------------------------------------
# Host side


def unsupported(q: torch.Tensor, kv) -> list[str]:
    """Reasons the fused search cannot run for this step (empty = fine); the planner keeps torch."""
    reasons = []
    if q.device.type != "cuda" and not interpreted():
        reasons.append("the fused LFPS search needs CUDA tensors (or TRITON_INTERPRET=1)")
    if kv.ctx_k.device != q.device or kv.loc_k.device != q.device:
        reasons.append("the fused LFPS search needs the context and request rows on the query's device "
                       "(offload mode plans on the host with torch)")
    if kv.ctx_k.stride(-1) != 1 or kv.loc_k.stride(-1) != 1:
        reasons.append("key rows must be contiguous along the head dimension")
    if kv.loc_k.shape[1] == 0:
        reasons.append("no request-local slots")
    if os.environ.get("CTXCACHE_FUSED_LFPS", "1") == "0":
        reasons.append("the fused LFPS search is switched off (CTXCACHE_FUSED_LFPS=0)")
    return reasons


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(max(x, 1)))


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs per row
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _chunks(n: int, rows: int, block: int, device, cfg: LfpsConfig) -> tuple[int, int]:
    """(chunk, programs per row) over n positions: chunks are whole tiles."""
    per_row = max(1, cfg.programs_per_sm * _sm_count(device) // max(rows, 1))
    chunk = _cdiv(_cdiv(max(n, 1), per_row), block) * block
    return chunk, _cdiv(max(n, 1), chunk)


def fixed_point_shift(k: int) -> int:
    """Scale 2^shift of the chosen rows' fixed-point sums: k terms <= 1 stay below 2^62."""
    return 62 - math.ceil(math.log2(k + 1))


def search(q, kv, vert, slash, *, mean_k, var_ratio, n_sink: int, window: int, local: int, lam: float,
           bypass: bool, threshold: float, width: int, k: int, cfg: LfpsConfig | None = None):
    """The one-token search of `_LFPSPlanner.search` (module docstring) for q [KVH, G, T, D] and the
    layer's tables vert [KVH, N], slash [KVH, SC] (fp32, read only). Returns (positions [KVH, T, K]
    int32, bypass [KVH, G, T] bool | None, rest_logit | None, sparsity | None, candidates
    [KVH, T, C] int32, stats [3] fp32, FusedUpdate)."""
    cfg = cfg or DEFAULT_CONFIG
    dev = q.device
    kvh, g, t, d = q.shape
    n, sc = vert.shape[1], slash.shape[1]
    ns = min(n_sink, n)
    m = kv.loc_k.shape[1]
    rows = kvh * t
    gp, dp = _pow2(g, 2), _pow2(d, 16)
    br = cfg.block
    precise = dev.type == "cuda"
    scale = d ** -0.5
    nw = cfg.num_warps
    q_pos = kv.q_pos
    ck, lk = kv.ctx_k, kv.loc_k
    q = q if q.stride(-1) == 1 else q.contiguous()

    # outputs (per call)
    sparsity = torch.empty(kvh, g, t, dtype=torch.float32, device=dev) if bypass else None
    byp = torch.empty(kvh, g, t, dtype=torch.uint8, device=dev) if bypass else None
    rest = torch.empty(kvh, g, t, dtype=torch.float32, device=dev) if bypass else None
    stats = torch.empty(3, dtype=torch.float32, device=dev)
    rec = torch.empty(rows, N_REC.value, gp, dtype=torch.float32, device=dev)
    sums = torch.empty(rows, gp, dtype=torch.int64, device=dev)
    wlog = torch.empty(rows, max(window, 1), gp, dtype=torch.float32, device=dev)
    lc = torch.empty(rows, k, gp, dtype=torch.float32, device=dev)

    # workspaces (consumed inside this call)
    p2 = _cdiv(max(n - ns, 1), cfg.block_moments)
    chunk, pc = _chunks(n, rows, br, dev, cfg)
    part = _WS.get(dev, "lfps.moments", rows * p2 * 16, torch.float64)
    fst = _WS.get(dev, "lfps.frame", rows * N_FRAME_STATS.value * gp, torch.float32)
    buf = _WS.get(dev, "lfps.scores", rows * n, torch.float32)
    flag = _WS.get(dev, "lfps.flags", rows * n, torch.int8)
    cnt = _WS.get(dev, "lfps.counts", rows * pc, torch.int32)
    logit = _WS.get(dev, "lfps.logits", rows * n * gp, torch.float32)
    dummy = stats  # unused pointers when bypass is off

    _moments_kernel[(p2, rows)](vert, slash, q_pos, part, t, n, ns, window, sc, vert.stride(0), slash.stride(0),
                                BLOCK=cfg.block_moments, num_warps=nw)
    _frame_candidates_kernel[(1 + pc, rows)](
        q, ck, lk, q_pos, mean_k if bypass else dummy, var_ratio if bypass else dummy,
        sparsity if bypass else dummy, byp if bypass else dummy, rest if bypass else dummy,
        fst, wlog, rec, sums, vert, slash, part, buf, flag, cnt,
        t, n, m, ns, window, local, sc, p2, chunk,
        q.stride(0), q.stride(1), q.stride(2), ck.stride(0), ck.stride(1), lk.stride(0), lk.stride(1),
        mean_k.stride(0) if bypass else 0, vert.stride(0), slash.stride(0), scale, threshold, lam,
        G=g, GP=gp, D=d, DP=dp, BR=16, BYPASS=bypass, PRECISE=precise, PP=_pow2(p2, 2), BLOCK=br, num_warps=nw)
    cand = topk_positions(buf.view(kvh, t, n), width)  # [KVH, T, C] int32
    mma = cfg.score_mma and ck.dtype == torch.bfloat16
    br_score, tiles = max(cfg.block_score, 16 if mma else 1), cfg.score_tiles
    ps = _cdiv(width, br_score * tiles)  # score programs per row
    k4p = _WS.get(dev, "lfps.states", rows * ps * 2 * gp, torch.float32)
    _score_kernel[(ps, rows)](
        q, ck, cand, logit, flag, k4p, t, n, width, q.stride(0), q.stride(1), q.stride(2), ck.stride(0),
        ck.stride(1), scale, G=g, GP=gp, D=d, DP=dp, BR=br_score, TILES=tiles, MMA=mma, NQ=_pow2(3 * gp, 16),
        NUM_STAGES=1 if interpreted() else cfg.score_stages, INTERPRETED=interpreted(), PRECISE=precise, num_warps=nw)
    _mass_kernel[(pc, rows)](flag, logit, k4p, fst, buf, cnt, rec, q_pos, stats, t, n, ns, window, rows, width,
                             chunk, ps, pc, G=g, GP=gp, BR=br, PP=min(_pow2(ps, 2), cfg.block_states),
                             RP=_pow2(rows, 2), CP=_pow2(pc, 2), BYPASS=bypass, PRECISE=precise, num_warps=nw)
    positions = topk_positions(buf.view(kvh, t, n), k)  # [KVH, T, K] int32
    grid_k = (_cdiv(k, cfg.block_k), rows)
    shift = fixed_point_shift(k)
    _chosen_max_kernel[grid_k](positions, logit, lc, rec, n, k, G=g, GP=gp, BLOCK=cfg.block_k, num_warps=nw)
    _chosen_sum_kernel[grid_k](lc, rec, sums, k, G=g, GP=gp, BLOCK=cfg.block_k, FX=float(2 ** shift),
                               PRECISE=precise, num_warps=nw)
    upd = FusedUpdate(positions, lc, wlog, rec, sums, q_pos, shift)
    return (positions, byp.view(torch.bool) if bypass else None, rest, sparsity, cand, stats, upd)


def apply_update(vert: torch.Tensor, slash: torch.Tensor, u: FusedUpdate, *, gamma: float, n_sink: int, window: int,
                 cfg: LfpsConfig | None = None) -> None:
    """Commit a fused plan's table update in place (module docstring): decay, then each token's
    weights in order (one launch per token, so no address has two writers in a launch)."""
    cfg = cfg or DEFAULT_CONFIG
    kvh, t, k = u.positions.shape
    n, sc = vert.shape[1], slash.shape[1]
    ns = min(n_sink, n)
    gp = u.rec.shape[-1]
    g = gp  # padded heads carry act = 0: they add nothing
    nw = cfg.num_warps
    precise = vert.device.type == "cuda"
    _decay_kernel[(_cdiv(max(n, sc), cfg.block_decay), kvh)](vert, slash, u.rec, t, n, sc, vert.stride(0),
                                                             slash.stride(0), gamma, GP=gp, BLOCK=cfg.block_decay,
                                                             num_warps=nw)
    for i in range(t):
        _add_kernel[(_cdiv(window + k, cfg.block_k), kvh)](
            vert, slash, u.positions, u.chosen_logits, u.window_logits, u.rec, u.sums, u.q_pos, t, i, n, ns,
            window, sc, k, vert.stride(0), slash.stride(0), gamma, G=g, GP=gp, BLOCK=cfg.block_k,
            IFX=float(2.0 ** -u.shift), PRECISE=precise, num_warps=nw)


__all__ = ["DEFAULT_CONFIG", "FusedUpdate", "LfpsConfig", "apply_update", "fixed_point_shift", "search", "unsupported"]
