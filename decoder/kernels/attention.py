"""Split-K ("flash-decoding") attention over frame ∪ plan, for one layer and decode step.

Long because the two kernels and their launch are one piece: the segment bounds, block sizes and
split count the host computes (`launch_plan`) are the ones the split kernel walks, and the row
cache's lookup and refresh sit inside that kernel's chunk loop.

What one kv head attends, as one list of key rows (`indexer.base.frame_bounds` for s_end / w_lo):

    [ sink: context rows 0..s_end-1                     valid for every query
    | window: context rows N-Wr..N-1                    valid for query t iff row >= w_lo[t]
    | plan: positions[h, t, :] for the block's tokens   valid for query (g, t) iff the row belongs to
                                                        token t, s_end <= pos < w_lo[t], pos != -1,
                                                        and not bypass[h, g, t]
    | local: request-local slots 0..M-1 ]               valid for query t iff N + j <= q_pos[t]

(a dense plan is one range: every context row, then the local slots; a plan given as a block list,
`block_size` > 0, holds block ids, and its slot j is token id·block_size + j % block_size of the id at
j // block_size, -1 for a -1 id: the same rows as its expanded positions, in the same order, so the same
bits; psa's budget plan, whose select then stores one id per block). Wr = min(window - 1, N - s_end)
is a static bound of the window's context part, exact because queries are request tokens
(q_pos >= N, the `KVView` contract): the window of query t is [w_lo[t], N) with
w_lo[t] >= N - window + 1. Nothing here reads a device value on the host: every count below is a
Python int derived from shapes and (sink, window), so the launch sequence is fixed and capturable
in a CUDA graph.

Kernel 1 (`_split_kernel`), grid (splits, query blocks, KVH): a query block is BLOCK_M query rows
(TB tokens x G heads, row i = token i // G, head i % G, zero-padded to a power of two >= 16: the M
dimension of `tl.dot`, so each gathered K/V row is loaded once for the whole GQA group and every
token of the block). The block's row list is cut into chunks of BLOCK_N rows, in two segments:
[sink | window | plan] and [local]; split s takes chunks [s·cps, (s+1)·cps) of them, cps =
ceil(live chunks / splits) computed in the kernel. Live: with a plan's `lengths` (the slots of a
row past lengths[h, t] are all -1; planners whose rows are valid-first with a -1 tail give it:
psa, saap) and one token per query block (decode steps), the plan segment ends at the row's
length, so the splits share the rows that hold positions instead of the plan's fixed width (psa's
rows are ~16% filled at 128K, saap's ~25%: without lengths most programs would mask whole chunks
of -1). The split count stays a function of shapes (graph-safe); only the chunks per program
follow the device value. Per chunk: gather BLOCK_N K and V rows (each row D contiguous elements: 16-byte vector
loads, aligned when the row stride is a multiple of 16 elements, which Triton specialises on);
rows valid for no query of the block are not loaded (masked: -1 slots, duplicates of the frame,
invisible local slots, which may hold garbage); scores = Q·Kᵀ (fp32 accumulate), masked per
(query row, key row); online softmax in base 2 (running max m, sum l, acc in fp32); acc += P·V
with P rounded to the K/V dtype (flash-attention practice; l sums the same rounded P). Writes
the split's (acc, m, l) to a workspace.

Kernel 2 (`_merge_kernel`), grid (T, G, KVH): log-sum-exp merge of the splits of one query row,
plus the pseudo-token (rest_logit, rest_value), normalisation, store in q's dtype. When the
launch has a single split (short row lists: streaming plans, small contexts, many query blocks)
kernel 1 finishes the rows itself (`DIRECT`) and kernel 2 is not launched.

Row cache (`v_cache`, one-token steps with a plan; `decoder.kernels.stage.RowCache` has the
layout): when the context's values sit in host memory (`offload_v`, `offload`), kernel 1 looks up
each plan row in the request's cache of the rows the layer's last plans read. A row held in a
region other than this step's (region = q_pos % regions) is loaded from HBM instead of over PCIe;
every plan row, hit or not, is then written to this step's region at slot base + j (j: its index in
the plan), and the slots the step leaves (masked rows, those past the plan's length) are marked
empty, so the region holds exactly this plan. Each plan row belongs to one program and no program
reads the region being written: no races, and the arithmetic is unchanged (the same bytes).
`counts` accumulates (hits, plan rows). Frame rows are read where they are (contiguous, cheap).
`v_staged`: `stage_rows` already filled this step's region (planning ahead): every region is only
read, and a row found in none of them is read from ctx_v.

Precision: softmax state and accumulation in fp32; fp32 inputs use `input_precision="ieee"` dots
(no tf32), fp16/bf16 dots take fp16/bf16 operands. Error bounds, measured speed and the tuning
knobs: NOTES.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from decoder.kernels.stage import RowCache
from indexer.kernels import Workspaces, interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4
from indexer.kernels.pdl import pdl_begin, pdl_launch
from indexer.kernels.stamps import stamp, stamp_args

LOG2E = 1.4426950408889634
# initial running max: finite, so exp2(m_old - m_new) never computes inf - inf
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MERGE_BLOCK_S = 64  # splits merged per iteration (fixed: a changing split count never recompiles); 64 holds
# the 33 splits of a B = 1 step on a 132-SM GPU in one chunk


# ---------------------------------------------------------------------------------------------
# Kernels


# Runtime ints that vary between requests or steps are not specialised (no recompilation when the
# context length, the plan width or the request's length changes); strides are (16-alignment).
@triton.jit(do_not_specialize=["T", "n_ctx", "s_end", "window", "sink_rows", "win_rows", "n_pos", "n_loc"])
def _split_kernel(
    Q, CK, CV, LK, LV, QPOS, POS, PLEN, BYP, PACC, PML, RL, RV, OUT, C_VALS, C_POS, C_SLOT, C_COUNTS,
    sq_h, sq_g, sq_t,  # q [KVH, G, T, D]
    sck_h, sck_n, scv_h, scv_n,  # ctx_k / ctx_v [KVH, N, D]
    slk_h, slk_n, slv_h, slv_n,  # loc_k / loc_v [KVH, M, D]
    sp_h, sp_t, sp_k,  # positions [KVH, T, K]
    sl_h, sl_t,  # lengths [KVH, T] (HAS_LEN)
    sb_h, sb_g, sb_t,  # bypass [KVH, G, T]
    srl_h, srl_g, srl_t, srv_h,  # rest_logit [KVH, G, T], rest_value [KVH, D] (DIRECT only)
    so_h, so_g, so_t,  # out [KVH, G, T, D] (DIRECT only)
    T, n_ctx, s_end, window,  # frame: sink [0, s_end); window [w_lo[t], N), w_lo from q_pos
    sink_rows, win_rows, n_pos, n_loc,  # segment lengths (dense: sink_rows = N, win_rows = n_pos = 0)
    qk_scale,  # softmax scale * log2(e)
    G: tl.constexpr, TB: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PLAN: tl.constexpr, HAS_LEN: tl.constexpr, HAS_BYPASS: tl.constexpr, HAS_REST: tl.constexpr, DIRECT: tl.constexpr,
    ONE_TOKEN: tl.constexpr, BLOCK_IDS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False,
    CACHE: tl.constexpr = 0, CACHE_STAGED: tl.constexpr = False, TS=None, STAMP: tl.constexpr = False,
):
    pdl_begin(PDL)
    split = tl.program_id(0)
    qb = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    n_splits = tl.num_programs(0)
    n_qb = tl.num_programs(1)
    stamp(TS, (h * n_qb + qb) * n_splits + split, 0, STAMP)

    # --- the block's query rows: row i = (token qb·TB + i // G, head i % G)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    t0 = qb * TB
    t_q = t0 + offs_m // G  # [BLOCK_M]
    g_q = offs_m % G
    q_ok = (offs_m < TB * G) & (t_q < T)
    q = tl.load(Q + h * sq_h + g_q[:, None] * sq_g + t_q[:, None].to(tl.int64) * sq_t + offs_d[None, :],
                mask=q_ok[:, None], other=0.0)
    qpos_q = tl.load(QPOS + t_q, mask=q_ok, other=0).to(tl.int64)
    wlo_q = tl.minimum(tl.maximum(qpos_q - window + 1, s_end), n_ctx)  # frame_bounds
    qpos_max = tl.max(tl.where(q_ok, qpos_q, -1), axis=0)
    wlo_min = tl.min(tl.where(q_ok, wlo_q, n_ctx), axis=0)
    if HAS_BYPASS:
        byp_q = tl.load(BYP + h * sb_h + g_q * sb_g + t_q * sb_t, mask=q_ok, other=0) != 0
    else:
        byp_q = offs_m < 0

    # --- segment bounds of this block's row list
    n_tok = tl.minimum(T - t0, TB)  # real tokens in this block
    b1 = sink_rows
    b2 = b1 + win_rows
    b3 = b2 + n_tok * n_pos
    total = b3 + n_loc
    win_base = n_ctx - win_rows
    n_pos_div = tl.maximum(n_pos, 1)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # the live chunks: segment A = rows [0, end_a) (sink, window, plan up to the row's length),
    # segment B = rows [b3, total) (local); this program's share of them
    end_a = b3
    if HAS_LEN:  # one token per block (the host passes lengths only then): its plan length
        plen = tl.load(PLEN + h * sl_h + t0 * sl_t).to(tl.int32)
        end_a = b2 + tl.minimum(tl.maximum(plen, 0), n_pos)
    chunks_a = (end_a + BLOCK_N - 1) // BLOCK_N
    n_live = chunks_a + (total - b3 + BLOCK_N - 1) // BLOCK_N
    cps = (n_live + n_splits - 1) // n_splits
    c_lo = split * cps
    c_hi = tl.minimum(c_lo + cps, n_live)
    if CACHE > 0:  # the row cache of the context's values (one token): this step writes region `c_base`
        c_width = CACHE * n_pos
        c_base = (tl.load(QPOS).to(tl.int64) % CACHE) * n_pos
        c_hits = tl.zeros([BLOCK_N], tl.int32)
        c_rows = tl.zeros([BLOCK_N], tl.int32)
    for c in tl.range(c_lo, c_hi, num_stages=NUM_STAGES):
        in_a = c < chunks_a
        r = tl.where(in_a, c * BLOCK_N, b3 + (c - chunks_a) * BLOCK_N) + tl.arange(0, BLOCK_N)
        r = tl.where(r < tl.where(in_a, end_a, total), r, total)  # row `total`: in no segment, masked
        in_sink = r < b1
        in_win = (r >= b1) & (r < b2)
        in_loc = (r >= b3) & (r < total)
        ctx_row = tl.where(in_sink, r, win_base + (r - b1)).to(tl.int64)
        row_ok = in_sink | (in_win & (ctx_row >= wlo_min))
        if HAS_PLAN:
            in_plan = (r >= b2) & (r < b3)
            j = r - b2
            tt = t0 + j // n_pos_div  # the token whose plan this row belongs to
            if BLOCK_IDS > 0:  # POS holds block ids (`BlockList`): slot jj, token jj % BLOCK_IDS of id jj // BLOCK_IDS
                jj = j % n_pos_div
                bid = tl.load(POS + h * sp_h + tt.to(tl.int64) * sp_t + (jj // BLOCK_IDS) * sp_k,
                              mask=in_plan, other=-1).to(tl.int64)
                pos = tl.where(bid >= 0, bid * BLOCK_IDS + jj % BLOCK_IDS, -1)
            else:
                pos = tl.load(POS + h * sp_h + tt.to(tl.int64) * sp_t + (j % n_pos_div) * sp_k,
                              mask=in_plan, other=-1).to(tl.int64)
            qpos_tt = tl.load(QPOS + tt, mask=in_plan, other=0).to(tl.int64)
            wlo_tt = tl.minimum(tl.maximum(qpos_tt - window + 1, s_end), n_ctx)
            plan_ok = in_plan & (pos >= s_end) & (pos < wlo_tt)  # -1, sink and window duplicates: no
            ctx_row = tl.where(in_plan, pos, ctx_row)
            row_ok = row_ok | plan_ok
        loc_row = (r - b3).to(tl.int64)
        if ONE_TOKEN:  # the block's token's position, loaded per row (the same word: one L1 line) only so that
            # Triton maps the rows once, one per thread, and converts the results, instead of recomputing the
            # mapping in the 2-D tiles' layouts (sm_90 static SASS of a 128-row planless chunk: 3568 with the
            # general mask, 3240 with the one-token mask alone, 1416 with this load)
            qpos_r = tl.load(QPOS + t0 + r * 0, mask=in_loc, other=0).to(tl.int64)
            row_ok = row_ok | (in_loc & (n_ctx + loc_row <= qpos_r))
        else:
            row_ok = row_ok | (in_loc & (n_ctx + loc_row <= qpos_max))
        ctx_row = tl.where(row_ok & ~in_loc, ctx_row, 0)
        loc_row = tl.where(row_ok & in_loc, loc_row, 0)

        k_row = tl.where(in_loc, LK + h * slk_h + loc_row * slk_n, CK + h * sck_h + ctx_row * sck_n)
        v_row = tl.where(in_loc, LV + h * slv_h + loc_row * slv_n, CV + h * scv_h + ctx_row * scv_n)
        if CACHE > 0:  # a plan row another region holds is read from HBM (decoder/kernels/stage.py)
            c_slot = tl.load(C_SLOT + h * n_ctx + pos, mask=plan_ok, other=0).to(tl.int64)
            c_slot = tl.minimum(tl.maximum(c_slot, 0), c_width - 1)
            c_hit = plan_ok & (tl.load(C_POS + h * c_width + c_slot, mask=plan_ok, other=-1) == pos)
            if not CACHE_STAGED:  # this step's region is being written: hits come from the others
                c_hit = c_hit & ((c_slot < c_base) | (c_slot >= c_base + n_pos))
            v_row = tl.where(c_hit, C_VALS + (h * c_width + c_slot) * D, v_row)
        k = tl.load(k_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_row[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if CACHE > 0 and not CACHE_STAGED:  # this plan's rows -> this step's region: slot c_base + j, j-th position
            c_j = c_base + j
            tl.store(C_VALS + (h * c_width + c_j)[:, None] * D + offs_d[None, :], v, mask=plan_ok[:, None])
            tl.store(C_POS + h * c_width + c_j, tl.where(plan_ok, pos, -1).to(tl.int32), mask=in_plan)
            tl.store(C_SLOT + h * n_ctx + pos, c_j.to(tl.int32), mask=plan_ok)
            c_hits += c_hit.to(tl.int32)
            c_rows += plan_ok.to(tl.int32)

        # which (query row, key row) pairs are attended
        if ONE_TOKEN:  # the block's rows share one frame, so row_ok (built with its bounds) is the mask: fewer
            # row vectors carried into the scores' layout. Taken by steps without plan positions (with the
            # anchoring load above, on the H200: dense 176 -> 140 us at 128K, the frame alone 16 -> 12 us);
            # with a plan the mask alone measured 0.3-0.5 us slower, so plans keep the general mask
            valid = q_ok[:, None] & row_ok[None, :]
        else:
            valid = in_sink[None, :] | (in_win[None, :] & (ctx_row[None, :] >= wlo_q[:, None]))
            valid = valid | (in_loc[None, :] & (n_ctx + loc_row[None, :] <= qpos_q[:, None]))
            if HAS_PLAN:
                valid = valid | (plan_ok[None, :] & (tt[None, :] == t_q[:, None]) & ~byp_q[:, None])
            valid = valid & q_ok[:, None] & row_ok[None, :]

        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong: fp32 operands holding the same values
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(valid, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None]).to(q.dtype)  # P rounded to the K/V dtype for P·V
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)  # the sum of the same rounded P
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if CACHE > 0 and not CACHE_STAGED:
        if HAS_LEN:  # the slots past the plan's length, never visited above: empty, shared by the splits
            for j0 in range(end_a - b2 + split * BLOCK_N, n_pos, n_splits * BLOCK_N):
                jj = j0 + tl.arange(0, BLOCK_N)
                tl.store(C_POS + h * c_width + c_base + jj, tl.full([BLOCK_N], -1, tl.int32), mask=jj < n_pos)
        tl.atomic_add(C_COUNTS, tl.sum(c_hits, axis=0).to(tl.int64))
        tl.atomic_add(C_COUNTS + 1, tl.sum(c_rows, axis=0).to(tl.int64))

    if DIRECT:  # one split: finish here (pseudo-token, normalisation) instead of in _merge_kernel
        if HAS_REST:
            rl = tl.load(RL + h * srl_h + g_q * srl_g + t_q * srl_t, mask=q_ok, other=float("-inf"))
            rl = rl.to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, rl)
            keep = tl.math.exp2(m_i - m_new)
            w_rest = tl.math.exp2(rl - m_new)
            rv = tl.load(RV + h * srv_h + offs_d).to(tl.float32)
            l_i = l_i * keep + w_rest
            acc = acc * keep[:, None] + w_rest[:, None] * rv[None, :]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(OUT + h * so_h + g_q[:, None] * so_g + t_q[:, None].to(tl.int64) * so_t + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=q_ok[:, None])
    else:
        part = (h * n_qb + qb) * n_splits + split  # [KVH, n_qb, splits, ...] workspace
        tl.store(PACC + part * (BLOCK_M * D) + offs_m[:, None] * D + offs_d[None, :], acc)
        tl.store(PML + part * (2 * BLOCK_M) + offs_m, m_i)
        tl.store(PML + part * (2 * BLOCK_M) + BLOCK_M + offs_m, l_i)
    stamp(TS, (h * n_qb + qb) * n_splits + split, 1, STAMP)


@triton.jit(do_not_specialize=["n_splits", "n_qb"])
def _merge_kernel(
    PACC, PML, RL, RV, OUT,
    srl_h, srl_g, srl_t, srv_h,  # rest_logit [KVH, G, T], rest_value [KVH, D]
    so_h, so_g, so_t,  # out [KVH, G, T, D]
    n_splits, n_qb,
    G: tl.constexpr, TB: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_REST: tl.constexpr, PDL: tl.constexpr = False, TS=None, STAMP: tl.constexpr = False,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    stamp(TS, (h * tl.num_programs(1) + g) * tl.num_programs(0) + t, 0, STAMP)
    qb = t // TB
    row = (t % TB) * G + g  # row of the query block
    base = (h * n_qb + qb) * n_splits
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)

    # the first BLOCK_S splits' states (max, sum, acc) are loaded at once: one round trip to L2 where
    # the splits fit one chunk (a decode step's usual count), not one for the maxima and another for
    # the sums (same values, same arithmetic)
    ok0 = offs_s < n_splits
    m0 = tl.load(PML + (base + offs_s) * (2 * BLOCK_M) + row, mask=ok0, other=NEG_BIG)
    l0 = tl.load(PML + (base + offs_s) * (2 * BLOCK_M) + BLOCK_M + row, mask=ok0, other=0.0)
    a0 = tl.load(PACC + (base + offs_s)[:, None] * (BLOCK_M * D) + row * D + offs_d[None, :], mask=ok0[:, None],
                 other=0.0)
    m_max = tl.max(m0, axis=0)
    for s0 in range(BLOCK_S, n_splits, BLOCK_S):
        sp = s0 + offs_s
        m = tl.load(PML + (base + sp) * (2 * BLOCK_M) + row, mask=sp < n_splits, other=NEG_BIG)
        m_max = tl.maximum(m_max, tl.max(m, axis=0))
    w = tl.where(ok0, tl.math.exp2(m0 - m_max), 0.0)
    l_tot = tl.sum(w * l0, axis=0)
    acc = tl.sum(w[:, None] * a0, axis=0)
    for s0 in range(BLOCK_S, n_splits, BLOCK_S):
        sp = s0 + offs_s
        ok = sp < n_splits
        m = tl.load(PML + (base + sp) * (2 * BLOCK_M) + row, mask=ok, other=NEG_BIG)
        l = tl.load(PML + (base + sp) * (2 * BLOCK_M) + BLOCK_M + row, mask=ok, other=0.0)
        a = tl.load(PACC + (base + sp)[:, None] * (BLOCK_M * D) + row * D + offs_d[None, :],
                    mask=ok[:, None], other=0.0)
        w = tl.where(ok, tl.math.exp2(m - m_max), 0.0)
        l_tot += tl.sum(w * l, axis=0)
        acc += tl.sum(w[:, None] * a, axis=0)
    if HAS_REST:  # the pseudo-token: one more key with logit rest_logit and value rest_value
        rl = tl.load(RL + h * srl_h + g * srl_g + t * srl_t).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_max, rl)
        keep = tl.math.exp2(m_max - m_new)
        w_rest = tl.math.exp2(rl - m_new)
        rv = tl.load(RV + h * srv_h + offs_d).to(tl.float32)
        l_tot = l_tot * keep + w_rest
        acc = acc * keep + w_rest * rv
    out = tl.where(l_tot > 0, acc / tl.where(l_tot > 0, l_tot, 1.0), 0.0)
    tl.store(OUT + h * so_h + g * so_g + t * so_t + offs_d, out.to(OUT.dtype.element_ty))
    stamp(TS, (h * tl.num_programs(1) + g) * tl.num_programs(0) + t, 1, STAMP)


# ---------------------------------------------------------------------------------------------
# Launch configuration (host ints from shapes only)


@dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs. None = the defaults below (swept on an H100 at D = 128 bf16: NOTES.md)."""

    block_n: int | None = None  # key rows per chunk; default 128 (64 for D = 256 or one chunk in all), halved for fp32
    num_warps: int | None = None  # split kernel; default 4 (8 when BLOCK_M·D > 64·128)
    num_stages: int | None = None  # pipelining of the chunk loop; default 3 (2 when a stage > 32 KiB)
    programs_per_sm: int = 2  # split count aims at programs_per_sm · SMs programs in all
    min_chunks_per_split: int = 1  # ... but never fewer chunks than this per program (RESULTS.md: 1 vs 2)
    splits: int | None = None  # force the split count (tests; capped at the number of chunks)
    max_query_rows: int = 64  # BLOCK_M cap when several tokens share a block
    pdl: bool = True  # programmatic dependent launch on Hopper and later (`indexer/kernels/pdl.py`)
    one_token: bool = True  # no plan positions (dense, the frame alone), a token per query block: per-key-row mask
    take_attended: bool = True  # the backend returns a plan's own attention (`Plan.attended`, psa) instead of running
    block_ids: bool = True  # the backend reads a block list's ids (`Plan.blocks`), not its expanded positions
    # split kernel: a register cap per thread on CUDA (None: the compiler's, 255 with a plan: two programs per SM);
    # caps of 128 and 168 fit more programs but each runs slower: slower at every setting tried (RESULTS.md, s37)
    maxnreg: int | None = None


@dataclass(frozen=True)
class LaunchPlan:
    block_m: int
    tokens_per_block: int  # TB
    n_qb: int
    block_n: int
    rows: int  # row-list length of the first (longest) query block
    splits: int
    chunks_per_split: int
    num_warps: int
    num_stages: int


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so tests exercise several splits
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@functools.lru_cache(maxsize=1024)
def launch_plan(kvh: int, g: int, t: int, d: int, itemsize: int, n_ctx: int, n_loc: int, n_pos: int | None,
                sink: int, window: int, sm_count: int, cfg: KernelConfig = KernelConfig(),
                interpreted_run: bool = False) -> LaunchPlan:
    """Block sizes and the split count for one call, from shapes only (n_pos None = dense).

    BLOCK_M = next_pow2(G·T) clamped to [16, max_query_rows] (at least next_pow2(G)), so only a few
    BLOCK_M values (and compiled variants) exist whatever T is; 16 when the plan's rows (one token
    each) outnumber the rows the block's tokens share (sink, window, local). The split count aims at
    programs_per_sm · SMs programs over (KVH x query blocks x splits), with at least
    min_chunks_per_split chunks each (chunks_per_split: the most a program runs when every plan slot
    is live; with a plan's lengths the kernel divides the live chunks over the same splits)."""
    s_end = min(sink, n_ctx)
    win_rows = min(max(window - 1, 0), n_ctx - s_end)
    shared = n_ctx + n_loc if n_pos is None else s_end + win_rows + n_loc  # rows every token of a block uses
    qmax = max(16, triton.next_power_of_2(cfg.max_query_rows))
    if n_pos is not None and n_pos >= shared:
        # plan rows dominate, and each belongs to one token: a taller block would score each of them
        # against more query rows of other tokens (masked) while sharing little; keep the MMA minimum
        qmax = 16
    block_m = max(min(max(16, triton.next_power_of_2(g * t)), qmax), triton.next_power_of_2(g))
    tb = block_m // g
    n_qb = triton.cdiv(t, tb)
    block_n = cfg.block_n or (128 if d <= 128 else 64)
    if itemsize == 4 and cfg.block_n is None:
        block_n = max(16, block_n // 2)
    rows = shared + (0 if n_pos is None else min(t, tb) * n_pos)
    small = cfg.block_n is None and rows <= block_n and d <= 128 and itemsize < 4
    if small:  # one chunk in all (a frame-only step): two half chunks over 8 warps finish sooner
        block_n = 64  # (measured: benchmarks/RESULTS.md, "The split kernel's fixed cost")
    n_chunks = max(1, triton.cdiv(rows, block_n))
    if cfg.splits is not None:
        splits = max(1, min(cfg.splits, n_chunks))
    else:
        target = cfg.programs_per_sm * sm_count
        # a frame-only step's two half chunks stay in one program (the measured shape of that case)
        min_chunks = 2 if small else cfg.min_chunks_per_split
        splits = max(1, min(triton.cdiv(target, kvh * n_qb), n_chunks // max(1, min_chunks)))
    cps = triton.cdiv(n_chunks, splits)
    splits = triton.cdiv(n_chunks, cps)
    num_warps = cfg.num_warps or (8 if block_m * d > 64 * 128 or small else 4)
    if cfg.num_stages:
        num_stages = cfg.num_stages
    elif interpreted_run:
        num_stages = 1
    else:  # K and V tiles of one stage: 2 · BLOCK_N · D · itemsize bytes of shared memory
        num_stages = 3 if 2 * block_n * d * itemsize <= 32 * 1024 else 2
    return LaunchPlan(block_m, tb, n_qb, block_n, rows, splits, cps, num_warps, num_stages)


# Workspace for the splits' partial states (grow-only, per device and stream; see Workspaces).
_WORKSPACES = Workspaces()


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    return _WORKSPACES.get(device, "attention", numel, torch.float32)


def clear_workspace() -> None:
    _WORKSPACES.clear()


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels assume unit stride along D (every other stride is passed)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def frame_attention(
    q: torch.Tensor,  # [KVH, G, T, D]
    ctx_k: torch.Tensor,  # [KVH, N, D], any strides with unit stride along D
    ctx_v: torch.Tensor,
    loc_k: torch.Tensor,  # [KVH, M, D]
    loc_v: torch.Tensor,
    q_pos: torch.Tensor,  # [T] int, q_pos >= N
    positions: torch.Tensor | None,  # [KVH, T, K] int, -1 = empty; None = dense
    sink: int,
    window: int,
    scale: float,
    bypass: torch.Tensor | None = None,  # [KVH, G, T] bool
    rest_logit: torch.Tensor | None = None,  # [KVH, G, T] fp32, -inf = none
    rest_value: torch.Tensor | None = None,  # [KVH, D]
    lengths: torch.Tensor | None = None,  # [KVH, T] int: positions[h, t, lengths[h, t]:] are all -1
    *,
    out: torch.Tensor | None = None,  # [KVH, G, T, D] in q's dtype (allocated when None)
    cfg: KernelConfig = KernelConfig(),
    v_cache: RowCache | None = None,  # one token's plan: a cache of ctx_v's rows in HBM (module docstring)
    v_staged: bool = False,  # v_cache already holds this step's plan (`stage_rows`): read it, write nothing
    block_size: int = 0,  # > 0: positions holds block ids [KVH, T, nblk] of that many tokens (`BlockList`)
) -> torch.Tensor:
    """Attention of q over sink ∪ window ∪ positions ∪ visible local slots (∪ the pseudo-token);
    see the module docstring. Two launches (one when a single split suffices), no host sync, no
    allocation besides `out` (and the workspace when it has to grow)."""
    kvh, g, t, d = q.shape
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError("out must be [KVH, G, T, D] in q's dtype with unit stride along D")
    n_ctx, n_loc = ctx_k.shape[1], loc_k.shape[1]
    if block_size and (positions is None or v_cache is not None):
        raise ValueError("block ids need a plan, and a row cache takes positions (`BlockList.positions`)")
    if v_cache is not None and (t != 1 or positions is None or not v_cache.fits(kvh, n_ctx, positions.shape[-1])
                                or v_cache.vals.dtype != ctx_v.dtype or v_cache.vals.device != q.device):
        raise ValueError("a row cache serves one token's plan of K positions: [KVH, (plans + 1) K, D] in ctx_v's "
                         "dtype, on q's device")
    dev = q.device
    dtype = q.dtype
    q = _rows_contiguous(q)
    kv_dtype = ctx_k.dtype
    ctx_k, ctx_v = _rows_contiguous(ctx_k), _rows_contiguous(ctx_v)
    loc_k, loc_v = _rows_contiguous(loc_k.to(kv_dtype)), _rows_contiguous(loc_v.to(kv_dtype))
    dense = positions is None
    n_pos = 0 if dense else positions.shape[-1] * max(block_size, 1)  # the plan's slots per row, in tokens
    lp = launch_plan(kvh, g, t, d, q.element_size(), n_ctx, n_loc, None if dense else n_pos, sink, window,
                     _sm_count(dev), cfg, interpreted_run=dev.type != "cuda")
    s_end = min(sink, n_ctx)
    if dense:
        sink_rows, win_rows = n_ctx, 0
    else:
        sink_rows, win_rows = s_end, min(max(window - 1, 0), n_ctx - s_end)
    has_plan = n_pos > 0
    one_token = min(t, lp.tokens_per_block) == 1  # every query block holds one token (decode steps)
    has_len = has_plan and lengths is not None and one_token
    plen = lengths if has_len else q_pos  # a placeholder pointer when unused
    has_bypass = has_plan and bypass is not None
    has_rest = not dense and rest_logit is not None
    pos = positions if has_plan else q_pos  # a placeholder pointer when unused
    byp = bypass if has_bypass else q_pos
    direct = lp.splits == 1
    pdl = pdl_launch(dev, cfg.pdl)
    if out is None:
        out = torch.empty(kvh, g, t, d, dtype=dtype, device=dev)
    rl = rest_logit if has_rest else q_pos  # placeholders when unused
    rv = rest_value if has_rest else q_pos
    rest_strides = (*rl.stride(), rv.stride(0)) if has_rest else (0, 0, 0, 0)
    if direct:
        pacc = pml = q_pos  # no workspace
    else:
        part = kvh * lp.n_qb * lp.splits * lp.block_m
        ws = _workspace(dev, part * (d + 2))
        pacc, pml = ws[: part * d], ws[part * d:]
    c = v_cache if has_plan else None
    cache_args = (c.vals, c.pos_of, c.slot_of, c.counts) if c is not None else (q_pos,) * 4  # placeholders
    _split_kernel[(lp.splits, lp.n_qb, kvh)](
        q, ctx_k, ctx_v, loc_k, loc_v, q_pos, pos, plen, byp, pacc, pml, rl, rv, out, *cache_args,
        q.stride(0), q.stride(1), q.stride(2),
        ctx_k.stride(0), ctx_k.stride(1), ctx_v.stride(0), ctx_v.stride(1),
        loc_k.stride(0), loc_k.stride(1), loc_v.stride(0), loc_v.stride(1),
        *(pos.stride() if has_plan else (0, 0, 0)),
        *(plen.stride() if has_len else (0, 0)),
        *(byp.stride() if has_bypass else (0, 0, 0)),
        *rest_strides,
        out.stride(0), out.stride(1), out.stride(2),
        t, n_ctx, s_end, window,
        sink_rows, win_rows, n_pos, n_loc,
        float(scale) * LOG2E,
        G=g, TB=lp.tokens_per_block, D=d, BLOCK_M=lp.block_m, BLOCK_N=lp.block_n,
        HAS_PLAN=has_plan, HAS_LEN=has_len, HAS_BYPASS=has_bypass, HAS_REST=has_rest, DIRECT=direct,
        ONE_TOKEN=one_token and cfg.one_token and not has_plan, BLOCK_IDS=block_size if has_plan else 0,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        DOT_FP32=interpreted() and dtype == torch.bfloat16, NUM_STAGES=lp.num_stages, PDL=bool(pdl), **pdl,
        CACHE=0 if c is None else c.plans + 1, CACHE_STAGED=v_staged, **stamp_args("split"), num_warps=lp.num_warps,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and dev.type == "cuda" else {}),
    )
    if not direct:
        _merge_kernel[(t, g, kvh)](
            pacc, pml, rl, rv, out,
            *rest_strides,
            out.stride(0), out.stride(1), out.stride(2),
            lp.splits, lp.n_qb,
            G=g, TB=lp.tokens_per_block, D=d, BLOCK_M=lp.block_m, BLOCK_S=MERGE_BLOCK_S,
            HAS_REST=has_rest, PDL=bool(pdl), **pdl, **stamp_args("merge"),
            num_warps=4,
        )
    return out


def unsupported(head_dim: int, dtype: torch.dtype) -> list[str]:
    """Reasons these kernels cannot run this head_dim / dtype (empty = fine)."""
    reasons = []
    if head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim {head_dim} is not supported by the triton kernels "
                       f"(powers of two in {SUPPORTED_HEAD_DIMS[0]}..{SUPPORTED_HEAD_DIMS[-1]})")
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported by the triton kernels (float32, float16, bfloat16)")
    return reasons


__all__ = ["KernelConfig", "LaunchPlan", "frame_attention", "launch_plan", "unsupported", "interpreted",
           "clear_workspace"]
