"""PSA's decode plan (`indexer/psa.py`, `progressive_plan`) in four Triton launches (five with the
plan's attention, which then needs no attention launch after it) instead of the torch path's ~280
dispatched ops (views included; a full sort of the block scores, a gather of the candidates' keys,
cumsum / cummin and their masks). The planner dispatches here for CUDA tensors
(`planner.fused`: None = fused for CUDA tensors, True = also on CPU tensors through Triton's
interpreter, the tests' mode, False = torch); the torch function stays the reference and the CPU
path. `CTXCACHE_FUSED_PSA=0` keeps every planner on torch (A/B runs).

Long because the four kernels of one plan share their device helpers, workspace layout and launch
configuration, and this docstring states the byte budget and the ways the result may differ from
the torch path, which the tests check.

What one plan computes, per layer and row (KV head, query token): rows = KVH x T; G query heads per
KV head; nb context blocks of bs tokens, K = B_max = ceil(max_ratio · nb) candidates:

    x[g, b]   = crit(q_g, meta_b) · scale            cuboid q⁻·min + q⁺·max, center, or q·mean
    score[b]  = Σ_g softmax_b(x[g, ·])[b]             over the row's ranked blocks (not sink/window)
    cand      = the K best blocks, best first         ties: lowest block id first
    AS_b[g]   = Σ_{keys of b} exp(q_g·k · scale - m_g), and the dense part's (its sink/window blocks
                and visible request-local keys), m_g = the max of every such logit (the torch path's)
    P_acc     = AS_acc / (AS_acc + AS_min·N_left) after each candidate; stop at the first check
                (every `microbatch` blocks, the last candidate, the last ranked block) where every
                head has P_acc >= eps (eps = 1: no block left)
    plan      = the dense-part blocks' tokens outside the frame, then the processed candidates' tokens

Kernels (grids from shapes only, no host sync, fixed-shape outputs; rows of one chunk of tokens):

1. `_crit_kernel`, grid (ceil(nb / BLOCK_B), ceil(T·G / BLOCK_Q), KVH): the criticality of BLOCK_B
   blocks for BLOCK_Q query rows (token, head) as a tl.dot against the metadata tile as stored
   (fp16: a block's adjacent min and max rows as one row of 2D for cuboid / center, against q⁻ | q⁺ or
   q/2 | q/2; the mean row for mean), rounded to the metadata's
   dtype on a GPU as the torch path's GEMM output, times the scale -> X [rows·G, nb] fp32; and per
   (row, head) the softmax state (max, sum of exp) of its ranked blocks in the tile -> PS.
2. `_select_kernel`, grid (rows,): the softmax normalisation per head from the tiles' states (fixed
   order), the group score of every block as an int key (float bits + 1: scores are >= 0, so the
   bits keep the order; 0 = a dense-part block), the K-th largest key by bisection on the key value
   (`ivf._top_threshold`: in registers for nb <= 4096, compacting passes over L2 beyond), and the
   K candidates (block id, key) in block order -> CAND / CKEY [rows, K], their count -> NCAND.
3. `_sums_kernel`, grid (ceil(K / SLOTS) + 1, rows): a program takes SLOTS candidates (128 key rows:
   4 blocks of 32), loads their keys once for the whole GQA group (tl.dot [G, D] x [D, 128]), the
   logits rounded to the query's dtype (the torch einsum's output), and per block and head the max
   and the sum of exp(x - max); it writes them at the block's rank, counted against the row's K
   keys (keys greater, or equal with a lower block id: a stable descending sort, O(K) compares per
   candidate from L2) -> SID [rows, K] (block ids best first), SMX / SSM [rows·G, K]. The row's last
   program does the dense part (online max / sum over its sink/window blocks and request-local keys).
4. `_stop_kernel`, grid (parts, rows): m per head = max(dense max, candidates' maxima); AS_b = sum_b ·
   exp(max_b - m); then the rule in chunks of BLOCK candidates with carries (tl.cumsum for AS_acc, an
   associative min scan for AS_min, IEEE division for P_acc), stopping at the first chunk that holds
   the stop point; writes the plan row (the torch path's layout and order), `ranked` (-1 past the
   candidates), `blocks`, `used`, P_acc at the stop and `capped`.

Rule "budget" (`progressive_plan(rule="budget")`, the torch path's): every candidate is kept, so the
select writes the plan itself, as a block list (`indexer.base.BlockList`): the emit stores each
candidate's block id at its rank in block order, after the row's F dense-part ids, and `_budget_rest`
the dense-part ids, -1 past the count, the counts, `capped` and NaN for P_acc (every store to a slot
the emit left alone: no barrier, nothing read back); `ranked` is a view of the ids. Crit + select, no
sums or stop launch, and no plan's attention (that needs the sums). The `triton` backend expands the
ids in its chunk loop; any other reader of `Plan.positions` gets them expanded by torch, the bits the
torch path plans. H200, one 8B layer, rho 5% (benchmarks/RESULTS.md): writing the plan from the select
took it 11.2-11.3 -> 11.9-12.0 us at 128K and the step 50-51 -> 41-43 us (session 36, one position per
token, read back after a barrier and expanded in a [candidates, block] tile); the block list instead
takes the plan's stores 1.5-1.9 -> 0.4 us, the step over 128-token blocks 31.6-31.7 -> 30.4-30.8 us
(session 39).

The plan's attention (`progressive_plan(attend_scale=, ctx_v=, loc_v=)`, asked for by the caller through
`KVView.attend_scale` when its backend takes it: `Plan.attended`, the `triton` backend). The sums
kernel already reads every candidate block's keys and scores them for the group; with their values
it also keeps each block's partial attention as the attention kernel computes it (the unrounded
scores at the attention's scale in base 2, the block's max, the sum of P rounded to the values'
dtype, P·V in fp32) at the block's rank -> AACC [rows·G, K, D], AML [rows·G, K, 2], and the dense
part's (its sink/window blocks and visible request-local keys, an online softmax) -> DACC, DML.
`_attend_kernel`, grid (rows, G), merges the dense part and the first `used` candidates (the blocks
the stop kept) by log-sum-exp in rank order -> out [KVH, G, T, D]. A step is then five launches
and no attention launches after them (the split and merge kernels of `decoder/kernels/attention.py`:
six), the same attention up to summation order (the tests: torch_ref over the returned positions,
rel. L2 2.8e-7 fp32, 5.0e-3 bf16). The price: the values of every candidate are read and multiplied,
kept or not (the stop keeps 32-48% of them at rho 5%), so it pays only where launches dominate the
bytes. Measured on the H200 (benchmarks/RESULTS.md, session 24), one 8B layer, rho 5%, B = 1: 32K
27.9 -> 26.3 us, 64K 35.4 -> 34.2, 128K 50.8 -> 54.4 (the sums kernel 7.5 -> 18 us: twice the bytes);
at B = 8 (a batched step, bound by bytes) 56 -> 59 us at 32K. So it runs for one-token plans of at
most `attend_tokens` (4,096) candidate tokens per row, blocks of >= 16 tokens (a block's P·V is a
tl.dot), values in the query's dtype (`attends`), and the runner asks for it only for a request
alone in its step. Tried and slower at 128K (RESULTS.md): per-slot 2-D dots instead of the batched
one, the values loaded after the scores, 2 blocks per program, register caps of 128 and 96 (so not
occupancy: bytes); the merge in the stop kernel's programs (no attend launch) was 1.6 us slower at
32K (the stop 3.5 -> 7.1 us), 0.9 us faster at 64K.

These kernels are bound by latency at decode shapes (a few µs each, little of it memory time), so
each issues the loads of its first chunk together, before any of them is reduced or used to mask
the next: the stop's candidates' sums, ids and its share of the plan row's ids, the sums' candidate
ids and keys (masked by the count once it is known), the select's tile states. Running the stop in
the sums' last program instead of its own launch (a ticket per row) was measured and rejected: one
program storing the whole row is slower than a launch (benchmarks/RESULTS.md).

T > 1 (a question chunk): the same kernels, rows = KVH x T; tokens are planned in chunks of
`x_budget` / (KVH·G·nb) (32 at 128K) per launch sequence, which bounds the workspace (X: 16 MiB).
Each token gathers its own candidates' keys, so the key bytes grow with T (27 MB per token at 128K;
tokens of one chunk share many blocks, which L2 absorbs in part); for T above ~10 a variant that
reads every key once for all tokens (as the torch path's `score_all`) would move fewer bytes; not
written (a question is planned once per request, decode steps are T = 1).

Bytes per plan at a Llama-3.1-8B layer (KVH 8, G 4, D 128, bf16 K, fp16 metadata), 128K context
(nb = 4096 blocks of 32), max_ratio 0.1 (K = 410 candidates = 13120 keys), T = 1 (8 rows):

| kernel | reads | writes | floor at 3 TB/s |
|---|---|---|---|
| crit | metadata min + max 8 x 4096 x 2 x 128 x 2 B = 16.8 MB (mean: 8.4 MB) | X 0.5 MB, PS 16 KB (L2) | 5.6 us |
| select | X + PS 0.5 MB (L2) | keys 128 KB (L2), candidates 26 KB | latency: ~4-6 us |
| sums | K rows 8 x 410 x 32 x 256 B = 26.9 MB + dense part ~0.2 MB; keys for the ranks 1.4 MB (L2) | 0.1 MB | 9.0 us |
| stop | 0.1 MB (L2) | plan 8 x 13184 x 4 B = 0.42 MB, ranked 26 KB | latency: ~2-3 us |
| total | ~44 MB | | ~15 us + the two one-program-per-row kernels |

Flops are small (crit 8 x 4096 x 16 x 256 x 2 = 268 Mflop on tensor cores, padded to 16 query
rows; sums 8 x 13120 x 16 x 128 x 2 = 430 Mflop; the ranks 8 x 410² compares). The select kernel
runs one program per row (8 SMs at T = 1), the stop kernel several per row (each runs the row's
scan and stores a share of its plan row): the select's ~25-30 bisection steps (one block reduction
each), its score pass (16K exp per row) and its compaction are the serial part; when a row's keys
fit one tile of registers (`regs_select`: nb <= 4096 at the 8B shape) they stay there from the
score to the emit, without the scratch round trips. Speed, the kernel profile of a step and what
bounds it: benchmarks/RESULTS.md ("Fused searches", "psa's select in registers", "One round trip
less").

Results against the torch path (what may differ):
* Criticality: the same formulas; on a GPU the dot takes the metadata's dtype (fp16 operands, q
  cast as the torch path casts it, fp32 accumulation) and its result is rounded to that dtype, as
  the torch path's GEMM output; on the CPU (interpreter) both run in fp32. The summation order
  differs from cuBLAS's, so a GPU criticality can round to the neighbouring fp16 value when its fp32
  sum lies within a few ulps of a rounding midpoint (~1e-3 of the values), which can swap two blocks
  whose group scores are within ~0.1 % (the same as two cuBLAS versions would); elsewhere the scores
  differ by fp32 rounding (~1e-7 relative: the softmax normalisation is combined from per-tile
  states, 1/Z is multiplied, the group sum is a tree). Computing both in fp32 instead was measured
  and rejected (benchmarks/RESULTS.md: twice the time, FMAs instead of MMAs, and near-ties still
  swapped), so the fp16 GEMM stays.
* Order and ties: blocks best first, equal scores lowest block id first (a stable descending sort),
  also at the K-th place. The torch path's `torch.sort` leaves the order of ties unspecified; the
  tests give it a stable sort.
* Exact sums: per block (max, sum of exp(x - max)), rescaled to the common max m, which is exactly
  the torch path's m (a max of the same logits; the logits are rounded to the query's dtype as its
  einsum's output). exp(max_b - m)·sum_b differs from the sum of exp(x - m) by a few ulps. (An upper
  bound such as the best block's criticality would save nothing here, and the cuboid bound of
  128-dim keys can exceed the true max logit by tens after scaling: exp(x - bound) would underflow
  for whole blocks and move AS_min.)
* The rule: the same fp32 formulas (cumsum in chunks: another summation order), so P_acc agrees to
  ~1e-6 relative; a stop point moves only where P_acc lies that close to eps at a check.
* Deterministic: no atomics, every reduction in a fixed order: the same inputs give the same plan,
  run to run. Outputs are allocated per call as the torch path's are (a caller may keep plans).
* `ranked` past the candidates is -1 (the torch path: whatever the sort put there).
The tests check equal position sets (and equal rows, order included), equal blocks / used / capped
and the rank order on fp32 and bf16 Gaussian data, every criticality, eps < 1 and = 1, capped and
uncapped, T = 1 and 3, and the tie rule on integer-valued data with duplicated blocks.

Checked without a GPU (Triton 3.6, ahead-of-time compile for sm_90 at the shape above with the JIT's
16-divisibility of pointers and strides, default knobs): no register spills; registers per thread:
crit 114 (cuboid) / 96 (center) / 63 (mean) with 4 warps (96 / 96 / 60 before its loads were reordered in
session 40; 124 / 116 / 80 with a tile each for min and max, before session 37), select 128 (8 warps, block
4096), sums 96 (4 warps, 37 KB shared memory), stop 128 (4 warps); fp32 q/K and metadata (ieee dots) compile
too (crit 166, sums 124, session 23).
Attending (`benchmarks/aot_sass.py step`, session 24): sums 190 registers at 128K / 168 at 32K (72 KB
shared memory), attend 116, no spills.

Workspaces: one float32 and one int32 buffer per device and stream (grow-only, `Workspaces`):
X, PS, the per-candidate sums, the select scratch (keys + ping/pong), candidates, ranks' output.
Every kernel writes what the next one reads before it is read, so no buffer needs zeroing and a
plan never depends on what an earlier (possibly interrupted) plan left there. Stream order makes
reuse safe; a graph captured on a side stream gets its own buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import Workspaces, interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4
from indexer.kernels.ivf import _emit_ranks, _exp, _round_as, _top_threshold, _top_threshold_regs  # shared helpers
from indexer.kernels.pdl import pdl_begin, pdl_launch
from indexer.kernels.stamps import stamp, stamp_args
from indexer.base import BlockList
from indexer.psa import ProgressivePlan, dense_part_blocks

NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # the max of an empty set: finite, so exp(m - m') is never nan
INT_MAX: tl.constexpr = tl.constexpr(2147483647)
KINDS = {"cuboid": 0, "center": 1, "mean": 2}
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_BLOCK_SIZE = 256  # tokens per PSA block a sums program holds (a tile of >= one block)
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _window_start(QPOS, t, n_ctx, s_end, window, bs, nb):
    """(w_lo, first forced window block) of query token t: the window's context part is [w_lo, n_ctx)
    (`indexer.base.frame_bounds`); blocks >= the second are dense-part blocks (nb: none)."""
    qp = tl.load(QPOS + t).to(tl.int32)
    w_lo = tl.minimum(tl.maximum(qp - window + 1, s_end), n_ctx)
    return w_lo, tl.where(w_lo < n_ctx, w_lo // bs, nb)


@triton.jit
def _qk(q, k, LOGIT_DT: tl.constexpr, DOT_FP32: tl.constexpr):
    """q [G_PAD, D] (query dtype), k [N, D] -> q·k in fp32 (k in the query dtype, fp32 accumulation:
    the attention kernel's scores). [G_PAD, N]."""
    if DOT_FP32:  # the interpreter (its bf16 dot is wrong): fp32 operands holding the same values
        kf = _round_as(k.to(tl.float32), LOGIT_DT)
        s = tl.dot(q.to(tl.float32), tl.trans(kf), input_precision="ieee")
    elif LOGIT_DT == tl.float32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(LOGIT_DT)))
    return s


@triton.jit
def _logits(s, qk_scale, LOGIT_DT: tl.constexpr):
    """q·k from `_qk` rounded to the query dtype, times the scale: the torch path's
    `einsum(q, k.to(q.dtype)).float() * scale`. [G_PAD, N] fp32."""
    return _round_as(s, LOGIT_DT) * qk_scale


@triton.jit
def _pv(p, v, AXIS: tl.constexpr, V_DT: tl.constexpr, DOT_FP32: tl.constexpr):
    """The attention kernel's P·V (`decoder/kernels/attention.py`): p [..., M, N] fp32 rounded to the
    values' dtype, v [..., N, D] -> (the row sums of the rounded p [..., M], P·V [..., M, D] fp32); AXIS:
    p's last axis."""
    if DOT_FP32:  # the interpreter: fp32 operands holding the rounded values
        pr = _round_as(p, V_DT)
        return tl.sum(pr, AXIS), tl.dot(pr, v.to(tl.float32), input_precision="ieee")
    elif V_DT == tl.float32:
        return tl.sum(p, AXIS), tl.dot(p, v, input_precision="ieee")
    else:
        pr = p.to(V_DT)
        return tl.sum(pr.to(tl.float32), AXIS), tl.dot(pr, v.to(V_DT))


@triton.jit
def _online(m, l, s, PRECISE: tl.constexpr):
    """Softmax state (max, sum of exp(x - max)) per row of m/l [G_PAD], updated with s [G_PAD, N]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    l = l * _exp(m - m_new, PRECISE) + tl.sum(_exp(s - m_new[:, None], PRECISE), 1)
    return m_new, l


# ---------------------------------------------------------------------------------------------
# 1. criticality


@triton.jit(do_not_specialize=["T", "nb", "n_ctx", "s_end", "window", "n_sb", "bs", "n_bt"])
def _crit_kernel(
    Q, QPOS, META, X, PS,
    sq_h, sq_g, sq_t, sm_h, sm_b, sm_r,
    T, nb, n_ctx, s_end, window, n_sb, bs, n_bt, qk_scale,
    G: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, CDT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr = False, TS=None,
    STAMP: tl.constexpr = False,
):
    """Scaled criticality of BLOCK_B blocks for BLOCK_Q query rows (token, head) of one KV head ->
    X [rows·G, nb] fp32, and per row the softmax state of those blocks that are ranked (not in the
    row's dense part) -> PS [rows·G, n_bt, 2]. (TS / STAMP: `benchmarks/gpu_timeline.py`'s start and end.)"""
    pdl_begin(PDL)
    prog = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    stamp(TS, prog, 0, STAMP)
    bt = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # query rows t·G + g of this KV head
    h = tl.program_id(2).to(tl.int64)
    j_ok = j < T * G
    t = j // G
    g = j % G
    b = bt * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = b < nb
    OPT: tl.constexpr = tl.float32 if DOT_FP32 else CDT
    PREC: tl.constexpr = "ieee" if OPT == tl.float32 else "tf32"
    # The metadata tile in one load, and q's and the query positions' loads issued with it, so that the
    # program waits for memory once where the compiler lets it: a block's min and max rows are adjacent
    # (sm_r == D, the launcher's contract), so cuboid and center read [BLOCK_B, 2D] and take one dot of depth 2D
    # against q⁻ | q⁺. (Two tiles, min then max, cost two round trips: Triton stages each through the same shared
    # memory for the dot, so the max tile's loads were issued only after the min tile had arrived. With one tile,
    # 124 -> 96 registers and the 512 programs at 128K run in one wave, not two; on the H200 the crit's span
    # 10.0 -> 9.2 us, its programs 5.6 -> 7.9 us each: bound by bytes now, the step the same within its
    # spread; benchmarks/RESULTS.md, session 37.)
    # The order of the loads is the SASS's (sm_90, `benchmarks/aot_sass.py step --only _crit_kernel`): the tile
    # loaded first is stored to shared memory for the dot right after its loads, and that store waits for it, so
    # a load written after it is issued only once it has arrived (the tile, then q, then after the dot the
    # positions: three round trips before session 40). The positions first, then for cuboid q before the tile:
    # q's, the positions' and the tile's 20 loads go out together (96 -> 114 registers; one 8B layer at 128K over
    # blocks of 128, the crit 4.4 -> 3.8 us and the step 30.6-30.9 -> 30.3 us on the H200, RESULTS.md, session 40).
    # Center and mean with q before the tile store q before loading the tile (and take 150 / 80 registers instead
    # of 96 / 60), so they load the tile before q: two round trips, the same registers (not timed).
    W: tl.constexpr = D if KIND == 2 else 2 * D
    offs_w = tl.arange(0, W)
    mp = META + h * sm_h + b[:, None].to(tl.int64) * sm_b + offs_w[None, :]
    if KIND == 2:  # the mean row
        mp += 2 * sm_r
    qptr = Q + h * sq_h + g[:, None] * sq_g + t[:, None] * sq_t + (offs_w % D)[None, :]
    qp = tl.load(QPOS + t, mask=j_ok, other=0).to(tl.int32)
    if KIND == 0:
        qv = tl.load(qptr, mask=j_ok[:, None], other=0.0).to(tl.float32)
        mm = tl.load(mp, mask=b_ok[:, None], other=0.0).to(OPT)
    else:
        mm = tl.load(mp, mask=b_ok[:, None], other=0.0).to(OPT)
        qv = tl.load(qptr, mask=j_ok[:, None], other=0.0).to(tl.float32)
    if KIND == 0:  # cuboid: q⁻·min + q⁺·max
        qv = tl.where(offs_w[None, :] < D, tl.minimum(qv, 0.0), tl.maximum(qv, 0.0))
    elif KIND == 1:  # center: (q/2)·min + (q/2)·max
        qv = qv * 0.5
    x = tl.dot(qv.to(CDT).to(OPT), tl.trans(mm), input_precision=PREC)  # KIND 2: q·mean
    x = x.to(CDT).to(tl.float32) * qk_scale  # the GEMM's output dtype (fp16 on a GPU), then the scale
    row = h * T * G + j  # = (kv head · T + t) · G + g
    tl.store(X + row[:, None] * nb + b[None, :], x, mask=j_ok[:, None] & b_ok[None, :])

    w_lo = tl.minimum(tl.maximum(qp - window + 1, s_end), n_ctx)
    first_w = tl.where(w_lo < n_ctx, w_lo // bs, nb)
    ranked = b_ok[None, :] & (b[None, :] >= n_sb) & (b[None, :] < first_w[:, None])
    xm = tl.where(ranked, x, float("-inf"))
    m = tl.maximum(tl.max(xm, 1), NEG_BIG)
    s = tl.sum(_exp(xm - m[:, None], PRECISE), 1)
    ps = PS + (row * n_bt + bt) * 2
    tl.store(ps, m, mask=j_ok)
    tl.store(ps + 1, s, mask=j_ok)
    stamp(TS, prog, 1, STAMP)


# ---------------------------------------------------------------------------------------------
# 2. group score, the B_max best blocks


@triton.jit(do_not_specialize=["T", "nb", "n_ctx", "s_end", "window", "n_sb", "bs", "n_bt", "K", "scr_row",
                               "first_w0", "F"])
def _select_kernel(
    X, PS, QPOS, SCR, CAND, CKEY, NCAND, POS, RANKED, BLOCKS, USED, MASS, CAPPED, LEN,
    sp_h, sp_t, sr_h, sr_t, sb_h, sb_t, sm_h, sm_g, sm_t, sl_h, sl_t,
    T, nb, n_ctx, s_end, window, n_sb, bs, n_bt, K, scr_row, first_w0, F,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
    IN_REGS: tl.constexpr, PRECISE: tl.constexpr, BUDGET: tl.constexpr = False, BLOCK_K: tl.constexpr = 16,
    BLOCK_F: tl.constexpr = 16, PDL: tl.constexpr = False, TS=None,
    STAMP: tl.constexpr = False,
):
    """One program per row (KV head, token): the group score of every ranked block (sum over the
    group's heads of the softmax over blocks) as an int key (float bits + 1; 0 = dense-part block),
    the K best keys (ties: lowest block id), and their block ids and keys in block order ->
    CAND / CKEY [rows, K], their count -> NCAND [rows]. IN_REGS (the row's blocks fit one tile of
    BLOCK keys, and the tile has no element that two threads hold): the keys stay in registers from
    the score to the emit, no scratch round trip. BUDGET (`rule="budget"`): the row's plan itself, the
    candidates' ids emitted into its block list POS [rows, F + K] after the F dense-part ids, the rest
    by `_budget_rest`; no sums or stop kernel follows. TS / STAMP: the
    timeline's stamps (0 start, 2 the states reduced, 3 the keys, 4 the threshold, 5 the emit, 1 end)."""
    pdl_begin(PDL)
    r = tl.program_id(0)
    stamp(TS, r, 0, STAMP)
    t = r % T
    ar_g = tl.arange(0, G_PAD)
    g_ok = ar_g < G
    hrow = r.to(tl.int64) * G + ar_g  # X / PS rows of the group's heads

    # The first chunk of the tiles' states (maxima and sums) is loaded once, before either is
    # reduced: one round trip to L2 where the row's tiles fit one chunk (32K and 128K at the 8B
    # shape), instead of one for the maxima and another for the sums (same values, same arithmetic).
    ar_p = tl.arange(0, BLOCK_P)
    msk0 = g_ok[:, None] & (ar_p < n_bt)[None, :]
    m0 = tl.load(PS + (hrow[:, None] * n_bt + ar_p[None, :]) * 2, mask=msk0, other=NEG_BIG)
    s0 = tl.load(PS + (hrow[:, None] * n_bt + ar_p[None, :]) * 2 + 1, mask=msk0, other=0.0)
    _, first_w = _window_start(QPOS, t, n_ctx, s_end, window, bs, nb)

    # softmax normalisation per head from the criticality programs' states (fixed order)
    m_all = tl.max(m0, 1)
    for c0 in range(BLOCK_P, n_bt, BLOCK_P):
        i = c0 + ar_p
        msk = g_ok[:, None] & (i < n_bt)[None, :]
        m = tl.load(PS + (hrow[:, None] * n_bt + i[None, :]) * 2, mask=msk, other=NEG_BIG)
        m_all = tl.maximum(m_all, tl.max(m, 1))
    z = tl.sum(s0 * _exp(m0 - m_all[:, None], PRECISE), 1)
    for c0 in range(BLOCK_P, n_bt, BLOCK_P):
        i = c0 + ar_p
        msk = g_ok[:, None] & (i < n_bt)[None, :]
        m = tl.load(PS + (hrow[:, None] * n_bt + i[None, :]) * 2, mask=msk, other=NEG_BIG)
        s = tl.load(PS + (hrow[:, None] * n_bt + i[None, :]) * 2 + 1, mask=msk, other=0.0)
        z += tl.sum(s * _exp(m - m_all[:, None], PRECISE), 1)
    inv_z = tl.div_rn(1.0 + 0.0 * z, tl.where(z > 0, z, 1.0))
    stamp(TS, r, 2, STAMP)

    out = r.to(tl.int64) * K
    if BUDGET:  # the candidates' ids go straight to the plan's block list, after the row's F dense-part ids
        h = (r // T).to(tl.int64)
        ids = POS + h * sp_h + t * sp_t
        cand = ids + F
    else:
        cand = CAND + out
    if IN_REGS:
        blk = tl.arange(0, BLOCK)
        kreg = _group_keys(X, hrow, g_ok, blk, nb, n_sb, first_w, m_all, inv_z, PRECISE)
        n_valid = tl.sum((kreg > 0).to(tl.int32), 0)
        key_min = tl.min(tl.where(kreg > 0, kreg, INT_MAX), 0)
        key_max = tl.max(kreg, 0)
        stamp(TS, r, 3, STAMP)
        thr, take = _top_threshold_regs(kreg, nb, K, key_min, n_valid, key_max + 1)
        stamp(TS, r, 4, STAMP)
        n_gt, n_eq = _emit_keys(kreg, blk, thr, take, r * 0, r * 0, cand, CKEY + out)
        n_cand = n_gt + tl.minimum(n_eq, take)
    else:
        row = SCR + r.to(tl.int64) * scr_row
        for c0 in range(0, nb, BLOCK_C):
            b = c0 + tl.arange(0, BLOCK_C)
            tl.store(row + b, _group_keys(X, hrow, g_ok, b, nb, n_sb, first_w, m_all, inv_z, PRECISE), mask=b < nb)
        tl.debug_barrier()  # the keys' stores before other threads read them
        # The count and range of the keys from the stored keys, which every thread reads alike. (Where
        # a tile is smaller than the CTA, elements are replicated over threads, and the copies of a
        # float reduction's result (m_all, inv_z) may differ in the last bit between threads: on an H100
        # with tiny test tiles, threads then disagreed about key_min / key_max, took different branches
        # of the threshold search and emitted more than K candidates. Read back, they agree.)
        n_valid = r * 0
        key_min = r * 0 + INT_MAX
        key_max = r * 0
        for c0 in range(0, nb, BLOCK_C):
            b = c0 + tl.arange(0, BLOCK_C)
            key = tl.load(row + b, mask=b < nb, other=0)
            n_valid += tl.sum((key > 0).to(tl.int32), 0)
            key_min = tl.minimum(key_min, tl.min(tl.where(key > 0, key, INT_MAX), 0))
            key_max = tl.maximum(key_max, tl.max(key, 0))
        stamp(TS, r, 3, STAMP)
        thr, take = _top_threshold(row, nb, K, key_min, n_valid, key_max + 1, BLOCK)
        stamp(TS, r, 4, STAMP)
        gt_base = r * 0
        eq_base = r * 0
        for c0 in range(0, nb, BLOCK):
            o = c0 + tl.arange(0, BLOCK)
            key = tl.load(row + o, mask=o < nb, other=0)
            gt_base, eq_base = _emit_keys(key, o, thr, take, gt_base, eq_base, cand, CKEY + out)
        n_cand = gt_base + tl.minimum(eq_base, take)
    stamp(TS, r, 5, STAMP)
    if BUDGET:
        _budget_rest(ids, n_cand, n_valid, h, t, QPOS, BLOCKS, USED, MASS, CAPPED, LEN,
                     sb_h, sb_t, sm_h, sm_g, sm_t, sl_h, sl_t, n_ctx, nb, K, s_end, window, n_sb, first_w0, F, bs,
                     G, G_PAD, BLOCK_K, BLOCK_F)
    else:
        tl.store(NCAND + r, n_cand)
    stamp(TS, r, 1, STAMP)


@triton.jit
def _budget_rest(IDS, n_cand, n_ranked, h, t, QPOS, BLOCKS, USED, MASS, CAPPED, LEN,
                 sb_h, sb_t, sm_h, sm_g, sm_t, sl_h, sl_t, n_ctx, nb, K, s_end, window, n_sb, first_w0, F, bs,
                 G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr):
    """The rest of a row's budget plan (`rule="budget"`) once the emit stored its n_cand candidates at
    IDS[F:] (block order): the stop kernel's outputs for a rule that keeps every candidate (the torch
    path's `_plan_of`): counts, capped (fewer candidates than ranked blocks), no P_acc (NaN), and the
    block list's other ids: the F dense-part blocks first (sink blocks, then the blocks from first_w0
    on that are this query's: >= first_w; -1 for the others), -1 past the candidates. Each store
    goes to a slot the emit left alone: no barrier, nothing read back."""
    ar_g = tl.arange(0, G_PAD)
    tl.store(BLOCKS + h * sb_h + t * sb_t, (n_cand + nb - n_ranked).to(tl.int64))
    tl.store(USED + h * sb_h + t * sb_t, n_cand.to(tl.int64))
    tl.store(CAPPED + h * sb_h + t * sb_t, ((n_cand > 0) & (n_cand < n_ranked)).to(tl.int8))
    tl.store(LEN + h * sl_h + t * sl_t, ((F + n_cand) * bs).to(tl.int32))
    tl.store(MASS + h * sm_h + ar_g * sm_g + t * sm_t, tl.full([G_PAD], float("nan"), tl.float32), mask=ar_g < G)
    _, first_w = _window_start(QPOS, t, n_ctx, s_end, window, bs, nb)
    ar_f = tl.arange(0, BLOCK_F)
    for c0 in range(0, F, BLOCK_F):
        f = c0 + ar_f
        bid = tl.where(f < n_sb, f, first_w0 + f - n_sb)
        tl.store(IDS + f, tl.where((bid < n_sb) | (bid >= first_w), bid, -1), mask=f < F)
    ar_k = tl.arange(0, BLOCK_K)
    for c0 in range(0, K, BLOCK_K):
        i = c0 + ar_k
        tl.store(IDS + F + i, tl.full([BLOCK_K], -1, tl.int32), mask=(i >= n_cand) & (i < K))


@triton.jit
def _store_dense_part(pos, F, bs, n_sb, first_w0, first_w, s_end, w_lo, BLOCK_P: tl.constexpr):
    """A plan row's first F·bs slots: the tokens of the row's dense-part blocks (sink blocks, then the
    blocks from first_w0 on that are this query's: >= first_w) outside the frame [0, s_end) ∪ [w_lo, ..),
    -1 elsewhere."""
    ar_p = tl.arange(0, BLOCK_P)
    for c0 in range(0, F * bs, BLOCK_P):
        u = c0 + ar_p
        f = u // bs
        bid = tl.where(f < n_sb, f, first_w0 + f - n_sb)
        tok = bid * bs + u % bs
        sel = ((bid < n_sb) | (bid >= first_w)) & (tok >= s_end) & (tok < w_lo)
        tl.store(pos + u, tl.where(sel, tok, -1), mask=u < F * bs)


@triton.jit
def _group_keys(X, hrow, g_ok, b, nb, n_sb, first_w, m_all, inv_z, PRECISE: tl.constexpr):
    """Int keys of blocks b: the group score (sum over the group's heads of the softmax over blocks,
    from the criticality X and the per-head max / 1/Z) as float bits + 1 (scores are >= 0, so the
    bits keep the order); 0 for a dense-part block or b >= nb. (16-byte loads of X's rows, with the
    row stride specialised and the load masked by nb alone, were measured and dropped: the keys'
    layout they bring makes the emit longer than the loads save, benchmarks/RESULTS.md.)"""
    ranked = (b < nb) & (b >= n_sb) & (b < first_w)
    x = tl.load(X + hrow[:, None] * nb + b[None, :], mask=g_ok[:, None] & ranked[None, :], other=float("-inf"))
    score = tl.sum(_exp(x - m_all[:, None], PRECISE) * inv_z[:, None], 0)
    return tl.where(ranked, score.to(tl.int32, bitcast=True) + 1, 0)


@triton.jit
def _emit_keys(key, b, thr, take, gt_base, eq_base, CAND, CKEY):
    """One tile of the selection (thr, take) in block order (`ivf._emit_ranks`: the counts gt_base /
    eq_base of the tiles before, one scan): block ids and keys to CAND / CKEY at their ranks.
    Returns (gt_base, eq_base) after the tile."""
    w, at, gt_base, eq_base = _emit_ranks(key, thr, take, gt_base, eq_base)
    tl.store(CAND + at, b, mask=w)
    tl.store(CKEY + at, key, mask=w)
    return gt_base, eq_base


# ---------------------------------------------------------------------------------------------
# 3. exact sums: the candidates (in rank order) and the dense part


@triton.jit(do_not_specialize=["T", "n_ctx", "n_loc", "nb", "K", "s_end", "window", "n_sb", "first_w0", "F", "bs",
                               "n_st"])
def _sums_kernel(
    Q, CK, LK, QPOS, CAND, CKEY, NCAND, SID, SMX, SSM, DMX, DSM,
    CV, LV, AACC, AML, DACC, DML,
    sq_h, sq_g, sq_t, sck_h, sck_n, slk_h, slk_n, scv_h, scv_n, slv_h, slv_n,
    T, n_ctx, n_loc, nb, K, s_end, window, n_sb, first_w0, F, bs, n_st, qk_scale, att_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS_PAD: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_DT: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISE: tl.constexpr, ATTEND: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Programs 0 .. n_st - 1 of a row: SLOTS candidate blocks each. A candidate's rank in the
    order (key desc, block id asc) is the count of candidates before it (the row's K keys, from
    L2); its block's keys are read once for the group's heads, and (block id, max, sum of exp(x -
    max) per head) are written to slot `rank` -> SID [rows, K], SMX / SSM [rows·G, K]. Program
    n_st: the same state over the dense part (the row's sink/window blocks, its visible
    request-local keys) -> DMX / DSM [rows·G].

    ATTEND (the plan's attention, `progressive_plan(attend_scale=)`): with the same scores, unrounded
    and at the attention's scale (att_scale = scale · log2 e), each candidate block's partial
    attention as the attention kernel computes it (base-2 max, the sum of P rounded to the values'
    dtype, P·V) -> AACC [rows·G, K, D] and AML [rows·G, K, 2] at the block's rank, and the dense
    part's -> DACC [rows·G, D], DML [rows·G, 2]; `_attend_kernel` merges those the stop kept."""
    pdl_begin(PDL)
    s = tl.program_id(0)
    r = tl.program_id(1)
    h = (r // T).to(tl.int64)
    t = r % T
    ar_g = tl.arange(0, G_PAD)
    g_ok = ar_g < G
    offs_d = tl.arange(0, D)
    q = tl.load(Q + h * sq_h + ar_g[:, None] * sq_g + t * sq_t + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    n_cand = tl.load(NCAND + r)
    row = r.to(tl.int64) * K
    hrow = r.to(tl.int64) * G + ar_g
    if s < n_st:
        i0 = s * SLOTS
        # this program's candidates and the first chunk of the row's keys are loaded with the count,
        # not after it (the slots up to K, masked by the count once it is known): the K rows' gather
        # starts one round trip to L2 sooner
        u = tl.arange(0, SLOTS * BS_PAD)
        us = i0 + u // BS_PAD
        ua = u % BS_PAD
        bid = tl.load(CAND + row + us, mask=us < K, other=0)
        sl = i0 + tl.arange(0, SLOTS)
        key_i = tl.load(CKEY + row + sl, mask=sl < K, other=0)
        jr = tl.arange(0, BLOCK_R)
        kj0 = tl.load(CKEY + row + jr, mask=jr < K, other=0)
        if i0 < n_cand:
            tok = bid * bs + ua
            ok = (us < n_cand) & (ua < bs) & (tok < n_ctx)
            k = tl.load(CK + h * sck_h + tok[:, None].to(tl.int64) * sck_n + offs_d[None, :], mask=ok[:, None],
                        other=0.0)  # in flight while the rank is counted
            if ATTEND:  # with the keys, before the rank is counted
                v = tl.load(CV + h * scv_h + tok[:, None].to(tl.int64) * scv_n + offs_d[None, :], mask=ok[:, None],
                            other=0.0)
            sl_ok = sl < n_cand
            key_i = tl.where(sl_ok, key_i, 0)
            rank = _before(kj0, jr, key_i, sl, n_cand)
            for c0 in range(BLOCK_R, n_cand, BLOCK_R):
                jj = c0 + jr
                rank += _before(tl.load(CKEY + row + jj, mask=jj < n_cand, other=0), jj, key_i, sl, n_cand)
            qk = _qk(q, k, LOGIT_DT, DOT_FP32)
            x = tl.where(ok[None, :], _logits(qk, qk_scale, LOGIT_DT), float("-inf"))
            x3 = tl.reshape(x, (G_PAD, SLOTS, BS_PAD))
            mb = tl.maximum(tl.max(x3, 2), NEG_BIG)  # [G_PAD, SLOTS]
            lb = tl.sum(_exp(x3 - mb[:, :, None], PRECISE), 2)
            ids = tl.load(CAND + row + sl, mask=sl_ok, other=0)
            tl.store(SID + row + rank, ids, mask=sl_ok)
            msk = g_ok[:, None] & sl_ok[None, :]
            tl.store(SMX + hrow[:, None] * K + rank[None, :], mb, mask=msk)
            tl.store(SSM + hrow[:, None] * K + rank[None, :], lb, mask=msk)
            if ATTEND:  # per block: [SLOTS] x ([G_PAD, BS_PAD] · [BS_PAD, D]), one batched dot
                a3 = tl.reshape(tl.where(ok[None, :], qk * att_scale, float("-inf")), (G_PAD, SLOTS, BS_PAD))
                ma = tl.maximum(tl.max(a3, 2), NEG_BIG)  # [G_PAD, SLOTS]
                p3 = tl.permute(tl.math.exp2(a3 - ma[:, :, None]), (1, 0, 2))  # [SLOTS, G_PAD, BS_PAD]
                la, pv = _pv(p3, tl.reshape(v, (SLOTS, BS_PAD, D)), 2, LOGIT_DT, DOT_FP32)  # [SLOTS, G_PAD (, D)]
                at = hrow[None, :] * K + rank[:, None]  # [SLOTS, G_PAD]
                msk_t = sl_ok[:, None] & g_ok[None, :]
                tl.store(AACC + at[:, :, None] * D + offs_d[None, None, :], pv, mask=msk_t[:, :, None])
                tl.store(AML + at * 2, tl.trans(ma), mask=msk_t)
                tl.store(AML + at * 2 + 1, la, mask=msk_t)
    else:
        _, first_w = _window_start(QPOS, t, n_ctx, s_end, window, bs, nb)
        qp = tl.load(QPOS + t).to(tl.int32)
        m = tl.full([G_PAD], NEG_BIG, tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        m2 = tl.full([G_PAD], NEG_BIG, tl.float32)  # ATTEND: the attention's state (base 2)
        l2 = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for c0 in range(0, F * BS_PAD, BLOCK_N):  # the dense-part blocks that are this token's
            u = c0 + tl.arange(0, BLOCK_N)
            f = u // BS_PAD
            a = u % BS_PAD
            bid = tl.where(f < n_sb, f, first_w0 + f - n_sb)
            tok = bid * bs + a
            ok = (f < F) & (a < bs) & (tok < n_ctx) & ((bid < n_sb) | (bid >= first_w))
            k = tl.load(CK + h * sck_h + tok[:, None].to(tl.int64) * sck_n + offs_d[None, :], mask=ok[:, None],
                        other=0.0)
            qk = _qk(q, k, LOGIT_DT, DOT_FP32)
            x = tl.where(ok[None, :], _logits(qk, qk_scale, LOGIT_DT), float("-inf"))
            m, l = _online(m, l, x, PRECISE)
            if ATTEND:
                v = tl.load(CV + h * scv_h + tok[:, None].to(tl.int64) * scv_n + offs_d[None, :],
                            mask=ok[:, None], other=0.0)
                m2, l2, acc = _attend_online(m2, l2, acc, tl.where(ok[None, :], qk * att_scale, float("-inf")), v,
                                             LOGIT_DT, DOT_FP32)
        n_vis = tl.minimum(n_loc, qp - n_ctx + 1)  # request-local slots j with n_ctx + j <= q_pos
        for c0 in range(0, n_vis, BLOCK_N):
            jj = c0 + tl.arange(0, BLOCK_N)
            ok = jj < n_vis
            k = tl.load(LK + h * slk_h + jj[:, None].to(tl.int64) * slk_n + offs_d[None, :], mask=ok[:, None],
                        other=0.0)
            qk = _qk(q, k, LOGIT_DT, DOT_FP32)
            x = tl.where(ok[None, :], _logits(qk, qk_scale, LOGIT_DT), float("-inf"))
            m, l = _online(m, l, x, PRECISE)
            if ATTEND:
                v = tl.load(LV + h * slv_h + jj[:, None].to(tl.int64) * slv_n + offs_d[None, :], mask=ok[:, None],
                            other=0.0)
                m2, l2, acc = _attend_online(m2, l2, acc, tl.where(ok[None, :], qk * att_scale, float("-inf")), v,
                                             LOGIT_DT, DOT_FP32)
        tl.store(DMX + hrow, m, mask=g_ok)
        tl.store(DSM + hrow, l, mask=g_ok)
        if ATTEND:
            tl.store(DACC + hrow[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])
            tl.store(DML + hrow * 2, m2, mask=g_ok)
            tl.store(DML + hrow * 2 + 1, l2, mask=g_ok)


@triton.jit
def _attend_online(m, l, acc, s, v, V_DT: tl.constexpr, DOT_FP32: tl.constexpr):
    """The attention kernel's online softmax step (base 2): state (m, l [G_PAD], acc [G_PAD, D])
    updated with scores s [G_PAD, N] (-inf = masked) and values v [N, D]."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    ls, pv = _pv(tl.math.exp2(s - m_new[:, None]), v, 1, V_DT, DOT_FP32)
    return m_new, l * alpha + ls, acc * alpha[:, None] + pv


@triton.jit
def _before(kj, jj, key_i, sl, n_cand):
    """Per candidate i (key key_i, slot sl): how many of the keys kj (slots jj) precede it in the
    order (key desc, block id asc); slots are in block order, and slots past n_cand count as 0 (below
    every candidate: what they hold is stale)."""
    kj = tl.where(jj < n_cand, kj, 0)
    eq = (kj[None, :] == key_i[:, None]) & (jj[None, :] < sl[:, None])
    return tl.sum(((kj[None, :] > key_i[:, None]) | eq).to(tl.int32), 1)


# ---------------------------------------------------------------------------------------------
# 4. the stop rule and the plan


@triton.jit(do_not_specialize=["T", "n_ctx", "nb", "K", "s_end", "window", "n_sb", "first_w0", "F", "bs",
                               "microbatch"])
def _stop_kernel(
    SID, SMX, SSM, DMX, DSM, NCAND, QPOS, POS, RANKED, BLOCKS, USED, MASS, CAPPED, LEN,
    sp_h, sp_t, sr_h, sr_t, sb_h, sb_t, sm_h, sm_g, sm_t, sl_h, sl_t,
    T, n_ctx, nb, K, s_end, window, n_sb, first_w0, F, bs, microbatch, eps,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, EXACT: tl.constexpr,
    PRECISE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Programs (part, row): AS_acc, AS_min, P_acc over the ranked candidates (cumulative, in chunks
    of BLOCK with carries), the first check where every head has P_acc >= eps, and the row's
    outputs: positions, ranked block ids, blocks / used counts, P_acc at the stop, capped, and the
    row's filled length (F + used)·bs (`Plan.lengths`: the slots past it are -1). Every part of a
    row runs the same scan (same inputs, same order: the same stop); part 0 writes the row's
    counts, ranked ids and dense part, and the parts share the stores of the ranked blocks' tokens
    (one chunk each at 128K instead of one program's ~13 dependent load-and-store rounds)."""
    pdl_begin(PDL)
    part = tl.program_id(0)
    n_parts = tl.num_programs(0)
    r = tl.program_id(1)
    h = (r // T).to(tl.int64)
    t = r % T
    ar_g = tl.arange(0, G_PAD)
    g_ok = ar_g < G
    hrow = r.to(tl.int64) * G + ar_g
    row = r.to(tl.int64) * K
    ar = tl.arange(0, BLOCK)
    ar_p = tl.arange(0, BLOCK_P)

    # Every load of the first chunks is issued at once, before the count of candidates is known (the
    # slots up to K, then masked by n_cand): the chain from launch to the plan's stores is one round
    # trip to L2 where the candidates fit one chunk (K <= BLOCK: 32K and 128K at the 8B shape) and
    # this part's slots one store chunk, instead of one per dependent step (count, max, scan, ids).
    n_cand = tl.load(NCAND + r)
    w_lo, first_w = _window_start(QPOS, t, n_ctx, s_end, window, bs, nb)
    dm = tl.load(DMX + hrow, mask=g_ok, other=NEG_BIG)
    dsum = tl.load(DSM + hrow, mask=g_ok, other=0.0)
    k_msk = g_ok[:, None] & (ar < K)[None, :]
    mx_n = tl.load(SMX + hrow[:, None] * K + ar[None, :], mask=k_msk, other=NEG_BIG)  # chunk 0 of the scan
    sm_n = tl.load(SSM + hrow[:, None] * K + ar[None, :], mask=k_msk, other=0.0)
    bid_n = tl.load(SID + row + ar, mask=ar < K, other=0)
    u_p = part * BLOCK_P + ar_p  # this part's first chunk of plan slots: their block ids
    bid_p = tl.load(SID + row + u_p // bs, mask=u_p < K * bs, other=0)
    n_forced = n_sb + tl.maximum(nb - tl.maximum(first_w, n_sb), 0)
    n_ranked = nb - n_forced

    # the common max m of every processed logit (the torch path's), per head
    mx_n = tl.where(g_ok[:, None] & (ar < n_cand)[None, :], mx_n, NEG_BIG)  # slots past n_cand: stale
    m = tl.maximum(dm, tl.max(mx_n, 1))
    for c0 in range(BLOCK, n_cand, BLOCK):
        i = c0 + ar
        mx = tl.load(SMX + hrow[:, None] * K + i[None, :], mask=g_ok[:, None] & (i < n_cand)[None, :], other=NEG_BIG)
        m = tl.maximum(m, tl.max(mx, 1))
    acc_c = dsum * _exp(dm - m, PRECISE)  # AS_acc before any ranked block
    min_c = tl.full([G_PAD], float("inf"), tl.float32)
    p_at = tl.full([G_PAD], 1.0, tl.float32)
    bid0 = tl.where(ar < n_cand, bid_n, -1)  # chunk 0's ranked ids (the RANKED store below)
    first = n_cand
    found = n_cand * 0
    c0 = n_cand * 0
    while (c0 < n_cand) & (found == 0):
        i = c0 + ar
        ok = i < n_cand
        msk = g_ok[:, None] & ok[None, :]
        mx = mx_n
        sm = sm_n
        bid = bid_n
        ts = tl.where(msk, sm * _exp(mx - m[:, None], PRECISE), 0.0)  # AS of each block at the common max
        acc = acc_c[:, None] + tl.cumsum(ts, 1)
        cnt = tl.minimum((bid + 1) * bs, n_ctx) - bid * bs
        bs_f = (cnt * 0 + bs).to(tl.float32)
        full = tl.where(cnt == bs, 1.0, tl.div_rn(bs_f, tl.maximum(cnt, 1).to(tl.float32)))  # partial block
        am = tl.where(msk, ts * full[None, :], float("inf"))
        am = tl.minimum(min_c[:, None], tl.associative_scan(am, 1, _min_combine))
        done = i + 1
        n_left = tl.maximum(n_ranked - done, 0)
        rest = tl.where(msk & (n_left[None, :] > 0), tl.where(msk, am, 0.0) * n_left.to(tl.float32)[None, :], 0.0)
        p = tl.where(rest > 0, tl.div_rn(acc, tl.where(rest > 0, acc + rest, 1.0)), 1.0)
        if EXACT:
            head_ok = (n_left <= 0)[None, :] | (p < 0)
        else:
            head_ok = p >= eps
        all_ok = tl.min((head_ok | ~g_ok[:, None]).to(tl.int32), 0) > 0
        check = ((done % microbatch) == 0) | (done == K) | (done == n_ranked)
        stop = all_ok & check & ok
        fst = tl.min(tl.where(stop, i, INT_MAX), 0)
        found = (fst < INT_MAX).to(tl.int32)
        at = tl.where(found != 0, fst, n_cand - 1)  # P_acc reported: at the stop, else after the last block
        in_chunk = (at >= c0) & (at < c0 + BLOCK)
        p_at = tl.where(in_chunk, tl.sum(tl.where(i[None, :] == at, p, 0.0), 1), p_at)
        first = tl.where(found != 0, fst, first)
        acc_c = tl.max(acc, 1)  # cumsums of sums >= 0 never decrease: the max is the last
        min_c = tl.min(am, 1)
        c0 += BLOCK
        # the next chunk (masked off, so no traffic, when the scan ends here)
        i = c0 + ar
        nxt = (i < n_cand) & (found == 0)
        mx_n = tl.load(SMX + hrow[:, None] * K + i[None, :], mask=g_ok[:, None] & nxt[None, :], other=NEG_BIG)
        sm_n = tl.load(SSM + hrow[:, None] * K + i[None, :], mask=g_ok[:, None] & nxt[None, :], other=0.0)
        bid_n = tl.load(SID + row + i, mask=nxt, other=0)
    used = tl.where(found != 0, first + 1, n_cand)
    pos = POS + h * sp_h + t * sp_t
    if part == 0:
        tl.store(BLOCKS + h * sb_h + t * sb_t, (used + n_forced).to(tl.int64))
        tl.store(USED + h * sb_h + t * sb_t, used.to(tl.int64))
        tl.store(CAPPED + h * sb_h + t * sb_t, ((found == 0) & (n_cand > 0)).to(tl.int8))
        tl.store(LEN + h * sl_h + t * sl_t, ((F + used) * bs).to(tl.int32))
        tl.store(MASS + h * sm_h + ar_g * sm_g + t * sm_t, tl.where(used > 0, p_at, 1.0), mask=g_ok)
        tl.store(RANKED + h * sr_h + t * sr_t + ar, bid0.to(tl.int64), mask=ar < K)
        for c0 in range(BLOCK, K, BLOCK):
            i = c0 + ar
            bid = tl.load(SID + row + i, mask=i < n_cand, other=-1)
            tl.store(RANKED + h * sr_h + t * sr_t + i, bid.to(tl.int64), mask=i < K)
        _store_dense_part(pos, F, bs, n_sb, first_w0, first_w, s_end, w_lo, BLOCK_P)
    pos += F * bs
    # the processed ranked blocks, best first: this part's first chunk from the ids loaded up front
    i = u_p // bs
    tok = bid_p * bs + u_p % bs
    tl.store(pos + u_p, tl.where((i < used) & (tok < n_ctx), tok, -1), mask=u_p < K * bs)
    for c0 in range((part + n_parts) * BLOCK_P, K * bs, n_parts * BLOCK_P):
        u = c0 + ar_p
        i = u // bs
        bid = tl.load(SID + row + i, mask=i < used, other=0)
        tok = bid * bs + u % bs
        tl.store(pos + u, tl.where((i < used) & (tok < n_ctx), tok, -1), mask=u < K * bs)


# ---------------------------------------------------------------------------------------------
# 5. the plan's attention (ATTEND)


@triton.jit(do_not_specialize=["T", "K"])
def _attend_kernel(
    AACC, AML, DACC, DML, USED, OUT,
    sb_h, sb_t, so_h, so_g, so_t,
    T, K,
    G: tl.constexpr, D: tl.constexpr, BLOCK_I: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (row, head): the attention over the row's dense part and its first `used` candidates
    (the blocks the stop kept, in rank order), a log-sum-exp merge of their partial states in that
    fixed order -> OUT [KVH, G, T, D] in its dtype."""
    pdl_begin(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    h = (r // T).to(tl.int64)
    t = r % T
    hr = r.to(tl.int64) * G + g
    offs_d = tl.arange(0, D)
    ar = tl.arange(0, BLOCK_I)
    # the count, the dense part and the first chunk of candidates are loaded at once (the chunk masked
    # by K, then by the count once it is known): one round trip to L2 where the kept blocks fit a chunk
    used = tl.load(USED + h * sb_h + t * sb_t).to(tl.int32)
    m = tl.load(DML + hr * 2)
    l = tl.load(DML + hr * 2 + 1)
    acc = tl.load(DACC + hr * D + offs_d)
    mi = tl.load(AML + (hr * K + ar) * 2, mask=ar < K, other=NEG_BIG)
    li = tl.load(AML + (hr * K + ar) * 2 + 1, mask=ar < K, other=0.0)
    ai = tl.load(AACC + (hr * K + ar)[:, None] * D + offs_d[None, :], mask=(ar < K)[:, None], other=0.0)
    for c0 in range(0, used, BLOCK_I):
        ok = c0 + ar < used  # the first chunk was loaded up to K: its slots past the count hold what an
        mi = tl.where(ok, mi, NEG_BIG)  # earlier plan left (a NaN there times a zero weight is NaN)
        m_new = tl.maximum(m, tl.max(mi, 0))
        w = tl.where(ok, tl.math.exp2(mi - m_new), 0.0)
        alpha = tl.math.exp2(m - m_new)
        l = l * alpha + tl.sum(tl.where(ok, w * li, 0.0), 0)
        acc = acc * alpha + tl.sum(tl.where(ok[:, None], w[:, None] * ai, 0.0), 0)
        m = m_new
        i = c0 + BLOCK_I + ar  # the next chunk (masked off past the count: no traffic)
        mi = tl.load(AML + (hr * K + i) * 2, mask=i < used, other=NEG_BIG)
        li = tl.load(AML + (hr * K + i) * 2 + 1, mask=i < used, other=0.0)
        ai = tl.load(AACC + (hr * K + i)[:, None] * D + offs_d[None, :], mask=(i < used)[:, None], other=0.0)
    out = tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)
    tl.store(OUT + h * so_h + g * so_g + t * so_t + offs_d, out.to(OUT.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Launch configuration and workspaces (host ints from shapes only)


@dataclass(frozen=True)
class PsaConfig:
    """Tuning knobs (reasoned defaults, not swept on a GPU; tests swap in tiny ones)."""

    block_b: int = 64  # crit: blocks per program
    block_q: int = 16  # crit: query rows (token, head) per program (>= 16: a tl.dot)
    crit_warps: int = 4
    score_block: int = 1024  # select: blocks per chunk of the score pass
    select_block: int = 4096  # select: keys the threshold search holds in registers (larger rows: L2 passes)
    select_warps: int = 8
    plan_block: int = 1024  # select, rule "budget": block ids per store chunk (a power of two; one chunk at 512K)
    pdl: bool = True  # programmatic dependent launch on Hopper and later (`indexer/kernels/pdl.py`)
    regs_select: bool = True  # select: keep a row's keys in registers when they fit (False: the scratch path)
    regs_scores: int = 16384  # select: most G_PAD x BLOCK scores the in-register path holds
    tile_tokens: int = 128  # sums: key rows per program (whole blocks: 4 of 32)
    rank_block: int = 512  # sums: candidate keys per compare chunk of the rank
    dense_block: int = 64  # sums: key rows per chunk of the dense part
    sums_warps: int = 4
    scan_block: int = 512  # stop: candidates per chunk of the cumulative scan
    pos_block: int = 1024  # stop: plan slots per store
    stop_warps: int = 4
    stop_parts: int = 16  # stop: programs per row sharing the plan row's stores
    attend: bool = True  # the plan's attention when the caller asks (`attend_scale`) and it pays; False: never
    attend_tokens: int = 4096  # ... it pays while the candidates hold at most this many tokens per row (module doc)
    attend_block: int = 64  # attend: kept blocks per merge chunk
    attend_warps: int = 4
    x_budget: int = 1 << 22  # most criticality floats in the workspace: T is planned in chunks beyond it


DEFAULT_CONFIG = PsaConfig()

_WORKSPACES = Workspaces()


def clear_workspace() -> None:
    _WORKSPACES.clear()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def unsupported(q: torch.Tensor, meta: torch.Tensor, block_size: int) -> list[str]:
    """Reasons the fused plan cannot run here (empty = fine); the planner then keeps the torch path."""
    reasons = []
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim {q.shape[-1]} is not supported by the fused PSA plan (powers of two 16..256)")
    if block_size > MAX_BLOCK_SIZE:
        reasons.append(f"block_size {block_size} is beyond the fused PSA plan's tile ({MAX_BLOCK_SIZE})")
    if meta.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(f"block metadata of dtype {meta.dtype} is not supported by the fused PSA plan")
    if q.device.type != "cuda" and not interpreted():
        reasons.append("the fused PSA plan needs CUDA tensors (or TRITON_INTERPRET=1)")
    if os.environ.get("CTXCACHE_FUSED_PSA", "1") == "0":
        reasons.append("the fused PSA plan is switched off (CTXCACHE_FUSED_PSA=0)")
    return reasons


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _carve(get, device: torch.device, dtype: torch.dtype, tag: str = "psa", **sizes: int) -> dict[str, torch.Tensor]:
    """Consecutive views of one grow-only workspace buffer (`Workspaces.get`), one per named size."""
    buf = get(device, tag, sum(sizes.values()), dtype)
    out, at = {}, 0
    for name, size in sizes.items():
        out[name] = buf[at:at + size]
        at += size
    return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def progressive_plan(
    q: torch.Tensor,  # [KVH, G, T, D]
    ctx_k: torch.Tensor,  # [KVH, N, D]
    loc_k: torch.Tensor,  # [KVH, M, D]
    q_pos: torch.Tensor,  # [T]
    meta: torch.Tensor,  # [KVH, blocks, 3, D]
    block_size: int,
    *,
    eps: float,
    microbatch: int,
    sink: int,
    window: int,
    max_blocks: int,
    criticality: str = "cuboid",
    rule: str = "progressive",
    cfg: PsaConfig | None = None,
    ctx_v: torch.Tensor | None = None,  # [KVH, N, D]: with loc_v and attend_scale, the plan's attention too
    loc_v: torch.Tensor | None = None,  # [KVH, M, D]
    attend_scale: float | None = None,
) -> ProgressivePlan:
    """`indexer.psa.progressive_plan` in four launches (two with rule "budget") per chunk of query tokens
    (one chunk unless T is large); same arguments (no `score_all`: the fused plan never scores every key), same
    result (module docstring: what may differ). No host sync; allocates only the outputs.

    With `attend_scale` (and the values), a one-token plan also attends: `out` is the attention of q
    over the frame and the plan's positions at that scale (`attends`: when it can), as the triton
    attention backend would compute it over the returned plan, from the scores the sums already take
    (module docstring, "The plan's attention"); one launch more, and no split/merge launches after."""
    cfg = cfg or DEFAULT_CONFIG
    dev = q.device
    kvh, g, t, d = q.shape
    n = ctx_k.shape[1]
    bs = block_size
    nb = meta.shape[1]
    bm = min(max_blocks, nb)
    if bm == 0:  # an empty context: nothing to plan (the torch path's answer, no kernel)
        z = torch.zeros(kvh, t, dtype=torch.int64, device=dev)
        return ProgressivePlan(torch.full((kvh, t, 0), -1, dtype=torch.int32, device=dev), z,
                               z[..., :0], z, torch.ones(kvh, g, t, device=dev), z.bool(), z.int())
    s_end = min(sink, n)
    n_sb, first_w0 = dense_part_blocks(n, bs, sink, window)
    f = n_sb + nb - first_w0
    budget = rule == "budget"
    if budget:  # the select writes the block list (`BlockList`): F dense-part ids, then the candidates'
        ids = torch.empty(kvh, t, f + bm, dtype=torch.int32, device=dev)
        selection = BlockList(ids, bs, q_pos, n, sink, window)
        positions, ranked = ids, ids[..., f:]
    else:
        positions = selection = torch.empty(kvh, t, (f + bm) * bs, dtype=torch.int32, device=dev)
        ranked = torch.empty(kvh, t, bm, dtype=torch.int64, device=dev)
    counts = torch.empty(2, kvh, t, dtype=torch.int64, device=dev)  # blocks, used
    mass = torch.empty(kvh, g, t, dtype=torch.float32, device=dev)
    capped = torch.empty(kvh, t, dtype=torch.int8, device=dev)
    lengths = torch.empty(kvh, t, dtype=torch.int32, device=dev)

    q = _rows_contiguous(q)
    ctx_k = _rows_contiguous(ctx_k)
    loc_k = _rows_contiguous(loc_k)
    meta = meta if meta.stride(-1) == 1 and meta.stride(-2) == d else meta.contiguous()  # the crit's one tile
    q_pos = q_pos if q_pos.stride(-1) == 1 else q_pos.contiguous()
    tc = max(1, min(t, cfg.x_budget // (kvh * g * nb)))  # query tokens per launch sequence
    rows = kvh * tc
    g_pad = max(16, _pow2(g))  # a tl.dot needs 16 rows
    n_bt = _cdiv(nb, cfg.block_b)
    bs_pad = _pow2(bs)
    slots = max(1, cfg.tile_tokens // bs_pad)
    n_st = _cdiv(bm, slots)
    scr_row = 3 * nb
    wf = _carve(_WORKSPACES.get, dev, torch.float32, x=rows * g * nb, ps=rows * g * n_bt * 2, smx=rows * g * bm,
                ssm=rows * g * bm, dmx=rows * g, dsm=rows * g)
    wi = _carve(_WORKSPACES.get, dev, torch.int32, scr=rows * scr_row, cand=rows * bm, ckey=rows * bm,
                sid=rows * bm, ncand=rows)
    x, ps, smx, ssm, dmx, dsm = (wf[k] for k in ("x", "ps", "smx", "ssm", "dmx", "dsm"))
    attend = attend_scale is not None and not budget and attends(q, ctx_v, loc_v, bm, bs, cfg)
    if attend:  # the candidates' and the dense part's partial attention (t == 1: one chunk of rows)
        wa = _carve(_WORKSPACES.get, dev, torch.float32, tag="psa_attend", aacc=rows * g * bm * d,
                    aml=rows * g * bm * 2, dacc=rows * g * d, dml=rows * g * 2)
        aacc, aml, dacc, dml = (wa[k] for k in ("aacc", "aml", "dacc", "dml"))
        out = torch.empty_like(q)
    else:
        aacc = aml = dacc = dml = x  # never read (ATTEND off)
        out = None
    cv = _rows_contiguous(ctx_v) if attend else ctx_k
    lv = _rows_contiguous(loc_v) if attend else loc_k
    scr, cand, ckey, sid, ncand = (wi[k] for k in ("scr", "cand", "ckey", "sid", "ncand"))

    on_gpu = dev.type == "cuda"
    precise = not interpreted()
    pdl = pdl_launch(dev, cfg.pdl)
    cdt = _TL_DTYPES[meta.dtype] if on_gpu else tl.float32  # the torch path's `cdt`
    logit_dt = _TL_DTYPES.get(q.dtype, tl.float32)
    dot_fp32 = interpreted()
    # the select keeps a row's keys in registers when they fit one tile (at most select_block keys,
    # G_PAD x BLOCK scores <= regs_scores) that every thread holds a distinct part of (no replicas
    # whose float rounding could disagree: see the select kernel)
    sel_block = min(cfg.select_block, max(16, _pow2(nb)))
    in_regs = (nb <= sel_block and _pow2(g) * sel_block <= cfg.regs_scores and sel_block >= 32 * cfg.select_warps
               and cfg.regs_select)
    for t0 in range(0, t, tc):
        t1 = min(t, t0 + tc)
        tcc = t1 - t0
        r = kvh * tcc
        qc, pc = q[:, :, t0:t1], q_pos[t0:t1]
        _crit_kernel[(n_bt, _cdiv(tcc * g, cfg.block_q), kvh)](
            qc, pc, meta, x, ps,
            qc.stride(0), qc.stride(1), qc.stride(2), meta.stride(0), meta.stride(1), meta.stride(2),
            tcc, nb, n, s_end, window, n_sb, bs, n_bt, float(d ** -0.5),
            G=g, D=d, KIND=KINDS[criticality], CDT=cdt, DOT_FP32=dot_fp32, BLOCK_Q=cfg.block_q,
            BLOCK_B=cfg.block_b, PRECISE=precise, PDL=bool(pdl), **pdl, **stamp_args("psa_crit"),
            num_warps=cfg.crit_warps,
        )
        pos_c, rk_c = positions[:, t0:t1], ranked[:, t0:t1]  # a budget plan's: its block ids, their candidates
        bl_c, us_c, ms_c, cp_c = counts[0, :, t0:t1], counts[1, :, t0:t1], mass[:, :, t0:t1], capped[:, t0:t1]
        ln_c = lengths[:, t0:t1]
        plan_args = (pos_c, rk_c, bl_c, us_c, ms_c, cp_c, ln_c,
                     pos_c.stride(0), pos_c.stride(1), rk_c.stride(0), rk_c.stride(1), bl_c.stride(0), bl_c.stride(1),
                     ms_c.stride(0), ms_c.stride(1), ms_c.stride(2), ln_c.stride(0), ln_c.stride(1))
        _select_kernel[(r,)](
            x, ps, pc, scr, cand, ckey, ncand, *plan_args,
            tcc, nb, n, s_end, window, n_sb, bs, n_bt, bm, scr_row, first_w0, f,
            # BLOCK_P <= 64: Triton 3.6 fails to compile the [G_PAD, BLOCK_P] reductions at 128 and 256
            # for sm_90 (TritonGPUOptimizeThreadLocality; hit at 512K, n_bt = 256, on the H100)
            G=g, G_PAD=_pow2(g), BLOCK_P=max(16, min(64, _pow2(n_bt))),
            BLOCK_C=max(16, min(cfg.score_block, _pow2(nb))),
            BLOCK=min(cfg.select_block, max(16, _pow2(nb))),
            IN_REGS=in_regs, PRECISE=precise, BUDGET=budget,
            BLOCK_K=max(16, min(_pow2(cfg.plan_block), _pow2(bm))),
            BLOCK_F=max(16, min(_pow2(cfg.plan_block), _pow2(f))),
            PDL=bool(pdl), **pdl, **stamp_args("psa_select"),
            num_warps=cfg.select_warps,
        )
        if budget:  # the select wrote the plan
            continue
        _sums_kernel[(n_st + 1, r)](
            qc, ctx_k, loc_k, pc, cand, ckey, ncand, sid, smx, ssm, dmx, dsm, cv, lv, aacc, aml, dacc, dml,
            qc.stride(0), qc.stride(1), qc.stride(2), ctx_k.stride(0), ctx_k.stride(1),
            loc_k.stride(0), loc_k.stride(1), cv.stride(0), cv.stride(1), lv.stride(0), lv.stride(1),
            tcc, n, loc_k.shape[1], nb, bm, s_end, window, n_sb, first_w0, f, bs, n_st, float(d ** -0.5),
            float(attend_scale or 1.0) * LOG2E,
            G=g, G_PAD=g_pad, D=d, BS_PAD=bs_pad, SLOTS=slots, BLOCK_R=min(cfg.rank_block, max(16, _pow2(bm))),
            BLOCK_N=cfg.dense_block, LOGIT_DT=logit_dt, DOT_FP32=dot_fp32, PRECISE=precise, ATTEND=attend,
            PDL=bool(pdl), **pdl, num_warps=cfg.sums_warps,
        )
        _stop_kernel[(max(1, min(cfg.stop_parts, _cdiv(bm * bs, cfg.pos_block))), r)](
            sid, smx, ssm, dmx, dsm, ncand, pc, *plan_args,
            tcc, n, nb, bm, s_end, window, n_sb, first_w0, f, bs, microbatch, float(eps),
            G=g, G_PAD=_pow2(g), BLOCK=min(cfg.scan_block, max(16, _pow2(bm))), BLOCK_P=cfg.pos_block,
            EXACT=eps >= 1.0, PRECISE=precise, PDL=bool(pdl), **pdl, num_warps=cfg.stop_warps,
        )
        if attend:
            _attend_kernel[(r, g)](
                aacc, aml, dacc, dml, us_c, out,
                us_c.stride(0), us_c.stride(1), out.stride(0), out.stride(1), out.stride(2),
                tcc, bm,
                G=g, D=d, BLOCK_I=_pow2(min(cfg.attend_block, bm)), PDL=bool(pdl), **pdl,
                num_warps=cfg.attend_warps,
            )
    return ProgressivePlan(selection, counts[0], ranked, counts[1], mass, capped.view(torch.bool), lengths, out)


def attends(q: torch.Tensor, ctx_v: torch.Tensor | None, loc_v: torch.Tensor | None, max_blocks: int,
            block_size: int, cfg: PsaConfig | None = None) -> bool:
    """Whether `progressive_plan(attend_scale=...)` computes the plan's attention: `PsaConfig.attend`
    on, at most `attend_tokens` candidate tokens per row (B_max · block size: the values it reads
    whether the stop keeps them or not; module docstring), blocks of >= 16 tokens (a block's P·V is a
    tl.dot over them), one query token (a decode step; a question chunk's candidates' values would be
    read per token), values in the query's dtype on its device."""
    cfg = cfg or DEFAULT_CONFIG
    return (cfg.attend and max_blocks * block_size <= cfg.attend_tokens and block_size >= 16 and q.shape[2] == 1
            and ctx_v is not None and loc_v is not None
            and ctx_v.dtype == q.dtype and loc_v.dtype == q.dtype and ctx_v.device == q.device
            and loc_v.device == q.device)


__all__ = ["DEFAULT_CONFIG", "PsaConfig", "attends", "clear_workspace", "progressive_plan", "unsupported"]
