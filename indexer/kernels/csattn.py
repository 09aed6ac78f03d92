"""csattn's decode search (`indexer/csattn.py`, `search`) as three Triton launches plus the fused
top-K select (`indexer/kernels/select.py`). The torch `search` stays the reference and the CPU path;
the planner dispatches here for CUDA tensors (or when a test sets `planner.fused = True`: the kernels
then run through Triton's interpreter on CPU tensors). Same arguments, same result: [KVH, T, K]
int32 context positions, -1 = empty.

What one search computes (KVH kv heads, G query heads each, T query tokens, m subspaces of ds dims,
C centroids, Lk entries per list, N context tokens; G' = 1 for pooling="sum", G for "per_head";
tau' = min(tau, C) with backoff, else 1; L = G'·m·tau' lists per row, a row = (kv head, token)):

    per (row, g', b): the unit (pooled) sub-query, its cosine to the C centroids of subspace b, the
        top-tau' centroids (backoff: the 2nd.. only when the best cosine < backoff) and the list
        weights wl = w_b · lw (module docstring of indexer/csattn.py)          [KVH, T, L]
    per (row, key): score = sum over the row's used lists that hold the key of wl · (s - s_min)
        (s_min = the list's last score for missing_score="list_min", 0 for "zero"); -inf for a key in
        no used list and for positions the plan may not select (sink, window)    [KVH, T, N] fp32
    plan = the top-K of each row (`topk_positions`)                               [KVH, T, K]

Kernels (grids from shapes only; per chunk of query tokens, see below):

1. `_choose_kernel`, grid (G'·m, t, KVH): one program per (g', subspace b, token, kv head) loads the
   pooled heads' ds-slice of the query, normalises it (sum pooling: sum of unit sub-queries,
   normalised again; w = the heads' mean norm), takes the cosine to the C centroids of subspace b
   ([C, ds] fp16), the top-tau' (lowest centroid id first among equal cosines) and writes per list:
   centroid id (-1 = not used), wl, s_min, and `bound` = the largest |wl · (s - s_min)| over the list
   (from its first and last scores: the lists are sorted descending). ~3 KB read per program.
2. `_accumulate_kernel`, grid (ceil(Lk / BLOCK), L, rows): each program takes BLOCK entries of one
   chosen list straight from the persisted `idx` / `score` tables (no gathered copy; a program of an
   unused list returns at once) and adds, per entry, fixed(wl · (s - s_min)) + 2^(F+1) to the key's
   int64 cell of the row's accumulator [rows, N]: one relaxed `atomic_add` per entry, integer, so
   exact and independent of the order in which programs and entries arrive.
3. `_finalize_kernel`, grid (ceil(N / BLOCK_N), rows): decodes every cell (count of lists, fixed-point
   sum), writes the fp32 score (-inf where no list touched the key or the frame owns the position:
   `indexer.selection.selectable_mask`) and zeroes the cell for the next search.
4. `topk_positions` over the fp32 scores (4 launches of the radix select).

Fixed point (the int64 cells). Per row, the exponent e = F - LB - E with LB = ceil(log2 L) (host
int, >= 1), F = 60 - LB, and E the binary exponent bound of the row's largest list bound (max over
the L `bound`s, an exact, order-free reduction that every consumer program repeats on the same
stored values, so the accumulate and the finalize agree on e: bound_max < 2^E, read from the
float's exponent bits); e is clamped to [-126, 126] so 2^e and 2^-e are normal fp32 numbers. An
entry adds trunc(term · 2^e) + 2^(F+1), term = wl · (s - s_min) in fp32 (the torch path's product,
bit for bit when wl is). Why nothing overflows: a key is in a list at most once (a list is a top-Lk
over distinct keys, as `build_layer` makes it), so its fixed-point sum S obeys |S| <= (sum of the L
bounds) · 2^e < L · 2^E · 2^e <= 2^F (|term| <= bound: the first and last scores bound every score
of a sorted list, and fp32 rounding is monotone), and the cell holds v = S + c · 2^(F+1) with c <= L
lists holding the key, so |v| < 2^(LB + F + 1) + 2^F < 2^62. Decoding: c = (v + 2^F) >> (F + 1),
S = v - c · 2^(F+1), exact; a key no list touched is the only one with v == 0 (c >= 1 makes v >
2^F), so the "touched" marker costs nothing and the zero state is also the untouched one.
Resolution: one unit is 2^-e = 2^(E + LB - F) < 2^(2·LB - 59) · bound_max (2^-51 of the row's
largest list bound at L = 16; the scaling by 2^e is exact, truncation loses < 1 unit per entry),
so S · 2^-e is the exact sum of the fp32 terms to ~1e-14 of the row's scale, then rounded once to
fp32 (round to nearest) for the select. That rounding is monotone, so it cannot invert an order:
a key with a larger exact sum never gets a smaller fp32 score (it can only merge two sums closer
than an fp32 ulp into a tie).

What may differ from the torch path: torch sums the same fp32 terms in fp32 in its own order (CUDA's
scatter_reduce in an order that changes run to run), ~1e-7 relative; the kernels' sums are exact
before one rounding, so scores agree to ~1e-7 relative and a selection differs only where two keys
are that close at the K-th place. The centroid choice repeats torch's formulas in fp32 (norms,
cosines: other summation orders, ~1 ulp): it differs only where two cosines are within ~1e-7 at the
tau'-th place, or the best cosine is that close to `backoff`. Ties: among equal cosines the lowest
centroid id is taken (torch.topk's rule on CUDA; on the CPU its order is unspecified); keys whose
exact sums are equal get the same score, and ties at the K-th score are broken by `topk_positions`
(the kernels: lowest position first; torch.topk on the torch path: its own pick). The scores are
deterministic bit for bit run to run, and so is the plan row, order included: the select writes
positions in index order (before 2026-11-28 its atomic counters picked among keys tied at the K-th
score and ordered the row by the programs' arrival, so a GPU's rows changed from run to run; benchmarks/
RESULTS.md, "Reproducible plans"). Such ties are real with the paper's scoring (uniform weights,
missing score 0: a key's score is a sum of a few fp16 values), rare with the defaults. Rows list
positions in the select's order (-1 last) on both paths, torch's its own: compare them as sets.

Chunks: the accumulator [KVH, t, N] int64 and the scores [KVH, t, N] fp32 are workspaces of t =
min(T, `scores_per_chunk` // (KVH · N)) query tokens (>= 1): 16M cells by default, 192 MiB at most
(a 128K context, 8 kv heads: 16 tokens per chunk); a long question chunk loops over them as the torch
path does (7 launches each). A decode step (T = 1) at 128K: 8 MiB + 4 MiB.

Bytes and time per layer and step at the 8B shape (KVH 8, G 4, D 128, m 8, ds 16, C 64, tau 2,
N = 128K, Lk = 26214, K = 6554, T = 1: 8 rows of L = 16 lists, ~9 of them used: every subspace's
best list plus a backed-off second where the best cosine is < 0.7):

| launch (programs) | reads | writes | estimate |
|---|---|---|---|
| choose (8 x 8) | q 8 KB, centroids 8 x 8 x 2 KB = 128 KB | 2 KB of list records | ~2-3 us |
| accumulate (26 x 16 x 8, ~half idle) | ~72 lists x 26K x 6 B = 11 MB | 1.9M int64 REDs into 8 MiB (L2) | ~10-20 us |
| finalize (128 x 8) | 8 MiB accumulator (L2) | 4 MiB scores, 8 MiB zeros | ~4-6 us |
| topk_positions (4 launches) | 4 MiB scores x 4 (L2 after the first) | 210 KB plan | ~20-26 us |

The accumulation is bound by the L2's atomic rate rather than by its 11 MB of list reads (3.5 us at
3 TB/s): 1.9M fire-and-forget 8-byte reductions (REDG.E.ADD.64 in the SASS: the result is unused) to
distinct, random addresses, one L2 sector operation each (~100-200 G/s: ~10-20 us). Keys repeat
only across lists, so there is no contention. Expected plan: ~40-55 us in a CUDA graph (7
dependent launches, ~2 us of each is launch latency), against ~190 us for the torch plan (the gather
of the lists and the scatter_reduce_ ~165 us, then the mask and the select; 0.400 ms with the
attention, dense SDPA 0.217 ms).

Checked without a GPU (Triton 3.6, ahead-of-time compile for sm_90a at the 8B shape, default knobs,
ptxas -v): registers per thread: choose 56 (2 warps, both poolings), accumulate 40 (4 warps),
finalize 32 (4 warps); no spills. The list loads are scalar (Lk = 26214 is not a multiple of 16,
so the rows of `idx` / `score` are not 16-byte aligned): 16 loads per thread per program, cheap
next to its 8 REDs.

Measured per kernel and end to end, and the fused plan's agreement with the torch plan: benchmarks/RESULTS.md, "Fused searches (issue 12) and the batched runner".

Workspaces (grow-only, per device, stream and purpose): `_WORKSPACES` holds the list records and
the fp32 scores, written before they are read in every search (tests poison them); `_ACCUMULATORS`
holds the int64 accumulator, zeroed when allocated and left zeroed by every finalize (a search that
fails between its accumulate and finalize launches zeroes it before re-raising). Every launch size
is a host int from shapes: no host sync, CUDA-graph capturable (stream order makes reuse safe; a
graph captured on a side stream gets its own workspaces; two graphs captured on one stream must not
be replayed concurrently on different streams). The plan is allocated per call.

`CTXCACHE_FUSED_CSATTN=0` in the environment keeps the planner on its torch path (A/B runs);
`planner.fused = False` does it for one planner.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import Workspaces, interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4
from indexer.kernels.select import topk_positions

ENV_FLAG = "CTXCACHE_FUSED_CSATTN"  # "0": the planner keeps its torch path
MAX_CENTROID_TILE = 1 << 14  # next_pow2(C) x next_pow2(ds) cosines per choose program (C 1024 at ds 16)
MAX_ROWS = 65535  # KVH x tokens per chunk: CUDA's grid.z / grid.y limit


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _pow2(e):
    """2^e as fp32 for an int32 e in [-126, 127], built from its bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _row_exponent(BND, n_lists, F: tl.constexpr, LB: tl.constexpr, BLOCK_L: tl.constexpr):
    """e for one row: F - LB - E, where bound_max < 2^E (E from the exponent bits of the largest of
    the row's n_lists bounds, which are >= 0), clamped to [-126, 126]. max is exact and order-free:
    every program that calls this on the same stored bounds gets the same e."""
    ar = tl.arange(0, BLOCK_L)
    bmax = tl.zeros([BLOCK_L], tl.float32)
    for l0 in range(0, n_lists, BLOCK_L):
        o = l0 + ar
        bmax = tl.maximum(bmax, tl.load(BND + o, mask=o < n_lists, other=0.0))
    big = tl.max(bmax, 0)
    e_bound = ((big.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # big < 2^e_bound (also for 0, subnormals)
    return tl.minimum(tl.maximum(F - LB - e_bound, -126), 126)


@triton.jit(do_not_specialize=["t0", "tc"])
def _choose_kernel(
    Q, CENT, SCORE, CID, WL, SMIN, BND,
    sq_h, sq_g, sq_t, sc_h, sc_b, sc_c, ss_h, ss_b, ss_c, ss_l,
    t0, tc, g, m, c, ds, lk, backoff,
    SUM: tl.constexpr, TAU: tl.constexpr, TAU_PAD: tl.constexpr, BACKOFF: tl.constexpr,
    QUERY_NORM: tl.constexpr, LIST_MIN: tl.constexpr,
    G_PAD: tl.constexpr, C_PAD: tl.constexpr, DS_PAD: tl.constexpr,
):
    pid = tl.program_id(0)  # g' * m + b
    tt = tl.program_id(1)  # token within the chunk
    h = tl.program_id(2).to(tl.int64)
    gp = pid // m
    b = pid % m
    ar_g = tl.arange(0, G_PAD)
    ar_d = tl.arange(0, DS_PAD)
    ar_c = tl.arange(0, C_PAD)
    ok_d = ar_d < ds
    if SUM:
        heads = ar_g < g
    else:
        heads = ar_g == gp
    x = tl.load(Q + h * sq_h + ar_g[:, None] * sq_g + (t0 + tt) * sq_t + b * ds + ar_d[None, :],
                mask=heads[:, None] & ok_d[None, :], other=0.0).to(tl.float32)  # [G_PAD, DS_PAD]
    qn = tl.sqrt(tl.sum(x * x, 1))  # [G_PAD] |q_g^(b)|
    qt = x / tl.maximum(qn, 1e-12)[:, None]
    u = tl.sum(qt, 0)  # [DS_PAD]: the sum of the pooled unit sub-queries (per_head: the head's own)
    if SUM:
        u = u / tl.maximum(tl.sqrt(tl.sum(u * u, 0)), 1e-12)
        w = tl.sum(qn, 0) / g
    else:
        w = tl.sum(qn, 0)
    if not QUERY_NORM:
        w = w * 0.0 + 1.0
    cent = tl.load(CENT + h * sc_h + b * sc_b + ar_c[:, None] * sc_c + ar_d[None, :],
                   mask=(ar_c < c)[:, None] & ok_d[None, :], other=0.0).to(tl.float32)  # [C_PAD, DS_PAD]
    cos = tl.sum(cent * u[None, :], 1)
    cos = tl.where(ar_c < c, cos, float("-inf"))

    # top-TAU, best first, lowest centroid id among equal cosines
    ar_j = tl.arange(0, TAU_PAD)
    top_v = tl.zeros([TAU_PAD], tl.float32)
    top_i = tl.zeros([TAU_PAD], tl.int32)
    for j in tl.static_range(TAU):
        best = tl.max(cos, 0)
        at = tl.min(tl.where(cos == best, ar_c, C_PAD), 0)
        top_v = tl.where(ar_j == j, best, top_v)
        top_i = tl.where(ar_j == j, at, top_i)
        cos = tl.where(ar_c == at, float("-inf"), cos)
    use = ar_j == 0
    if BACKOFF:  # the best cosine, broadcast over the TAU slots, below the threshold: use them all
        first = tl.zeros([TAU_PAD], tl.float32) + tl.sum(tl.where(ar_j == 0, top_v, 0.0), 0)
        use = (ar_j < TAU) & ((ar_j == 0) | (first < backoff))
    lw = tl.where(use, tl.maximum(top_v, 1e-6), 0.0)
    lw = lw / tl.sum(lw, 0)
    wl = w * lw

    # the list's first and last scores bound its terms (lists are sorted descending)
    sbase = SCORE + h * ss_h + b * ss_b + top_i.to(tl.int64) * ss_c
    s_first = tl.load(sbase, mask=use, other=0.0).to(tl.float32)
    s_last = tl.load(sbase + (lk - 1) * ss_l, mask=use, other=0.0).to(tl.float32)
    if LIST_MIN:
        smin = s_last
        bound = (s_first - s_last) * wl
    else:
        smin = s_last * 0.0
        bound = tl.maximum(tl.abs(s_first), tl.abs(s_last)) * wl
    n_lists = tl.num_programs(0) * TAU
    at = ((h * tc + tt) * n_lists + pid * TAU) + ar_j
    keep = ar_j < TAU
    tl.store(CID + at, tl.where(use, top_i, -1), mask=keep)
    tl.store(WL + at, wl, mask=keep)
    tl.store(SMIN + at, smin, mask=keep)
    tl.store(BND + at, tl.where(use, bound, 0.0), mask=keep)


@triton.jit(do_not_specialize=["tc"])
def _accumulate_kernel(
    IDX, SCORE, CID, WL, SMIN, BND, ACC,
    si_h, si_b, si_c, si_l, ss_h, ss_b, ss_c, ss_l,
    tc, m, n_lists, lk, n_ctx,
    TAU: tl.constexpr, F: tl.constexpr, LB: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK: tl.constexpr,
):
    blk = tl.program_id(0)
    lst = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)  # kv head * tc + token
    rec = r * n_lists + lst
    cid = tl.load(CID + rec)
    if cid >= 0:  # a list the row uses (the others: nothing to do)
        h = r // tc
        b = (lst // TAU) % m
        wl = tl.load(WL + rec)
        smin = tl.load(SMIN + rec)
        e = _row_exponent(BND + r * n_lists, n_lists, F, LB, BLOCK_L)
        scale = _pow2(e)
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        ok = offs < lk
        key = tl.load(IDX + h * si_h + b * si_b + cid.to(tl.int64) * si_c + offs * si_l, mask=ok, other=-1)
        s = tl.load(SCORE + h * ss_h + b * ss_b + cid.to(tl.int64) * ss_c + offs * ss_l, mask=ok, other=0.0)
        term = (s.to(tl.float32) - smin) * wl  # the torch path's fp32 term
        fx = (term * scale).to(tl.int64) + (1 << (F + 1))  # exact scaling, truncation < 1 unit
        ok = ok & (key >= 0) & (key < n_ctx)
        tl.atomic_add(ACC + r * n_ctx + key, fx, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["t0", "tc", "n_ctx", "s_end", "window"])
def _finalize_kernel(
    ACC, OUT, BND, Q_POS,
    t0, tc, n_lists, n_ctx, s_end, window,
    F: tl.constexpr, LB: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK: tl.constexpr,
):
    blk = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    tt = r % tc
    e = _row_exponent(BND + r * n_lists, n_lists, F, LB, BLOCK_L)
    inv = _pow2(-e)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_ctx
    cell = ACC + r * n_ctx + offs
    v = tl.load(cell, mask=ok, other=0)
    cnt = (v + (1 << F)) >> (F + 1)  # lists that hold the key
    fixed = v - (cnt << (F + 1))  # |fixed| < 2^F
    score = fixed.to(tl.float32) * inv
    qp = tl.load(Q_POS + t0 + tt).to(tl.int64)
    w_lo = tl.minimum(tl.maximum(qp - window + 1, s_end), n_ctx)  # indexer.base.frame_bounds
    sel = (v != 0) & (offs >= s_end) & (offs < w_lo)
    tl.store(OUT + r * n_ctx + offs, tl.where(sel, score, float("-inf")), mask=ok)
    tl.store(cell, tl.zeros([BLOCK], tl.int64), mask=ok)  # clean for the next search


# ---------------------------------------------------------------------------------------------
# Launch configuration and workspaces (host ints from shapes only)


@dataclass(frozen=True)
class CsattnConfig:
    """Tuning knobs (defaults reasoned, not swept on a GPU; see the module docstring)."""

    block: int = 1024  # accumulate: list entries per program
    warps: int = 4
    block_n: int = 1024  # finalize: context positions per program
    finalize_warps: int = 4
    scores_per_chunk: int = 1 << 24  # accumulator cells per chunk of query tokens (int64 + fp32: 192 MiB)


DEFAULT_CONFIG = CsattnConfig()

_WORKSPACES = Workspaces()  # written before read by every search (list records, fp32 scores)
_ACCUMULATORS = Workspaces()  # int64 accumulators: zero between searches (finalize cleans up)


def clear_workspace() -> None:
    _WORKSPACES.clear()
    _ACCUMULATORS.clear()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unsupported(q: torch.Tensor, cent: torch.Tensor) -> list[str]:
    """Reasons the fused search cannot run (empty = fine); the planner then keeps the torch path."""
    reasons = []
    c, ds = cent.shape[2], cent.shape[3]
    if triton.next_power_of_2(c) * triton.next_power_of_2(ds) > MAX_CENTROID_TILE:
        reasons.append(f"{c} centroids of {ds} dims exceed the fused choose kernel's tile ({MAX_CENTROID_TILE})")
    if q.device.type != "cuda" and not interpreted():
        reasons.append("the fused csattn search needs CUDA tensors (or TRITON_INTERPRET=1)")
    if os.environ.get(ENV_FLAG, "1") == "0":
        reasons.append(f"the fused csattn search is switched off ({ENV_FLAG}=0)")
    return reasons


def fixed_point_bits(n_lists: int) -> tuple[int, int]:
    """(F, LB) for a row of n_lists lists: LB = ceil(log2 n_lists) (>= 1), F = 60 - LB (docstring)."""
    lb = max(1, math.ceil(math.log2(max(n_lists, 2))))
    return 60 - lb, lb


def _chunk_tokens(t: int, kvh: int, n_ctx: int, cfg: CsattnConfig) -> int:
    return max(1, min(t, cfg.scores_per_chunk // max(1, kvh * n_ctx), MAX_ROWS // kvh))


# ---------------------------------------------------------------------------------------------
# Torch-facing functions


def _launch_chunk(cent, idx, score, q, q_pos, t0: int, tc: int, n_ctx: int, params, sink: int, window: int,
                  cfg: CsattnConfig) -> torch.Tensor:
    """Kernels 1-3 for query tokens [t0, t0 + tc) -> fp32 scores [KVH, tc, N] (a workspace view)."""
    kvh, g, _, d = q.shape
    m, c, ds = cent.shape[1], cent.shape[2], cent.shape[3]
    lk = idx.shape[-1]
    dev = q.device
    gp = 1 if params.pooling == "sum" else g
    backoff = params.backoff is not None
    tau = min(params.tau, c) if backoff else 1
    n_lists = gp * m * tau
    rows = kvh * tc
    f_bits, lb = fixed_point_bits(n_lists)
    block_l = min(1024, triton.next_power_of_2(n_lists))

    recs = _WORKSPACES.get(dev, "lists", 3 * rows * n_lists, torch.float32)
    wl, smin, bnd = recs[: rows * n_lists], recs[rows * n_lists: 2 * rows * n_lists], recs[2 * rows * n_lists:]
    cid = _WORKSPACES.get(dev, "lists", rows * n_lists, torch.int32)
    out = _WORKSPACES.get(dev, "scores", rows * n_ctx, torch.float32)
    acc = _ACCUMULATORS.get(dev, "acc", rows * n_ctx, torch.int64, zero=True)

    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernels read q and cent rows with unit stride
    cent = cent if cent.stride(-1) == 1 else cent.contiguous()
    c_pad, ds_pad = triton.next_power_of_2(c), triton.next_power_of_2(ds)
    _choose_kernel[(gp * m, tc, kvh)](
        q, cent, score, cid, wl, smin, bnd,
        q.stride(0), q.stride(1), q.stride(2), cent.stride(0), cent.stride(1), cent.stride(2),
        score.stride(0), score.stride(1), score.stride(2), score.stride(3),
        t0, tc, g, m, c, ds, lk, float(params.backoff) if backoff else 0.0,
        SUM=params.pooling == "sum", TAU=tau, TAU_PAD=triton.next_power_of_2(tau), BACKOFF=backoff and tau > 1,
        QUERY_NORM=params.subspace_weights == "query_norm", LIST_MIN=params.missing_score == "list_min",
        G_PAD=triton.next_power_of_2(g), C_PAD=c_pad, DS_PAD=ds_pad, num_warps=4 if c_pad * ds_pad > 4096 else 2,
    )
    try:
        _accumulate_kernel[(_cdiv(lk, cfg.block), n_lists, rows)](
            idx, score, cid, wl, smin, bnd, acc,
            idx.stride(0), idx.stride(1), idx.stride(2), idx.stride(3),
            score.stride(0), score.stride(1), score.stride(2), score.stride(3),
            tc, m, n_lists, lk, n_ctx,
            TAU=tau, F=f_bits, LB=lb, BLOCK_L=block_l, BLOCK=cfg.block, num_warps=cfg.warps,
        )
        _finalize_kernel[(_cdiv(n_ctx, cfg.block_n), rows)](
            acc, out, bnd, q_pos, t0, tc, n_lists, n_ctx, min(sink, n_ctx), window,
            F=f_bits, LB=lb, BLOCK_L=block_l, BLOCK=cfg.block_n, num_warps=cfg.finalize_warps,
        )
    except BaseException:
        acc.zero_()  # a search interrupted between the two launches must not leave sums behind
        raise
    return out.view(kvh, tc, n_ctx)


def scores(cent, idx, score, q, q_pos, n_ctx: int, params, sink: int, window: int,
           cfg: CsattnConfig | None = None) -> torch.Tensor:
    """The fp32 score buffer [KVH, T, N] the select runs on (a copy; tests and benchmarks): the
    torch path's dense buffer after its mask, to ~1e-7 relative (module docstring)."""
    cfg = cfg or DEFAULT_CONFIG
    kvh, _, t, _ = q.shape
    step = _chunk_tokens(t, kvh, n_ctx, cfg)
    return torch.cat([_launch_chunk(cent, idx, score, q, q_pos, t0, min(step, t - t0), n_ctx, params, sink,
                                    window, cfg).clone() for t0 in range(0, t, step)], dim=1)


def search(cent, idx, score, q, q_pos, n_ctx: int, k: int, params, sink: int, window: int,
           cfg: CsattnConfig | None = None) -> torch.Tensor:
    """`indexer.csattn.search` in 3 launches + the fused select per chunk of query tokens.

    cent [KVH, m, C, ds] fp16; idx / score [KVH, m, C, Lk] int32 / fp16 (each list sorted by score,
    descending); q [KVH, G, T, D]; q_pos [T] -> [KVH, T, k] int32 context positions, -1 = empty."""
    cfg = cfg or DEFAULT_CONFIG
    kvh, _, t, _ = q.shape
    step = _chunk_tokens(t, kvh, n_ctx, cfg)
    out = []
    for t0 in range(0, t, step):  # host ints only: T is the query's shape
        tc = min(step, t - t0)
        out.append(topk_positions(_launch_chunk(cent, idx, score, q, q_pos, t0, tc, n_ctx, params, sink, window,
                                                cfg), k))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


__all__ = ["CsattnConfig", "DEFAULT_CONFIG", "ENV_FLAG", "clear_workspace", "fixed_point_bits", "scores", "search",
           "unsupported"]
