"""SAAP's decode-time plan in four Triton launches (`indexer/saap.py` dispatches here for CUDA
tensors; its torch path is the reference and the CPU path).

Long because a method's kernels stay together: SAAP's four plan launches share their wrappers,
their configuration and the cost model below.

What one plan computes, for one layer (KVH KV heads, G query heads each, T query tokens; C key
buckets, f_q with Hd hidden units, ℓ = nprobe, the plan width K = `selection.probe_width`):

    q' = undo_rope(q, q_pos)                                   de-RoPE'd queries [KVH, G, T, D]
    logits = w2 · relu(scale ⊙ (w1 · q') + shift) + b2 + cs · (centroids · q')     [KVH, G, T, C]
             (probe="centroid": centroids · q' / sqrt(D))
    score = Σ_g softmax_C(logits)                              [KVH, T, C]
    probe = the ℓ best buckets, best first                     [KVH, T, ℓ]
    plan  = their keys (CSR `order`/`offsets`) in probe order, a row of fixed width K, keys inside
            the frame (sink, window) and the padding = -1       [KVH, T, K] int32
    + the selectivity record of the step (the planner's [step, layer] table)

Kernels (grids from shapes only; no host sync; the workspaces are grow-only, per device and stream):

1. `_hidden_kernel`, grid (Hd / BH, rows / BM, KVH): de-RoPE of the group's query rows (the cos/sin
   rows of the request's positions are gathered from a table made once per request), then
   h = relu(scale ⊙ (w1 · q') + shift) for BH hidden units. Rows = the (g, t) pairs of one KV head,
   BM per program. Writes h [KVH, G·T, Hd] fp32. (Not launched for probe="centroid".)
2. `_logits_kernel`, grid (C / BC, rows / BM, KVH): for BC buckets, w2 · h + b2 + cs · (c · q')
   (the centroid term de-RoPEs the rows again: 2 KB of loads). fp32 FMAs on the weights read in
   their storage dtype (bf16 by default): a GEMV is bound by the weight bytes, not by math.
   Products go into one [BM, BC, BK] accumulator (the centroid term's first, then w2 · h's),
   reduced once at the end; the w2 tiles stream through shared memory (cp.async, pipelined).
   Writes the logits [KVH, G·T, C] fp32.
3. `_rank_kernel`, grid (C / BR, T, KVH): softmax statistics of every query head's row (max and
   sum over C, one online pass), score = Σ_g exp(l_g - m_g) / s_g, and for BR buckets their rank
   among all C (how many buckets precede it in the order score descending, bucket id ascending)
   and the total size of the buckets that precede it, both from one pass of BR × C compares. The
   buckets of rank < ℓ write themselves to slot `rank` of the probe table: id, end (inclusive
   prefix of the sizes: where the bucket's keys end in the plan row), shift (its start in `order`
   minus its start in the row) and size. A sort-free top-ℓ with the prefix sum for free. Every
   program derives the scores of all C buckets itself, so they must agree to the bit or the ranks
   would not be a permutation: the group sum is taken in fixed point (each probability rounded
   down to a multiple of 2^-56 on its own, then an exact int64 sum), independent of the order of
   summation. The price of the redundancy: each program reads its rows' logits twice from L2
   (G·C·4 B each time; 8 MiB of L2 reads per plan at the 8B shape with BR = 32).
4. `_expand_kernel`, grid (K / BLOCK, T, KVH): slot j of a plan row belongs to the first probed
   bucket whose end exceeds j (binary search over the ℓ ends); it copies order[shift + j], masks
   keys inside the frame (`indexer.base.frame_bounds`) and fills the tail (j >= the row's total)
   with -1; the first program of a row writes that total (at most K) as the plan's `lengths`, so
   the attention divides only the filled slots over its programs (~25% of K at 128K). Each program stores its count of planned keys; the last one to finish (a ticket taken
   with an acq_rel atomic after a CTA barrier; `_rank_kernel` resets it) reads the counts back
   (volatile loads), and writes the step's selectivity record, as the torch path's `_record`.

Bytes per plan (8B shape: KVH 8, G 4, T 1, D 128, C 1024, Hd 1024, ℓ 32, N = 128K; K ≈ 4-20K):

| what | bf16 weights | fp32 weights |
|---|---|---|
| w2 [KVH, C, Hd] | 16.0 MiB | 32.0 MiB |
| w1 [KVH, Hd, D] + centroids [KVH, C, D] | 2 + 2 MiB | 4 + 4 MiB |
| scale, shift, b2, q, cos/sin rows | 0.1 MiB | 0.1 MiB |
| h, logits: written once, read from L2 | 0.25 MiB | 0.25 MiB |
| `order` slices read, plan rows written: 8 x K x 4 B each | 0.1-0.6 MiB | 0.1-0.6 MiB |
| total (DRAM) | ~20.5 MiB: 6.4 µs at 3.35 TB/s | ~40.5 MiB: 12.7 µs |

Flops: 2·KVH·G·T·(Hd·D + C·Hd + C·D) = 84 Mflop of fp32 FMA (~1.3 µs of the H100's CUDA cores if
spread, overlapping the weight reads); the ranks 8·C² = 8.4 M compares. Four dependent launches
add their latency (~2 µs each in a CUDA graph), so expect ~12-15 µs per plan at 128K with bf16
weights, against ~0.22 ms for the torch path (~90 kernels). The weight bytes do not depend on N;
only the plan row does (K grows with N). A question step (T = 32) multiplies the FMAs by 32 and
re-reads w2 once per block of BM = 16 rows (from L2 where it fits).

Compiled offline for sm_90 (Triton 3.6 and its ptxas, specialised as a launch at the 8B shape is;
no GPU run yet), registers per thread at the defaults: `_hidden_kernel` 80, `_logits_kernel` 96
(5 CTAs of 4 warps per SM: the 512 programs run in one wave), `_rank_kernel` 110,
`_expand_kernel` 40; no spills, also for every variant benchmarks/gpu_saap_plan.py --sweep tries.

Precision and ties (what may differ from the torch path):
* weights: the kernels read the classifier's matrices (w1, w2, centroids) in the dtype they are
  given; the planner gives bf16 (cast once per process and device, round-to-nearest: each weight
  moves by at most 2^-9 of itself). With weights rounded the same way, the kernels compute what
  the torch path computes up to fp32 summation order (~1e-6 relative on the logits) and the
  approximate exp of softmax (~2^-22): the top-ℓ is the same unless two buckets' scores tie at
  that level (the fixed-point group sum adds at most G·2^-56). Against the fp32 weights, bf16
  moves a logit by at most 2^-9 · (|w2|·|h| + |w2|·(scale ⊙ |w1|·|q'|) + cs·|c|·|q'|) to first
  order, in practice ~0.1 of that (random signs; tests/test_kernels_saap.py): a bucket at the
  edge of the top-ℓ may swap with a near-tie of that size.
* ties: buckets of equal score are ranked by bucket id, lowest first (torch.topk leaves the order
  of ties unspecified); a NaN probability counts as 0.
* the de-RoPE reads cos/sin rows of the request's positions from a table made at open with
  `indexer.rope.rope_cos_sin` (float64 angles, rounded to fp32): the same numbers the torch path
  computes per call. A query position outside [n_ctx, n_ctx + max_local) is clamped into it
  (`DecodeContext.max_local` bounds a request's tokens).
* the probed buckets' order is the score order, as `torch.topk(sorted=True)`, so the plan row is
  the torch path's slot for slot (`selection.expand_clusters` + `selectable`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import Workspaces, interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_GROUP = 64


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _query_rows(QPOS, sq_h, sq_g, sq_t, h, rb, T, n_ctx, n_rope, G: tl.constexpr, BM: tl.constexpr):
    """The block's query rows of KV head h: row r = (g, t) = (r // T, r % T); their offsets in q and
    their rows in the cos/sin table (position - n_ctx, clamped into the table)."""
    r = rb * BM + tl.arange(0, BM)
    r_ok = r < G * T
    g = r // T
    t = r % T
    q_row = h * sq_h + g.to(tl.int64) * sq_g + t.to(tl.int64) * sq_t
    pos = tl.load(QPOS + t, mask=r_ok, other=0).to(tl.int64)
    tpos = tl.minimum(tl.maximum(pos - n_ctx, 0), n_rope - 1)
    return r, r_ok, q_row, tpos


@triton.jit
def _derope_chunk(Q, COS, SIN, q_row, tpos, r_ok, d0: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """[BM, BD] fp32: columns d0 .. d0 + BD of the de-RoPE'd rows (0 from D on), x·cos -
    rotate_half(x)·sin (`indexer.rope.undo_rope`; rotate_half(x)[d] = -x[d + D/2] below D/2,
    x[d - D/2] above)."""
    d = d0 + tl.arange(0, BD)
    d_ok = d < D
    half = D // 2
    dp = (d + half) % D
    msk = r_ok[:, None] & d_ok[None, :]
    x = tl.load(Q + q_row[:, None] + d[None, :], mask=msk, other=0.0).to(tl.float32)
    xp = tl.load(Q + q_row[:, None] + dp[None, :], mask=msk, other=0.0).to(tl.float32)
    c = tl.load(COS + tpos[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0)
    s = tl.load(SIN + tpos[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0)
    rot = tl.where(d[None, :] < half, -xp, xp)
    return x * c - rot * s


@triton.jit(do_not_specialize=["T", "n_ctx", "n_rope"])
def _hidden_kernel(
    Q, QPOS, COS, SIN, W1, SCALE, SHIFT, HID,
    sq_h, sq_g, sq_t,  # q [KVH, G, T, D]
    T, n_ctx, n_rope, HD,
    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
):
    hb = tl.program_id(0)
    rb = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    r, r_ok, q_row, tpos = _query_rows(QPOS, sq_h, sq_g, sq_t, h, rb, T, n_ctx, n_rope, G, BM)
    k = hb * BH + tl.arange(0, BH)
    k_ok = k < HD
    acc = tl.zeros([BM, BH], tl.float32)
    for d0 in tl.static_range(0, D, BD):
        qd = _derope_chunk(Q, COS, SIN, q_row, tpos, r_ok, d0, D, BD)  # [BM, BD]
        d = d0 + tl.arange(0, BD)
        w = tl.load(W1 + (h * HD + k[:, None]) * D + d[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(qd[:, None, :] * w[None, :, :], axis=2)
    sc = tl.load(SCALE + h * HD + k, mask=k_ok, other=0.0)
    sh = tl.load(SHIFT + h * HD + k, mask=k_ok, other=0.0)
    hid = tl.maximum(acc * sc[None, :] + sh[None, :], 0.0)
    rows = h * (G * T) + r
    tl.store(HID + rows[:, None] * HD + k[None, :], hid, mask=r_ok[:, None] & k_ok[None, :])


@triton.jit(do_not_specialize=["T", "n_ctx", "n_rope"])
def _logits_kernel(
    Q, QPOS, COS, SIN, HID, W2, B2, CENT, CSCALE, LOGITS,
    sq_h, sq_g, sq_t,
    T, n_ctx, n_rope, HD, C, sim_scale,
    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    HAS_MLP: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    cb = tl.program_id(0)
    rb = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    r, r_ok, q_row, tpos = _query_rows(QPOS, sq_h, sq_g, sq_t, h, rb, T, n_ctx, n_rope, G, BM)
    rows = h * (G * T) + r
    c = cb * BC + tl.arange(0, BC)
    c_ok = c < C
    # products accumulated per (row, bucket, lane of the reduced dimension) and reduced once at the
    # end: first the centroid term cs · q'·c (q' scaled by cs; probe="centroid": by 1 / sqrt(D)),
    # then w2 · h
    acc = tl.zeros([BM, BC, BK], tl.float32)
    if HAS_MLP:
        cs = tl.load(CSCALE + h)
    else:
        cs = sim_scale
    for d0 in tl.static_range(0, D, BK):
        qd = _derope_chunk(Q, COS, SIN, q_row, tpos, r_ok, d0, D, BK) * cs
        d = d0 + tl.arange(0, BK)
        cent = tl.load(CENT + (h * C + c[:, None]) * D + d[None, :], mask=c_ok[:, None] & (d < D)[None, :],
                       other=0.0).to(tl.float32)
        acc += qd[:, None, :] * cent[None, :, :]
    if HAS_MLP:
        for k0 in tl.range(0, HD, BK, num_stages=NUM_STAGES):
            k = k0 + tl.arange(0, BK)
            k_ok = k < HD
            hv = tl.load(HID + rows[:, None] * HD + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(W2 + (h * C + c[:, None]) * HD + k[None, :], mask=c_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += hv[:, None, :] * w[None, :, :]
        b2 = tl.load(B2 + h * C + c, mask=c_ok, other=0.0)
        logits = tl.sum(acc, axis=2) + b2[None, :]
    else:
        logits = tl.sum(acc, axis=2)
    tl.store(LOGITS + rows[:, None] * C + c[None, :], logits, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _group_scores(LOGITS, rows, j, j_ok, g_ok, m, s):
    """int64 [W]: Σ_g softmax_g[j] of the buckets j, in fixed point (units of 2^-56). Each
    probability exp(l - m_g) / s_g is computed element-wise from the row statistics and rounded
    down to a multiple of 2^-56 on its own; their integer sum is exact, so it does not depend on
    the order (the layout) of the summation: every program ranks the same numbers. A NaN
    probability counts 0; buckets outside [0, C) score -1."""
    msk = g_ok[:, None] & j_ok[None, :]
    lg = tl.load(LOGITS + rows[:, None] + j[None, :], mask=msk, other=float("-inf"))  # [G_PAD, W]
    prob = tl.exp(lg - m[:, None]) / s[:, None]
    prob = tl.where(msk & (prob == prob), prob, 0.0)
    fixed = (prob * 72057594037927936.0).to(tl.int64)  # · 2^56 (exact), then truncated
    return tl.where(j_ok, tl.sum(fixed, axis=0), -1)


@triton.jit(do_not_specialize=["T"])
def _rank_kernel(
    LOGITS, OFF, PROBE, END, SHIFT, SIZE, TICKET,
    so_h,  # offsets [KVH, C + 1] head stride
    T, C, P,
    G: tl.constexpr, G_PAD: tl.constexpr, BR: tl.constexpr, BJ: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    ib = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    if (ib == 0) & (t == 0) & (h == 0):
        tl.store(TICKET, 0)  # _expand_kernel's ticket (the next launch on this stream)
    gi = tl.arange(0, G_PAD)
    g_ok = gi < G
    rows = (h * (G * T) + gi * T + t) * C  # logits row of (h, g, t)
    # softmax statistics of every query head's row in one pass: per lane a running max and a sum
    # of exp(l - max) (rescaled when the max grows), merged over the lanes at the end
    mx = tl.full([G_PAD, BJ], float("-inf"), tl.float32)
    sm = tl.zeros([G_PAD, BJ], tl.float32)
    for j0 in tl.range(0, C, BJ, num_stages=NUM_STAGES):
        j = j0 + tl.arange(0, BJ)
        msk = g_ok[:, None] & (j < C)[None, :]
        lg = tl.load(LOGITS + rows[:, None] + j[None, :], mask=msk, other=float("-inf"))
        m_new = tl.maximum(mx, lg)
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane with nothing yet: exp(-inf) = 0, no NaN
        sm = sm * tl.exp(mx - m_ref) + tl.exp(lg - m_ref)
        mx = m_new
    m = tl.where(g_ok, tl.max(mx, axis=1), 0.0)
    s = tl.where(g_ok, tl.sum(sm * tl.exp(mx - m[:, None]), axis=1), 1.0)

    # this program's buckets: rank among all C, and the total size of the buckets ranked before
    i = ib * BR + tl.arange(0, BR)
    i_ok = i < C
    s_i = _group_scores(LOGITS, rows, i, i_ok, g_ok, m, s)
    start_i = tl.load(OFF + h * so_h + i, mask=i_ok, other=0)
    size_i = tl.load(OFF + h * so_h + i + 1, mask=i_ok, other=0) - start_i
    rank = tl.zeros([BR], tl.int32)
    before = tl.zeros([BR], tl.int32)
    for j0 in tl.range(0, C, BJ, num_stages=NUM_STAGES):
        j = j0 + tl.arange(0, BJ)
        j_ok = j < C
        s_j = _group_scores(LOGITS, rows, j, j_ok, g_ok, m, s)
        size_j = tl.load(OFF + h * so_h + j + 1, mask=j_ok, other=0) - tl.load(OFF + h * so_h + j, mask=j_ok, other=0)
        ahead = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (j[None, :] < i[:, None]))
        ahead = ahead & j_ok[None, :]
        rank += tl.sum(ahead.to(tl.int32), axis=1)
        before += tl.sum(tl.where(ahead, size_j[None, :], 0), axis=1)
    sel = i_ok & (rank < P)
    at = (h * T + t) * P + rank
    tl.store(PROBE + at, i, mask=sel)
    tl.store(END + at, before + size_i, mask=sel)
    tl.store(SHIFT + at, start_i - before, mask=sel)
    tl.store(SIZE + at, size_i, mask=sel)


@triton.jit(do_not_specialize=["T", "K", "n_ctx", "s_end", "window", "n_kb", "n_prog", "steps", "rec_off"])
def _expand_kernel(
    ORDER, QPOS, END, SHIFT, SIZE, POS, PART, TICKET, REC, LEN,
    so_h,  # order [KVH, N] head stride
    sp_h, sp_t,  # positions [KVH, T, K]
    sl_h, sl_t,  # lengths [KVH, T] (HAS_LEN)
    T, K, P, n_ctx, s_end, window, KVH, n_kb, n_prog, steps, rec_s0, rec_off,
    LOG_P: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr, HAS_REC: tl.constexpr, HAS_LEN: tl.constexpr,
):
    kb = tl.program_id(0)
    t = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    j = kb * BLOCK + tl.arange(0, BLOCK)
    in_row = j < K
    base = (h * T + t) * P
    # which probed bucket holds slot j: how many ends are <= j (ends ascend; binary lifting)
    which = tl.zeros([BLOCK], tl.int32)
    for st in tl.static_range(LOG_P):
        cand = which + (1 << (LOG_P - 1 - st))
        e = tl.load(END + base + cand - 1, mask=cand <= P, other=0)
        which = tl.where((cand <= P) & (e <= j), cand, which)
    total = tl.load(END + base + P - 1)
    if HAS_LEN:
        if kb == 0:  # the row's filled length (`Plan.lengths`): slots >= total are -1
            tl.store(LEN + h * sl_h + t * sl_t, tl.minimum(total, K).to(tl.int32))
    which = tl.minimum(which, P - 1)
    valid = in_row & (j < total)
    src = tl.load(SHIFT + base + which, mask=valid, other=0) + j
    key = tl.load(ORDER + h * so_h + src, mask=valid, other=-1).to(tl.int64)
    qp = tl.load(QPOS + t).to(tl.int64)
    w_lo = tl.minimum(tl.maximum(qp - window + 1, s_end), n_ctx)  # frame_bounds
    ok = valid & (key >= s_end) & (key < w_lo)
    tl.store(POS + h * sp_h + t * sp_t + j, tl.where(ok, key, -1).to(tl.int32), mask=in_row)
    if HAS_REC:
        tl.store(PART + (h * T + t) * n_kb + kb, tl.sum(ok.to(tl.int32), axis=0))
        tl.debug_barrier()  # every thread's store before the ticket (taken by one thread, acq_rel)
        ticket = tl.atomic_add(TICKET, 1, sem="acq_rel")
        if ticket == n_prog - 1:  # the last program: the step's selectivity record
            _record(QPOS, SIZE, PART, TICKET, REC, T, P, n_ctx, s_end, window, KVH, n_kb, steps, rec_s0, rec_off, BS)


@triton.jit
def _record(QPOS, SIZE, PART, TICKET, REC, T, P, n_ctx, s_end, window, KVH, n_kb, steps, rec_s0, rec_off,
            BS: tl.constexpr):
    """(mean over KV heads and tokens of (frame + planned keys) / visible keys, the largest probed
    bucket) -> REC[step, layer, 0:2] (what `_SaapPlanner._record` computes in torch)."""
    rr0 = tl.arange(0, BS)
    tot = tl.zeros([BS], tl.float64)
    n_rows = KVH * T
    for r0 in range(0, n_rows, BS):
        rr = r0 + rr0
        r_ok = rr < n_rows
        cnt = tl.zeros([BS], tl.int32)
        for kb in range(0, n_kb):
            cnt += tl.load(PART + rr * n_kb + kb, mask=r_ok, other=0, volatile=True)
        qp = tl.load(QPOS + rr % T, mask=r_ok, other=n_ctx).to(tl.int64)
        w_lo = tl.minimum(tl.maximum(qp - window + 1, s_end), n_ctx)
        frame = s_end + (n_ctx - w_lo) + tl.maximum(qp - n_ctx + 1, 0)
        tot += tl.where(r_ok, (frame + cnt).to(tl.float64) / (qp + 1).to(tl.float64), 0.0)
    mean = tl.sum(tot, axis=0) / n_rows
    big = tl.zeros([BS], tl.int32)
    for s0 in range(0, n_rows * P, BS):
        ss = s0 + rr0
        big = tl.maximum(big, tl.load(SIZE + ss, mask=ss < n_rows * P, other=0))
    largest = tl.max(big, axis=0)
    step = tl.minimum(tl.maximum(tl.load(QPOS + T - 1).to(tl.int64) - n_ctx, 0), steps - 1)
    tl.store(REC + step * rec_s0 + rec_off, mean)
    tl.store(REC + step * rec_s0 + rec_off + 1, largest.to(tl.float64))
    tl.store(TICKET, 0)


# ---------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class PlanConfig:
    """Tuning knobs (defaults: a first guess for D = 128 at the 8B shape, to be swept on the GPU with
    benchmarks/gpu_saap_plan.py --sweep)."""

    block_rows: int | None = None  # BM: query rows per classifier program; None = next_pow2(G·T) in [2, 16]
    tile: int = 8192  # elements of the [BM, BH|BC, BD|BK] product tile of the classifier kernels
    block_hidden: int = 16  # BH: hidden units per _hidden_kernel program
    block_c: int = 16  # BC: buckets per _logits_kernel program
    block_rank: int = 32  # BR: buckets ranked per _rank_kernel program
    block_j: int = 128  # BJ: buckets compared per iteration of _rank_kernel
    rank_stages: int = 3  # pipelining of _rank_kernel's loops over C
    block_plan: int = 1024  # BLOCK: plan slots per _expand_kernel program
    num_warps: int = 4
    num_stages: int = 3  # pipelining of _logits_kernel's loop over Hd (w2 tiles via cp.async)


def unsupported(head_dim: int, group: int, clusters: int, nprobe: int) -> list[str]:
    """Reasons these kernels cannot plan this shape (empty = fine)."""
    reasons = []
    if head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim {head_dim} is not supported by the saap kernels ({SUPPORTED_HEAD_DIMS})")
    if not 1 <= group <= MAX_GROUP:
        reasons.append(f"a GQA group of {group} query heads is not supported by the saap kernels (1..{MAX_GROUP})")
    if not 1 <= nprobe <= clusters:
        reasons.append(f"nprobe {nprobe} must lie in 1..{clusters} (the clusters)")
    return reasons


def kernel_weights(w: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The planner's fp32 weights (`SaapModel.layer`) as the kernels read them: the matrices (w1,
    w2, centroids) in `dtype` (round to nearest), the vectors fp32; contiguous, on w's device."""
    mats = ("w1", "w2", "centroids")
    return {k: (v.to(dtype) if k in mats else v.float()).contiguous()
            for k, v in w.items() if k in (*mats, "scale", "shift", "b2", "centroid_scale")}


def rope_table(n_ctx: int, n_pos: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_pos, D] fp32 of positions n_ctx .. n_ctx + n_pos - 1 (`indexer.rope.rope_cos_sin`:
    the numbers the torch path computes per call)."""
    from indexer.rope import rope_cos_sin

    pos = torch.arange(n_ctx, n_ctx + max(1, n_pos), device=device)
    cos, sin = rope_cos_sin(pos, head_dim, theta, torch.float32)
    return cos.contiguous(), sin.contiguous()


@dataclass
class Probed:
    """The probe table of one plan (views into the stream's workspace: valid until the next plan on
    the stream). probe [KVH, T, ℓ] bucket ids, best first; end / shift / size [KVH, T, ℓ] int32;
    logits [KVH, G, T, C] fp32 (f_q's logits, or the scaled centroid similarities)."""

    probe: torch.Tensor
    end: torch.Tensor
    shift: torch.Tensor
    size: torch.Tensor
    logits: torch.Tensor


# Workspaces per (device, stream, name): grow-only, reused by every call on that stream (calls on
# one stream are ordered, so layer l + 1 may overwrite layer l's tables once its plan is written).
_WORKSPACES = Workspaces()


def _workspace(device: torch.device, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return _WORKSPACES.get(device, name, numel, dtype, zero=True)  # zeros: the ticket starts at 0


def clear_workspace() -> None:
    _WORKSPACES.clear()


def _rows_block(g: int, t: int, cfg: PlanConfig) -> int:
    return cfg.block_rows or min(16, max(2, triton.next_power_of_2(g * t)))


def rank_buckets(q: torch.Tensor, q_pos: torch.Tensor, n_ctx: int, cos: torch.Tensor, sin: torch.Tensor,
                 w: dict[str, torch.Tensor], offsets: torch.Tensor, nprobe: int, probe: str = "classifier",
                 cfg: PlanConfig = PlanConfig()) -> Probed:
    """Kernels 1-3: f_q (or centroid similarity) -> softmax -> group sum -> the ℓ best buckets with
    their places in the plan row. q [KVH, G, T, D] post-RoPE (any float dtype); q_pos [T];
    cos/sin [n_rope, D] fp32 for positions n_ctx ..; w from `kernel_weights`; offsets [KVH, C + 1]."""
    kvh, g, t, d = q.shape
    dev = q.device
    c = w["centroids"].shape[1]
    hd = w["w1"].shape[1]
    p = nprobe
    if q.stride(-1) != 1:
        q = q.contiguous()
    offsets = offsets if offsets.stride(-1) == 1 else offsets.contiguous()
    n_rope = cos.shape[0]
    bm = _rows_block(g, t, cfg)
    n_rb = triton.cdiv(g * t, bm)
    has_mlp = probe == "classifier"
    logits = _workspace(dev, "logits", kvh * g * t * c, torch.float32)
    tables = _workspace(dev, "probe", 4 * kvh * t * p, torch.int32)
    ticket = _workspace(dev, "ticket", 1, torch.int32)
    qs = (q.stride(0), q.stride(1), q.stride(2))
    if has_mlp:
        hid = _workspace(dev, "hidden", kvh * g * t * hd, torch.float32)
        bh = cfg.block_hidden
        bd = min(d, max(16, cfg.tile // (bm * bh)))
        _hidden_kernel[(triton.cdiv(hd, bh), n_rb, kvh)](
            q, q_pos, cos, sin, w["w1"], w["scale"], w["shift"], hid,
            *qs, t, n_ctx, n_rope, hd,
            G=g, D=d, BM=bm, BH=bh, BD=bd, num_warps=cfg.num_warps,
        )
    else:
        hid = logits  # placeholder pointer
    bc = cfg.block_c
    bk = max(16, cfg.tile // (bm * bc))
    _logits_kernel[(triton.cdiv(c, bc), n_rb, kvh)](
        q, q_pos, cos, sin, hid, w["w2"] if has_mlp else logits, w["b2"] if has_mlp else logits,
        w["centroids"], w["centroid_scale"] if has_mlp else logits, logits,
        *qs, t, n_ctx, n_rope, hd, c, float(d ** -0.5),
        G=g, D=d, BM=bm, BC=bc, BK=bk, HAS_MLP=has_mlp,
        NUM_STAGES=1 if interpreted() else cfg.num_stages, num_warps=cfg.num_warps,
    )
    pr, end, shift, size = tables.view(4, kvh, t, p).unbind(0)
    _rank_kernel[(triton.cdiv(c, cfg.block_rank), t, kvh)](
        logits, offsets, pr, end, shift, size, ticket,
        offsets.stride(0), t, c, p,
        G=g, G_PAD=triton.next_power_of_2(g), BR=cfg.block_rank,
        BJ=max(16, min(cfg.block_j, triton.next_power_of_2(c))),
        NUM_STAGES=1 if interpreted() else cfg.rank_stages, num_warps=cfg.num_warps,
    )
    return Probed(pr, end, shift, size, logits.view(kvh, g, t, c))


def expand_probed(probed: Probed, order: torch.Tensor, q_pos: torch.Tensor, n_ctx: int, sink: int, window: int,
                  width: int, rec: torch.Tensor | None = None, rec_col: int = 0,
                  cfg: PlanConfig = PlanConfig(), lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel 4: the plan [KVH, T, width] int32 from the probe table (`expand_clusters` + `selectable`
    of the torch path); when `rec` ([steps, layers, 2] fp64) is given, the step's selectivity record
    goes to rec[step, rec_col]; when `lengths` ([KVH, T] int32) is given, each row's filled length
    (the probed buckets' total, at most width: `Plan.lengths`) goes there."""
    kvh, t, p = probed.end.shape
    dev = order.device
    order = order if order.stride(-1) == 1 else order.contiguous()
    out = torch.empty(kvh, t, width, dtype=torch.int32, device=dev)
    block = cfg.block_plan
    n_kb = max(1, triton.cdiv(width, block))
    n_prog = n_kb * t * kvh
    part = _workspace(dev, "part", n_prog, torch.int32)
    ticket = _workspace(dev, "ticket", 1, torch.int32)
    has_rec = rec is not None
    if has_rec and (rec.dtype != torch.float64 or not rec.is_contiguous() or rec.dim() != 3):
        raise ValueError("rec must be a contiguous [steps, layers, 2] float64 tensor")
    has_len = lengths is not None
    if has_len and (lengths.shape != (kvh, t) or lengths.dtype != torch.int32):
        raise ValueError("lengths must be a [KVH, T] int32 tensor")
    _expand_kernel[(n_kb, t, kvh)](
        order, q_pos, probed.end, probed.shift, probed.size, out, part, ticket, rec if has_rec else out,
        lengths if has_len else out,
        order.stride(0), out.stride(0), out.stride(1), *(lengths.stride() if has_len else (0, 0)),
        t, width, p, n_ctx, min(sink, n_ctx), window, kvh, n_kb, n_prog,
        rec.shape[0] if has_rec else 1, rec.stride(0) if has_rec else 0, rec_col * rec.stride(1) if has_rec else 0,
        LOG_P=max(1, p.bit_length()), BLOCK=block, BS=128, HAS_REC=has_rec, HAS_LEN=has_len,
        num_warps=cfg.num_warps,
    )
    return out


def saap_plan(q: torch.Tensor, q_pos: torch.Tensor, n_ctx: int, cos: torch.Tensor, sin: torch.Tensor,
              w: dict[str, torch.Tensor], order: torch.Tensor, offsets: torch.Tensor, nprobe: int, width: int,
              sink: int, window: int, probe: str = "classifier", rec: torch.Tensor | None = None, rec_col: int = 0,
              cfg: PlanConfig = PlanConfig(), lengths: torch.Tensor | None = None) -> torch.Tensor:
    """One SAAP plan in four launches: positions [KVH, T, width] int32 (see the module docstring);
    each row's filled length into `lengths` when given (`expand_probed`)."""
    probed = rank_buckets(q, q_pos, n_ctx, cos, sin, w, offsets, nprobe, probe, cfg)
    return expand_probed(probed, order, q_pos, n_ctx, sink, window, width, rec, rec_col, cfg, lengths)


__all__ = ["PlanConfig", "Probed", "clear_workspace", "expand_probed", "kernel_weights", "rank_buckets",
           "rope_table", "saap_plan", "unsupported"]
