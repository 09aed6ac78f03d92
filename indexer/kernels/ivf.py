"""Fused plans of the IVF methods on a GPU: CTkvr (`indexer/ctkvr.py`, query-centroid lists) and kivf
(`indexer/kivf.py`, key k-means clusters). A plan is 3-4 Triton launches instead of ~130 small torch
kernels; the torch code of the planners stays the reference and the CPU path, and the planners
dispatch here for CUDA tensors (or when a test sets `planner.fused = True`: the kernels then run
through Triton's interpreter on CPU tensors).

Long because a method's kernels stay together: CTkvr's and KIVF's searches share these launches,
their wrappers and workspaces, and their cost model below.

CTkvr, one layer and decode step (rows = KVH x T, one per KV head and query token):

1. `_ctkvr_probe_kernel`, grid (ceil((C + F) / BLOCK_C), rows): cosine of each normalised query head
   to the same head of BLOCK_C entries (persisted centroids, then the request's FIFO ring; every head's
   rows of the block in one [BLOCK_C, G, D] load), rounded
   to the centroids' dtype (the torch path's einsum output), max over the group, -inf for evicted /
   empty entries; the block's `probe` best (cosine desc, entry id asc) -> a workspace. It also zeroes
   its share of the row's dedup map (P_PAD bits per context position: which probe ranks hold it) and
   writes the pending FIFO push's query (the last token, unit norm, in the centroids' dtype).
2. `_rerank_kernel`, grid (ceil(U / BLOCK_U) + 1, rows), U = probe x rho candidate slots: each
   program merges the blocks' bests into the row's `probe` entries (a few hundred floats from L2,
   the same merge in every program: cheaper than a launch), takes BLOCK_U slots of the concatenated
   lists (slot u = list u // rho, item u % rho: the torch path's candidate layout), drops positions
   outside the selectable range (sink, window) and marks each slot's probe rank in the row's map
   (an atomic or: the first slot to set any of a position's bits counts its logit in the lse, one
   per position), loads the K row of each selectable slot once for the whole GQA group (issued
   before the atomic answers, so a duplicate's row is read too:
   `IvfConfig.eager_rows`) and writes the G logits q.k / sqrt(D) (-inf where dropped) plus its partial
   softmax state (max, sum) per head; each chunk's list loads are issued during the chunk before
   (`IvfConfig.rerank_prefetch`). The last program of a row does the same over the frame's rows
   (sink, window, visible request-local slots): that is `frame_lse`.
3. `_select_kernel`, grid (rows, 1 or 2): log-sum-exp per head over the parts, the group mass of every slot
   (sum over heads of exp(logit - lse): `candidate_mass`; the logits stored [rows, U, G], one
   [BLOCK, G] tile per chunk, the next chunk's loads issued before this one's exps) as an
   order-preserving int key (float bits + 1; 0 = no candidate, also a duplicate whose position a
   lower probe rank holds: the lowest rank's slot survives, `_survivors`, so the row is the same
   whichever program won an atomic), and the exact top-K
   (`_select_sampled`, `IvfConfig.sample_select`): a strided sample of one block of keys guesses a
   band [a, b) around the K-th key; one pass counts the keys >= b and writes their positions to the
   plan, and compacts the band (keys and positions); when the counts confirm the guess the bisection
   ends in registers over the band and the band's share of the top-K is written from there (else the
   bisection goes on from what the counts proved, over scratch in L2 while the working set is more
   than a block, then in registers, and a plain emit pass writes the positions). The plan row gets
   the top-min(k, U); the last token's row also the top-rho (the FIFO push), by a second program over
   the same keys (grid (rows, 2)).
4. `update()`: `_fifo_push_kernel`, grid (KVH, ceil(rho / 1024)): the pending push into ring slot
   pushes % F, a chunk of a head's list per program; the last program (a ticket) adds the
   probe-share statistic and sets pushes += 1 (the torch path's 5-6 small ops).

The plan's attention (`ctkvr_plan(attend_scale=)`, asked by the caller through `KVView.attend_scale`
when its backend takes `Plan.attended`: one request alone in a step; one token; `attends`): a fourth
launch, `_attend_kernel`, grid (n_work, rows), replaces the attention backend's split and merge
launches. The select's plan program publishes its row (a flag per row, release, after the plan's
stores; `_select_kernel`'s PUBLISH) and, launched with programmatic dependent launch, the attention's
programs start while the select runs (every select program lets them in after its counting pass, so each
program they wait for is running: no order of the two grids deadlocks; `IvfConfig.attend_late`: after its mass
pass, the attention's waiting programs slowed that pass by ~0.9 us, session 35). Program a < n_work - 1 of a row
polls the row's flag (acquire loads 64 ns apart, the plan's addresses computed from the value that ends the
wait: `_attend_part`), then attends one chunk of 64 plan
positions (K and V rows, q·kᵀ and P·V on tensor cores with the attention kernel's rounding,
`_attend_chunk`); the row's last program attends the frame without waiting. Each stores its softmax state,
and the last of the row's programs to take a ticket merges them in program order (reproducible bits)
into the output. The flags and tickets are zeroed by the rerank's frame programs (the launch before).
Kept out of the select's own launch: compiled into it, the attention's tiles took the select 256 B ->
72 KB of shared memory and its programs ~2 us longer (H200, session 34; with 32 or 152 programs alike).

kivf: `_kivf_probe_kernel` (logits of the query heads against the C centroids + partial softmax
state), `_kivf_clusters_kernel` (per row: the group-summed softmax, its top-nprobe by the same
threshold search, the CSR slices of the chosen clusters with their running sizes), then
`_rerank_kernel` with the CSR source (slot u -> the cluster holding u by binary search over the
running sizes -> order[...]; no dedup: each key is in one cluster; the chunks past the probed keys
are skipped) and `_select_kernel` as for CTkvr, over the row's probed keys only (the static width U,
the sum of the nprobe largest clusters, is 1.5-1.9x what a probe holds on real layers: the select
reads the row's count from SEL_CUM on the device and stops there; 128K, B = 1 on the H200 218 -> 151
us, and 138 with the wide select that rows of >= `wide_select_from` slots take; benchmarks/RESULTS.md,
session 27).

Results against the torch path. Positions: the same *set* per row. Order: the torch path returns
best first; a fused row lists its positions in candidate-slot order (probe rank, then list order),
-1 slots last in both. The attention backends take positions as a set (a FIFO entry's list is
always recalled whole), but the fused row's order must not follow a race: the bf16 attention over
the same positions in another order rounds otherwise (benchmarks/RESULTS.md, "Reproducible plans").
Slot order is a function of the inputs since a duplicate's surviving slot is the lowest probe
rank's, not the first program's to set a bit (and the select is one program per row); sorting the
2560 selected per row would cost more than the whole selection. Ties: equal values at the k-th
place are taken lowest index first
(probe: entry id; rerank: candidate slot), which is what torch.topk does on CUDA (its gather pass
fills the values equal to the k-th in index order) -- torch.topk on the CPU orders ties otherwise.
Probe ties are common in bf16 (cosines rounded to bf16, like the torch path's einsum output); mass
ties need exactly equal floats. Rounding: the same formulas in fp32 (IEEE sqrt/division for the
normalisation, libdevice exp/log on the GPU, numpy in the interpreter; fp32 -> bf16 rounding done by
integer arithmetic, since Triton 3.6's interpreter truncates that cast) with another summation order:
scores differ from torch's by ~1e-7 relative, and a bf16 cosine by one ulp when its fp32 value lies
within that of a rounding midpoint, so a selection can differ only where two values are that close
at the k-th place. The tests check exact set equality over several steps, FIFO state included, on
fp32 Gaussian data, bf16 structured data and deliberate ties.

Bytes and flops per layer and step at the CTkvr paper point, 128K context (Llama-3.1-8B layer: KVH 8,
G 4, D 128, bf16; C = 2048 centroids, F = 64, probe 4, rho = 2560, k = 1024, T = 1; 8 rows):

| kernel | reads | writes | floor at 3 TB/s |
|---|---|---|---|
| probe | centroids 8 x 2112 x 4 x 128 x 2 B = 17.3 MB | bests; map zeroing 8 x 64 KB | 5.8 us |
| rerank | list ids 0.3 MB; K rows <= 8 x 10240 x 256 B = 21 MB (1) | logits 1.3 MB, positions 0.3 MB | <= 7.3 us |
| select | logits + positions 1.6 MB (L2) | scratch (L2), plan 32 KB, push 80 KB | ~0.5 us |
| total | ~40 MB | | ~13.5 us |

(1) a duplicate or a frame position loads no row: with real lists' overlap it is less; plus the
frame's 8 x ~100 rows. The centroids: 16.8 MB persisted + 0.5 MB of the FIFO ring.

Flops are negligible (probe 8 x 2112 x 4 x 128 x 2 = 17 Mflop; rerank 8 x 10240 x 4 x 128 x 2 = 84
Mflop, on CUDA cores as row-wise dot products). The floor is the ~38 MB of centroids and gathered K
rows. The select is latency-bound instead: one program per row, ~15-25 bisection steps (the first few
passes over the row's 10240 keys in L2, the rest over the band in registers), each ending in a block
reduction; estimated ~5-8 us. The three dependent launches add ~1-2 us each in a CUDA graph.
Estimate for the plan: ~20-25 us (probe ~6, rerank ~8, select ~6, gaps ~4); with the triton attention
over k = 1024 + frame (~8-10 us) ~30-35 us per layer-step, against SDPA full's 228 us (the goal:
<= ~45 us). The torch plan: ~130 kernels, ~550 us of device time. The centroids dominate the probe;
in a benchmark that replays one layer they sit in the H100's 50 MB L2, in a real 32-layer step they
do not (benchmarks/gpu_ivf.py rotates over layer copies for that reason).

Measured (H100, 2026-11-23, benchmarks/RESULTS.md "ctkvr's select"): the estimate above was off by
3x. The plan at 128K, B = 1, in device us per step: select 35 with the plain bisection (52 when the
push and plan sets were selected one inside the other by one program; ~14 probes per set, each a
pass over the row's ~5,000 valid keys in L2 while the band was larger than a block), 19.5 with the
sampled bracket and the emit fused into its counting pass; rerank 27, probe 13 (18 with 64-entry
blocks): latency, not bytes, on the 8-16 SMs a B = 1 step gives it. Holding the whole row in
registers (one tile of 8192-16384 keys, 16-32 warps) was slower: 76 us, spills and 10 cycles per
issued instruction.
On the H200 (2026-11-29, session 25): the mass pass's lines hold 35% of the select's warp-stall
samples, the search's 23%, and the reductions and scans both use 39% (ncu by source line). Split
over programs of 1,024 slots, the last ticket searching, the mass pass took the select 21.7 -> ~20 us
at B = 1 and lost 6% at B = 8 and 10% for kivf (reverted): the chunk programs' own chain comes first,
and the search, one program per selection, is unchanged.
Programmatic dependent launch for these kernels made a graph-replayed step 8-10 us slower there (the
H100 had measured 2-3 us faster), so they launch without it.
On the H200 (session 26): a slot's probe rank by compares (`_rank_of`) took the select 21.8 -> 21.1 us;
CTkvr's logits masked once per chunk (`_group_logits`) the rerank 23.5 -> 21.3 (kivf's 87 -> 92, so it
keeps the per-head masks); the step 72 -> 69 us at 32K-512K, B = 1. Session 27: a probe pick as one
int64 max of packed (value, id) keys (`_entry_key`) instead of a max and a min, the probe 10.4 -> 9.8
us; the blocks' bests merged once per row by the probe's last program (a ticket) instead of in every
rerank program cost the probe 3 us for 1.5 saved in the rerank (dropped). The probe's cosines on tensor cores
(181 -> 68 registers) were no faster (reverted), nor were 16 select warps (benchmarks/RESULTS.md,
"ctkvr 72 -> 69 us").
On the H200 (session 28): the rerank's logits on tensor cores (`_group_logits`' DOT, 16-bit K; 4,504 ->
2,216 static instructions) took CTkvr's rerank 21.4 -> 14.2 us and its step 68-69 -> 61-63 us at 32K-512K,
B = 1 (512K: 9.0x SDPA), B = 8 at 128K 243 -> 199; kivf's rerank 54 -> 40 us at 128K. The select is now
CTkvr's longest kernel (~21 us). Measured and dropped the same day: the select's masses as multiplies of
exponentials the rerank stored (exp(logit - c_h), c_h context row 0's logit; select 21.0 -> 20.1 us, the
step within its spread, kivf's rerank +6 us), five split points per step of its register search, packed
in one int64 reduction (no faster), and the counting pass's next chunk loaded during this one's count (0.6
us slower): its time is neither in its exponentials, nor in its search's step count, nor in that pass's loads.
Session 29 timed each program's phases from the kernels' own timestamps (`indexer/kernels/stamps.py`,
benchmarks/gpu_timeline.py; the probe, rerank and select take `TS` / `STAMP`, compiled out without a
timeline). At 128K on the H200: probe 10.8 us (two waves of 264 programs; one wave at a 128-register cap
is no faster), rerank programs ~14 us each (the probe bests' merge 2.7, each 64-slot chunk ~5), select
programs 19.7 (lse 1.3, mass pass 5.9, sample bracket 2.5, counting pass 6.5, the band's bisection 2.6,
its emit 0.9), 1.0-1.3 us between kernels. Dropped after measuring: the mass pass's loads a chunk further
ahead (keys 5.9 -> 7.5 us), PDL between these kernels (shorter gaps, slower select programs beside early
attention programs: how session 25 lost 8-10 us) and the counting pass over chunks of 4,096-16,384 keys
(6.5 -> 7.3-23.4 us: its cost is per key).
Session 30: the counting pass and the band's emit scan [BLOCK / 4, 4] tiles, four consecutive keys per
thread (`_chunk_offsets`, `IvfConfig.count_rows`), instead of [BLOCK] in Triton's default layout, which
scans once per register repetition: at 128K on the H200 the pass 6.2 -> 4.3 us, the emit 0.9 -> 0.6,
CTkvr's select programs 19.8 -> 17.0, its step 63 -> 60; kivf's select 42 -> 34.5 (benchmarks/RESULTS.md).
The select under PDL, let in by the rerank but not letting the attention in early, started 0.5 us sooner
and ended no sooner (B = 8 4 us slower): dropped. 4 or 16 select warps, 1,024- or 4,096-key chunks: slower.
Session 31: each rerank program issues its second chunk's list loads while its first chunk works
(`IvfConfig.rerank_prefetch`, `_list_pos`): at 128K on the H200 the second chunk 4.7 -> 3.7 us, a program
13.8 -> 13.1, the kernel's end 0.3 us sooner, the step within its spread. Measured and dropped: one selection
shared by several programs, each the passes over its slice, the last (a ticket) gathering the pieces and
bisecting (the passes 10.4 -> 4.2 us, but the sample's keys +2 us and the ticket and gathers +3: the select
ended no sooner; kivf's later), and the probe bests' top-4 in one reduction (the merge 2.7 -> 3.2 us).
Session 32: where C % block_c == 0 the probe chooses a block's table (persisted or FIFO) per program
(`FIFO_BLOCKS`, `IvfConfig.probe_fifo_blocks`) instead of a [BLOCK_C, G, D] pointer select per element (176 ->
167 registers: 3 programs per SM instead of 2), and issues the block's load before the query's and the push
count's (the compiled code had waited for those two before issuing it). The probe's span at B = 1 stayed
10.2-11.0 us and the step 59-61 us; B = 8 at 128K 196 -> 188-190 us (H200, benchmarks/RESULTS.md). A streaming
read of the same 17.3 MB on the probe's grid takes 6.9 us, the probe alone without its FIFO table 8.4
(benchmarks/gpu_floors.py). Timed in session 33, no change (off): `IvfConfig.rerank_loads_first`, the rerank's
slot programs reading the query position after their merge's and lists' loads; its static SASS now waits for
that position (not otherwise in L2 at the rerank: the probe does not read it) before any of a program's loads.
Session 34: the plan attended by `_attend_kernel` (above) instead of the backend's split and merge: at 128K the
step 56.0-56.8 -> 54.9-55.4 us (2.75-2.80x SDPA), at 512K 57.3-57.8 -> 55.2-55.7 (9.92-10.04x over three calls;
H200, benchmarks/RESULTS.md); the select's programs pay ~1.5 us of it (its counting pass beside the waiting programs,
the flag's release).
Session 35: the select lets the attention's launch in after its counting pass, not its mass pass (`attend_late`):
128K 55.0-55.1 -> 54.5-54.6 us, 512K 55.4-55.6 -> 54.6-54.8 (10.04-10.08x SDPA; H200). The select split over slices
of its row (R programs per selection for the mass and counting passes, a look-back over their counts, then the band's
search; in a launch of its own or in the slices' launch) planned the same bits but was no faster at 128K (56.9
against 55.8-57.3 us; 69-70 with its searches in the same launch) and slower at B = 8: each slice pays the lse, the
sample's bracket and a look-back (commit 3bb0e57, reverted; benchmarks/RESULTS.md). A chunk of 128 attended positions
does not fit the attention kernel's shared memory at D 128 (`ATTEND_TILE_MAX`).
Session 33: where rho % block_u == 0 a rerank chunk's slots are items of one list, so its rank, entry and table
(persisted or FIFO) are chosen once per chunk and its positions are one contiguous load (`_list_pos`'s ONE_LIST,
`IvfConfig.rerank_chunk_lists`; 2,576 -> 1,936 static instructions): the rerank 15.6 -> 12.0 us at 128K, the step 60-61
-> 58 us, B = 8 191 -> 175 us, 512K 60.5 -> 57.4 (H200, benchmarks/RESULTS.md). Measured and dropped (commit a9b7e0d,
reverted): a plan keeping every candidate written and attended by the rerank (70 us with the FIFO push, 49-50 without).

kivf at 128K (ratio 0.05: k = 6554; C = 1448 fp32 centroids, nprobe = 290 for scan 4): probe 8 x 1448
x 128 x 4 B = 5.9 MB; rerank ~4 x k = 26K probed keys per row -> 8 x 26K x 256 B = 54 MB of K rows
(18 us at 3 TB/s); the rerank and the select stop at the row's ~26K probed keys, not the static W
(the 290 largest clusters); the select still runs over 2.5x CTkvr's slots per row, so it is slower
(H200, session 27: select 44 us with 4,096-key blocks over 16 warps, rerank 54, step 138 against SDPA's 152;
session 28, the rerank on tensor cores: rerank 40, step 123).

`CTXCACHE_FUSED_IVF=0` in the environment keeps both planners on their torch path (A/B runs of whole
decode benchmarks); `planner.fused = False` does it for one planner.

Checked without a GPU (Triton 3.6, ahead-of-time compile for sm_90 with the JIT's 16-divisibility
specialisation of strides, default knobs, D 128 bf16): no register spills; registers per thread:
probe 134 (4 warps), rerank 154 (4 warps; on the GPU it runs capped at 96, `IvfConfig.rerank_maxnreg`:
5 programs per SM instead of 3, measured in benchmarks/RESULTS.md), select 128 (8 warps, block 2048; the sampled
select), push 32, kivf probe 154, kivf clusters 106 (8 warps, block 2048); select and push not checked again since their
2026-11-28 changes (the dedup map's survivor check, the push over KVH x chunks programs). Measured by the
JIT on the H200 (2026-11-28, session 15, `gpu_decode.py --profile` reports [registers, spilled, warps] per
compiled kernel): CTkvr probe with every head's rows in one load (`probe_one_load`) 181 / 0 / 4 (123 / 0
with 8 warps, no faster); rerank at the 96 cap 96 / 44 / 4 for CTkvr and 96 / 8 / 4 for kivf, i.e. it
spills (the cap still wins: 128 gives 128 / 2 and a slower step); select 128 / 0 / 8.
benchmarks/gpu_decode.py times the plans (`--profile` for per-kernel device time; IvfConfig knobs as
`ctkvr:knob=value` rows), benchmarks/gpu_ivf.py too.

Workspaces (grow-only, per device, stream and purpose, like `decoder/kernels/attention.py`): float32
and int32 buffers for the probe bests, logits, partial softmax states, positions, keys, select
scratch and the dedup map (KVH x T x ceil(N x P_PAD / 32) words). The map is zeroed by kernel 1
of every plan, so a plan never depends on what an earlier (possibly interrupted) plan left there. Every
launch size is a host int from shapes: no host sync, CUDA-graph capturable (stream order makes reuse
safe; a graph captured on a side stream gets its own workspace; two graphs captured on one stream
must not be replayed concurrently on different streams). Outputs (plan, pending push) are allocated
per call, as the torch path's are: a caller may keep plans of earlier steps.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from indexer.kernels import Workspaces, interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4
from indexer.kernels.pdl import pdl_launch
from indexer.kernels.stamps import stamp, stamp_args

NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)  # initial running max: finite, so exp(m_old - m_new) is never nan
INT_MAX: tl.constexpr = tl.constexpr(2147483647)
INT64_MAX: tl.constexpr = tl.constexpr(9223372036854775807)
INT64_MIN: tl.constexpr = tl.constexpr(-9223372036854775808)
KEY_INF: tl.constexpr = tl.constexpr(0x7F800001)  # key of mass +inf (bits + 1)
MAX_PROBE = 32  # CTkvr entries probed per row (the merge is unrolled per pick, and a position's probe-rank bits
# fill one 32-bit word of the dedup map at most); more: torch. kivf: any nprobe
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------
# Shared device helpers


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:  # libdevice expf (~1 ulp, like torch's); tl.exp is ex2.approx on NVIDIA
        return libdevice.exp(x)
    else:  # the interpreter (numpy) has no libdevice
        return tl.exp(x)


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _round_as(x, DT: tl.constexpr):
    """fp32 x rounded to DT (nearest even), as fp32. bf16 by integer arithmetic, so the GPU and the
    interpreter agree (Triton 3.6's interpreter truncates fp32 -> bf16 casts; the GPU rounds)."""
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        return b.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _lse_parts(ML, n_parts, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr, PRECISE: tl.constexpr):
    """ML [n_parts, G_PAD, 2] float64 (running max, sum of exp(x - max)) -> [G_PAD] fp32 log-sum-exp
    per head. The sums are float64 so the result does not depend on how candidates fall into parts:
    which duplicate slot counts a position's logit is decided by the rerank's atomics (it varies run
    to run), and fp32 partial sums would round differently for each split, moving the masses by ulps and
    flipping near-ties at the K-th place (a GPU run saw plans differ between two identical runs)."""
    ar_g = tl.arange(0, G_PAD)
    ok_g = ar_g < G
    m_all = tl.full([G_PAD], NEG_BIG, tl.float32)
    for c0 in range(0, n_parts, BLOCK_S):
        sp = c0 + tl.arange(0, BLOCK_S)
        msk = (sp < n_parts)[:, None] & ok_g[None, :]
        m = tl.load(ML + (sp[:, None] * G_PAD + ar_g[None, :]) * 2, mask=msk, other=NEG_BIG).to(tl.float32)
        m_all = tl.maximum(m_all, tl.max(m, 0))
    l_all = tl.zeros([G_PAD], tl.float64)
    for c0 in range(0, n_parts, BLOCK_S):
        sp = c0 + tl.arange(0, BLOCK_S)
        msk = (sp < n_parts)[:, None] & ok_g[None, :]
        m = tl.load(ML + (sp[:, None] * G_PAD + ar_g[None, :]) * 2, mask=msk, other=NEG_BIG).to(tl.float32)
        lv = tl.load(ML + (sp[:, None] * G_PAD + ar_g[None, :]) * 2 + 1, mask=msk, other=0.0)
        l_all += tl.sum(lv * _exp(m - m_all[None, :], PRECISE).to(tl.float64), 0)
    l32 = l_all.to(tl.float32)
    has = l32 > 0  # padded heads (G < G_PAD) and empty parts: -inf, without log(0)
    return tl.where(has, m_all + _log(tl.where(has, l32, 1.0), PRECISE), float("-inf"))


@triton.jit
def _sample_bracket(BUF, off, n, K, key_lo, key_hi, BLOCK: tl.constexpr):
    """A guess (a, b), key_lo <= a, b <= key_hi, of a narrow band around the K-th largest of the int
    keys BUF[off : off + n] (n > BLOCK; 0 = empty): from a strided sample of BLOCK keys in one
    register tile. With t = K·BLOCK/n the sample's expected count above the K-th key and a margin
    m = 3·sqrt(t) + 2, `a` is a key value with between t + m and t + 1.5·m sample keys >= it, `b` one
    with between t - 1.5·m and t - m: two bisections over the sample in lockstep, both counts packed
    in one int32 reduction per step (BLOCK < 2^16). A guess only: the caller counts the real keys."""
    tl.static_assert(BLOCK < 65536)
    ar = tl.arange(0, BLOCK)
    s = tl.load(BUF + off + (ar.to(tl.int64) * n) // BLOCK)  # stored keys: every thread reads alike
    n_vs = tl.sum((s > 0).to(tl.int32), 0)
    s_min = tl.min(tl.where(s > 0, s, INT_MAX), 0)
    s_max = tl.max(s, 0)
    t = K.to(tl.float32) * BLOCK / n.to(tl.float32)
    m = 3.0 * tl.sqrt(t) + 2.0
    t_a = tl.ceil(t + m).to(tl.int32)  # a: count(sample >= a) >= t_a
    t_b = tl.floor(t - m).to(tl.int32)  # b: count(sample >= b) <= t_b
    slack = (0.5 * m).to(tl.int32)  # a search stops once its count is within the slack of its target
    lo_a = s_min  # count(sample >= lo_a) >= t_a > count(sample >= hi_a)
    hi_a = s_max + 1
    lo_b = s_min  # count(sample >= lo_b) > t_b >= count(sample >= hi_b)
    hi_b = s_max + 1
    done_a = (n_vs < t_a).to(tl.int32)  # too few valid sample keys: a = key_lo
    done_b = ((t_b < 0) | (n_vs <= t_b)).to(tl.int32)
    if t_b < 0:
        hi_b = key_hi
    elif n_vs <= t_b:
        hi_b = s_min
    while (done_a == 0) | (done_b == 0):
        mid_a = lo_a + (hi_a - lo_a) // 2
        mid_b = lo_b + (hi_b - lo_b) // 2
        c = tl.sum((s >= mid_a).to(tl.int32) + ((s >= mid_b).to(tl.int32) << 16), 0)
        c_a = c & 0xFFFF
        c_b = c >> 16
        if done_a == 0:
            if c_a >= t_a:
                lo_a = mid_a
                done_a = (c_a <= t_a + slack).to(tl.int32)
            else:
                hi_a = mid_a
            done_a = done_a | (hi_a - lo_a <= 1).to(tl.int32)
        if done_b == 0:
            if c_b <= t_b:
                hi_b = mid_b
                done_b = (c_b >= t_b - slack).to(tl.int32)
            else:
                lo_b = mid_b
            done_b = done_b | (hi_b - lo_b <= 1).to(tl.int32)
    a = tl.where(n_vs < t_a, key_lo, lo_a)
    return a, hi_b


@triton.jit
def _kth_largest(BUF, full_off, ping_off, pong_off, n, K, key_lo, n_ge_lo, key_hi, BLOCK: tl.constexpr):
    """Threshold of the top-K of the int keys BUF[full_off : full_off + n], all < key_hi, with
    n_ge_lo of them >= key_lo (callers pass the smallest valid key, or 0 and n): returns (thr, take)
    such that the top-K is every key > thr plus the first `take` keys == thr (array order)."""
    return _kth_search(BUF, full_off + n * 0, n, ping_off, pong_off, n, K, key_lo + n * 0, key_hi + n * 0, n * 0,
                       n_ge_lo + n * 0, (K >= n_ge_lo).to(tl.int32), BLOCK)  # K == n_ge_lo: every key >= key_lo


@triton.jit
def _kth_search(BUF, cur, cur_n, ping_off, pong_off, n, K, lo, hi, c_hi, n_band, done, BLOCK: tl.constexpr):
    """`_kth_largest` from a known state: the working set BUF[cur : cur + cur_n] holds every key in
    [lo, hi) (n_band of them) and maybe others; count(key >= lo) >= K; count(key >= hi) = c_hi < K;
    done: count(key >= lo) == K. (+ n * 0 in the callers: tensors, also for literal arguments.)

    Bisection on the key value. Phase A, while the working set is larger than BLOCK: each step is a
    pass over the working set in global scratch (L1/L2), and once the undecided band [lo, hi) holds at
    most half of it, or fits in a block, the band is compacted into the ping/pong region (n ints
    each, whichever `cur` is not; a debug_barrier orders the compaction's stores before other threads
    read them). Phase B: the band is loaded into registers once and the steps go on there. Stops
    early when a probe value splits exactly K."""
    ar = tl.arange(0, BLOCK)
    while (hi - lo > 1) & (done == 0) & (cur_n > BLOCK):
        mid = lo + (hi - lo) // 2
        c_vec = tl.zeros([BLOCK], tl.int32)  # per element over the chunks: one reduction per pass
        for c0 in range(0, cur_n, BLOCK):
            o = c0 + ar
            key = tl.load(BUF + cur + o, mask=o < cur_n, other=-1)
            c_vec += ((key >= mid) & (key < hi)).to(tl.int32)
        c_mid = tl.sum(c_vec, 0)  # working-set keys in [mid, hi)
        cnt = c_hi + c_mid
        if cnt >= K:
            lo = mid
            n_band = c_mid
            done = (cnt == K).to(tl.int32)
        else:
            hi = mid
            c_hi = cnt
            n_band = n_band - c_mid
        if ((n_band * 2 <= cur_n) | (n_band <= BLOCK)) & (done == 0):
            dst = tl.where(cur == ping_off, pong_off, ping_off)
            base = n * 0
            for c0 in range(0, cur_n, BLOCK):
                o = c0 + ar
                key = tl.load(BUF + cur + o, mask=o < cur_n, other=-1)
                keep = (key >= lo) & (key < hi) & (o < cur_n)
                at = base + tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(BUF + dst + at, key, mask=keep)
                base += tl.sum(keep.to(tl.int32), 0)
            tl.debug_barrier()
            cur = dst
            cur_n = base
    reg = tl.load(BUF + cur + ar, mask=ar < cur_n, other=-1)  # phase B: the band (or all n) in registers
    return _bisect_regs(reg, n, K, lo, hi, c_hi, done)


@triton.jit
def _bisect_regs(reg, n, K, lo, hi, c_hi, done, ALL: tl.constexpr = False):
    """Phase B of `_kth_largest`: the bisection over keys held in registers (`reg`: the band
    [lo, hi) and anything outside it; -1 for empty slots), given count(key >= hi) = c_hi < K;
    returns (thr, take) as `_kth_largest` does. ALL: `reg` holds every key (c_hi counts some of
    them), so a step counts the keys >= mid directly, one compare per key instead of two (the same
    counts)."""
    while (hi - lo > 1) & (done == 0):
        mid = lo + (hi - lo) // 2
        if ALL:
            cnt = tl.sum((reg >= mid).to(tl.int32), 0)
        else:
            cnt = c_hi + tl.sum(((reg >= mid) & (reg < hi)).to(tl.int32), 0)
        if cnt >= K:
            lo = mid
            done = (cnt == K).to(tl.int32)
        else:
            hi = mid
            c_hi = cnt
    if K >= n:
        thr = lo * 0 - 1
        take = lo * 0
    elif done != 0:  # keys >= lo are exactly K
        thr = lo - 1
        take = lo * 0
    else:  # hi == lo + 1: lo is the K-th largest key; c_hi keys are above it
        thr = lo
        take = K - c_hi
    return thr, take


@triton.jit
def _top_threshold_regs(keys, n, K, key_min, n_valid, key_hi):
    """`_top_threshold` over keys held in registers (a row of n <= the block's keys, no scratch)."""
    if n_valid < K:
        thr = n * 0
        take = K - n_valid
    else:
        thr, take = _bisect_regs(keys, n, K, key_min, key_hi, n * 0, (K >= n_valid).to(tl.int32), ALL=True)
    return thr, take


@triton.jit
def _top_threshold(ROW, n, K, key_min, n_valid, key_hi, BLOCK: tl.constexpr):
    """`_kth_largest` over a row's keys ROW[0:n] (scratch layout [keys | ping | pong]) when the
    smallest valid key (or any lower bound > 0) and the count of valid keys (> 0) are known: fewer
    valid keys than K select them all (the ties at 0 are the invalid slots, emitted as -1); else the
    bisection starts at that bound, skipping the empty range below it."""
    if n_valid < K:
        thr = n * 0
        take = K - n_valid
    else:
        thr, take = _kth_largest(ROW, 0, n, 2 * n, n, K, key_min, n_valid, key_hi, BLOCK)
    return thr, take


@triton.jit
def _chunk_offsets(c0, BLOCK: tl.constexpr, V: tl.constexpr, ks=1):
    """Offsets of one chunk of BLOCK keys from c0 as a [BLOCK // V, V] tile, row i holding keys
    c0 + i·V .. c0 + i·V + V - 1 (ks: the keys' stride, 1, passed at run time). With the stride
    unknown to Triton's coalescing pass no axis looks contiguous, its tie-break puts the threads along
    axis 0, and each thread holds one row, V consecutive keys as repetitions: `_chunk_scan` then scans
    across the threads once per chunk instead of once per repetition (with the contiguity known, the
    pass put the threads along the keys' contiguous axis in the ttgir of a first version, splitting
    each run of V keys over V threads)."""
    return c0 + (tl.arange(0, BLOCK // V)[:, None] * V + tl.arange(0, V)[None, :]) * ks


@triton.jit
def _chunk_scan(x):
    """Inclusive prefix sums of a `_chunk_offsets` tile in key order (along each row, then down the
    rows) and the tile's total: the rows' own scans, plus an exclusive scan of the row totals."""
    row = tl.sum(x, 1)
    return tl.cumsum(x, 1) + (tl.cumsum(row, 0) - row)[:, None], tl.sum(row, 0)


@triton.jit
def _emit_ranks(key, thr, take, gt_base, eq_base, ROWS: tl.constexpr = False):
    """The ranks of one chunk of a selection (thr, take): the valid keys (> 0) above thr, and those
    equal to it while fewer than `take` have been taken, in array order after gt_base + min(eq_base,
    take) earlier ones (gt_base / eq_base: the valid keys above / equal to thr in the chunks before).
    Both running counts come from one scan (above thr in the low 16 bits, equal in the high ones: a
    chunk has < 2^16 keys; two scans cost the psa select 0.3-0.6 us more on an H100,
    benchmarks/RESULTS.md). ROWS: `key` is a `_chunk_offsets` tile, scanned by `_chunk_scan`.
    -> (taken mask, slot of each taken key, gt_base, eq_base after it)."""
    gt = (key > thr) & (key > 0)
    eq = (key == thr) & (key > 0)
    both = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    if ROWS:
        sc, tot = _chunk_scan(both)
    else:
        sc = tl.cumsum(both, 0)
        tot = tl.sum(both, 0)
    n_eq = eq_base + (sc >> 16)  # inclusive
    w = gt | (eq & (n_eq <= take))
    at = gt_base + (sc & 0xFFFF) + tl.minimum(n_eq, take) - 1
    return w, at, gt_base + (tot & 0xFFFF), eq_base + (tot >> 16)


@triton.jit
def _emit_slots(key, pos, thr, take, gt_base, eq_base, OUT, ROWS: tl.constexpr = False):
    """One chunk of an emit: the `pos` of the keys `_emit_ranks` takes into OUT at their ranks.
    -> the counts after the chunk."""
    w, at, gt_base, eq_base = _emit_ranks(key, thr, take, gt_base, eq_base, ROWS)
    tl.store(OUT + at, pos, mask=w)
    return gt_base, eq_base


@triton.jit
def _emit(KEYS, POS, n, thr, take, K, OUT, BLOCK: tl.constexpr):
    """Write the selection (thr, take) of keys KEYS[0:n] as positions POS[0:n] into OUT[0:K]: valid
    keys (> 0) packed first in array order, -1 after."""
    tl.static_assert(BLOCK < 65536)
    ar = tl.arange(0, BLOCK)
    gt_base = n * 0
    eq_base = n * 0
    for c0 in range(0, n, BLOCK):
        o = c0 + ar
        inn = o < n
        key = tl.load(KEYS + o, mask=inn, other=-1)
        pos = tl.load(POS + o, mask=inn, other=-1)
        gt_base, eq_base = _emit_slots(key, pos, thr, take, gt_base, eq_base, OUT)
    base = gt_base + tl.minimum(eq_base, take)
    for c0 in range(base, K, BLOCK):
        o = c0 + ar
        tl.store(OUT + o, tl.full([BLOCK], -1, tl.int32), mask=o < K)


@triton.jit
def _entry_key(v, i):
    """(value, id) -> one int64 whose order is the picks' order (value desc, then id asc): the value's
    order-preserving int32 bits (+0.0 for -0.0, which compares equal to it) above INT_MAX - id (ids in
    [0, INT_MAX]); a NaN value -> INT64_MIN, never picked (a NaN compares false, as in the float
    form). A pick is then one int64 max instead of a max and a min (two block reductions)."""
    v = tl.where(v == 0.0, 0.0, v)
    b = v.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ INT_MAX)
    packed = (k.to(tl.int64) << 32) | (-i + INT_MAX).to(tl.int64)  # (the constexpr on the right: the interpreter)
    return tl.where(v == v, packed, INT64_MIN)


@triton.jit
def _pick_next(key, prev):
    """The best `_entry_key` below prev -> (key, value, id); (INT64_MIN, -inf, INT_MAX) when none is left."""
    best = tl.max(tl.where(key < prev, key, INT64_MIN), 0)
    none = best == INT64_MIN
    k = (best >> 32).to(tl.int32)
    v = tl.where(none, float("-inf"), tl.where(k >= 0, k, k ^ INT_MAX).to(tl.float32, bitcast=True))
    i = tl.where(none, INT_MAX, -(best & INT_MAX).to(tl.int32) + INT_MAX)
    return best, v, i


@triton.jit
def _merge_probe(TOPV, TOPI, base, n_top, P: tl.constexpr, P_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """The P best entries of a row from the blocks' bests (n_top = blocks x P_PAD pairs, the first P
    of each block valid) -> [P_PAD] entry ids in rank order (INT_MAX after P)."""
    o = tl.arange(0, BLOCK_T)
    ok = (o < n_top) & ((o % P_PAD) < P)
    v = tl.load(TOPV + base + o, mask=ok, other=float("-inf"))
    i = tl.load(TOPI + base + o, mask=ok, other=INT_MAX)
    ar = tl.arange(0, P_PAD)
    key = _entry_key(v, i)
    sel = tl.full([P_PAD], INT_MAX, tl.int32)
    prev = tl.full([], INT64_MAX, tl.int64)
    for j in tl.static_range(P):
        prev, pv, pi = _pick_next(key, prev)
        sel = tl.where(ar == j, pi, sel)
    return sel


# ---------------------------------------------------------------------------------------------
# CTkvr probe


@triton.jit(do_not_specialize=["T", "C", "F", "n_blocks", "NW", "words_per_prog"])
def _ctkvr_probe_kernel(
    Q, CENT, FCENT, PUSHES, TOPV, TOPI, PQ, BITMAP,
    sq_h, sq_g, sq_t,  # q [KVH, G, T, D]
    sc_h, sc_c, sc_g,  # centroids [KVH, C, G, D]
    sf_h, sf_c, sf_g,  # FIFO centroids [KVH, F, G, D]
    spq_h, spq_g,  # pending query [KVH, G, D]
    T, C, F, n_blocks, NW, words_per_prog,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr, P: tl.constexpr,
    P_PAD: tl.constexpr, HAS_FIFO: tl.constexpr, DEDUP: tl.constexpr, BLOCK_Z: tl.constexpr,
    ONE_LOAD: tl.constexpr = True, FIFO_BLOCKS: tl.constexpr = False, LOADS_FIRST: tl.constexpr = True, TS=None,
    STAMP: tl.constexpr = False,
):
    s = tl.program_id(0)
    r = tl.program_id(1)
    stamp(TS, r * tl.num_programs(0) + s, 0, STAMP)
    h = (r // T).to(tl.int64)
    t = r % T
    offs_d = tl.arange(0, D)
    e = s * BLOCK_C + tl.arange(0, BLOCK_C)  # entry ids: [0, C) persisted, [C, C + F) the FIFO ring
    is_p = e < C
    if HAS_FIFO:
        is_f = (e >= C) & (e < C + F)
    else:
        is_f = e < 0
    write_q = (s == 0) & (t == T - 1)
    if ONE_LOAD:
        # every head's rows of the block in one load ([BLOCK_C, G_PAD, D]: an entry's G x D values are
        # contiguous), so the program waits on memory once, not once per head in turn
        ar_g = tl.arange(0, G_PAD)
        g_ok = ar_g < G
        if not LOADS_FIRST:
            qv = tl.load(Q + h * sq_h + ar_g[:, None] * sq_g + t * sq_t + offs_d[None, :], mask=g_ok[:, None],
                         other=0.0).to(tl.float32)
            if HAS_FIFO:
                pushes = tl.load(PUSHES)
        if FIFO_BLOCKS:  # a block is all persisted or all FIFO entries (C % BLOCK_C == 0): the program picks
            # its table's base and strides as scalars, so its [BLOCK_C, G, D] addresses are computed once
            if s * BLOCK_C >= C:
                cbase = FCENT + h * sf_h + (s * BLOCK_C - C).to(tl.int64) * sf_c
                st_c = sf_c
                st_g = sf_g
            else:
                cbase = CENT + h * sc_h + (s * BLOCK_C).to(tl.int64) * sc_c
                st_c = sc_c
                st_g = sc_g
            ptr = (cbase + tl.arange(0, BLOCK_C)[:, None, None].to(tl.int64) * st_c + ar_g[None, :, None] * st_g
                   + offs_d[None, None, :])
        else:
            ptr = (CENT + h * sc_h + e[:, None, None].to(tl.int64) * sc_c + ar_g[None, :, None] * sc_g
                   + offs_d[None, None, :])
            if HAS_FIFO:  # one load per element from either table (same dtype), not two tiles
                ptr = tl.where(is_f[:, None, None], FCENT + h * sf_h + (e - C)[:, None, None].to(tl.int64) * sf_c
                               + ar_g[None, :, None] * sf_g + offs_d[None, None, :], ptr)
        ce = tl.load(ptr, mask=(is_p | is_f)[:, None, None] & g_ok[None, :, None], other=0.0).to(tl.float32)
        if LOADS_FIRST:  # the query and the FIFO's push count loaded after the block's rows: the compiled code
            # then issues the rows' loads first instead of after waiting for these (RESULTS.md, session 32)
            if HAS_FIFO:
                pushes = tl.load(PUSHES)
            qv = tl.load(Q + h * sq_h + ar_g[:, None] * sq_g + t * sq_t + offs_d[None, :], mask=g_ok[:, None],
                         other=0.0).to(tl.float32)
        qn = tl.div_rn(qv, tl.maximum(tl.sqrt_rn(tl.sum(qv * qv, 1)), 1e-12)[:, None])  # F.normalize(q.float())
        qf = _round_as(qn, CENT.dtype.element_ty)  # ... .to(centroid dtype), as the torch path
        if HAS_FIFO:
            tl.store(PQ + h * spq_h + ar_g[:, None] * spq_g + offs_d[None, :], qf.to(PQ.dtype.element_ty),
                     mask=write_q & g_ok[:, None])
        cos = _round_as(tl.sum(ce * qf[None, :, :], 2), CENT.dtype.element_ty)  # the einsum's output dtype
        best = tl.max(tl.where(g_ok[None, :], cos, float("-inf")), 1)
    else:  # one head at a time: a load, its cosines, the next head's load
        if HAS_FIFO:
            pushes = tl.load(PUSHES)
        best = tl.full([BLOCK_C], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            qv = tl.load(Q + h * sq_h + g * sq_g + t * sq_t + offs_d).to(tl.float32)
            qn = tl.div_rn(qv, tl.maximum(tl.sqrt_rn(tl.sum(qv * qv, 0)), 1e-12))  # F.normalize(q.float()), IEEE ops
            qf = _round_as(qn, CENT.dtype.element_ty)  # ... .to(centroid dtype), as the torch path
            if HAS_FIFO:
                tl.store(PQ + h * spq_h + g * spq_g + offs_d, qf.to(PQ.dtype.element_ty), mask=write_q & (offs_d < D))
            ptr = CENT + h * sc_h + e[:, None].to(tl.int64) * sc_c + g * sc_g + offs_d[None, :]
            if HAS_FIFO:  # one load per element from either table (same dtype), not two tiles
                ptr = tl.where(is_f[:, None], FCENT + h * sf_h + (e - C)[:, None].to(tl.int64) * sf_c + g * sf_g
                               + offs_d[None, :], ptr)
            ce = tl.load(ptr, mask=(is_p | is_f)[:, None], other=0.0).to(tl.float32)
            cos = tl.sum(ce * qf[None, :], 1)
            cos = _round_as(cos, CENT.dtype.element_ty)  # the einsum's output dtype (bf16 rounds)
            best = tl.maximum(best, cos)
    if HAS_FIFO:
        live = tl.minimum(pushes, F).to(tl.int32)  # pushes so far, capped at the ring size
        alive = (is_p & (e >= live)) | (is_f & (e - C < live))  # the first `live` persisted are evicted
    else:
        alive = is_p
    key = _entry_key(tl.where(alive, best, float("-inf")), e)
    base = (r * n_blocks + s) * P_PAD
    prev = tl.full([], INT64_MAX, tl.int64)
    for j in tl.static_range(P):
        prev, pv, pi = _pick_next(key, prev)
        tl.store(TOPV + base + j, pv)
        tl.store(TOPI + base + j, pi)
    if DEDUP:  # zero this block's share of the row's bitmap (kernel 2 sets bits)
        w0 = s * words_per_prog
        for c0 in range(0, words_per_prog, BLOCK_Z):
            o = w0 + c0 + tl.arange(0, BLOCK_Z)
            tl.store(BITMAP + r.to(tl.int64) * NW + o, tl.zeros([BLOCK_Z], tl.int32),
                     mask=(o < NW) & (o < w0 + words_per_prog))
    stamp(TS, r * tl.num_programs(0) + s, 1, STAMP)


# ---------------------------------------------------------------------------------------------
# kivf probe


@triton.jit(do_not_specialize=["T", "C", "n_blocks"])
def _kivf_probe_kernel(
    Q, CENT, PL, PML,
    sq_h, sq_g, sq_t,  # q [KVH, G, T, D]
    sc_h, sc_c,  # centroids [KVH, C, D] fp32
    T, C, n_blocks, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_C: tl.constexpr, PRECISE: tl.constexpr,
):
    """Logits q.c / sqrt(D) of a block of centroids for the G heads of one row -> PL [rows, G, C],
    and the block's softmax state per head -> PML [rows, n_blocks, G_PAD, 2]."""
    s = tl.program_id(0)
    r = tl.program_id(1)
    h = (r // T).to(tl.int64)
    t = r % T
    offs_d = tl.arange(0, D)
    c = s * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    ce = tl.load(CENT + h * sc_h + c[:, None].to(tl.int64) * sc_c + offs_d[None, :], mask=ok[:, None],
                 other=0.0).to(tl.float32)
    ar_g = tl.arange(0, G_PAD)
    m_v = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_v = tl.zeros([G_PAD], tl.float64)
    for g in tl.static_range(G):
        qv = tl.load(Q + h * sq_h + g * sq_g + t * sq_t + offs_d).to(tl.float32)
        lg = tl.sum(ce * qv[None, :], 1) * qk_scale
        tl.store(PL + (r.to(tl.int64) * G + g) * C + c, lg, mask=ok)
        lg = tl.where(ok, lg, float("-inf"))
        m = tl.maximum(tl.max(lg, 0), NEG_BIG)
        lsum = tl.sum(_exp(lg - m, PRECISE).to(tl.float64), 0)
        m_v = tl.where(ar_g == g, m, m_v)
        l_v = tl.where(ar_g == g, lsum, l_v)
    at = ((r * n_blocks + s) * G_PAD + ar_g) * 2
    tl.store(PML + at, m_v.to(tl.float64))
    tl.store(PML + at + 1, l_v)


@triton.jit(do_not_specialize=["C", "n_blocks"])
def _kivf_clusters_kernel(
    PL, PML, OFFSETS, SCR, SEL_START, SEL_CUM,
    so_h, T, C, n_blocks, scr_row, P,
    G: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """Per row: the group-summed softmax over the C centroids, its top-P clusters (in id order), and
    their CSR slices: SEL_START [rows, P_PAD] = offsets[c], SEL_CUM [rows, P_PAD + 1] = exclusive
    running size (SEL_CUM[P] = keys in all P clusters)."""
    r = tl.program_id(0).to(tl.int64)
    h = r // T
    lse = _lse_parts(PML + r * n_blocks * G_PAD * 2, n_blocks, G, G_PAD, BLOCK_S, PRECISE)
    ar_g = tl.arange(0, G_PAD)
    ar = tl.arange(0, BLOCK)
    row = SCR + r * scr_row
    key_max = C * 0
    for c0 in range(0, C, BLOCK):
        c = c0 + ar
        ok = c < C
        score = tl.zeros([BLOCK], tl.float32)
        for g in tl.static_range(G):
            lse_g = tl.sum(tl.where(ar_g == g, lse, 0.0), 0)
            lg = tl.load(PL + (r * G + g) * C + c, mask=ok, other=float("-inf"))
            score += _exp(lg - lse_g, PRECISE)
        key = tl.where(ok & (score == score), tl.minimum(score.to(tl.int32, bitcast=True) + 1, KEY_INF), 0)
        tl.store(row + c, key, mask=ok)
        key_max = tl.maximum(key_max, tl.max(key, 0))
    tl.debug_barrier()
    thr, take = _kth_largest(row, 0, C, 2 * C, C, P, 0, C, key_max + 1, BLOCK)
    base = C * 0
    cum = C * 0
    eq_base = C * 0
    for c0 in range(0, C, BLOCK):
        c = c0 + ar
        inn = c < C
        key = tl.load(row + c, mask=inn, other=-1)
        eq = (key == thr) & inn
        eq_rank = eq_base + tl.cumsum(eq.to(tl.int32), 0) - 1
        w = ((key > thr) | (eq & (eq_rank < take))) & inn
        at = base + tl.cumsum(w.to(tl.int32), 0) - 1
        start = tl.load(OFFSETS + h * so_h + c, mask=w, other=0)
        size = tl.load(OFFSETS + h * so_h + c + 1, mask=w, other=0) - start
        excl = cum + tl.cumsum(size, 0) - size
        tl.store(SEL_START + r * P_PAD + at, start, mask=w)
        tl.store(SEL_CUM + r * (P_PAD + 1) + at, excl, mask=w)
        base += tl.sum(w.to(tl.int32), 0)
        cum += tl.sum(size, 0)
        eq_base += tl.sum(eq.to(tl.int32), 0)
    tl.store(SEL_CUM + r * (P_PAD + 1) + P, cum)


# ---------------------------------------------------------------------------------------------
# Candidates + rerank logits (shared)


@triton.jit
def _position_bits(pos, PB: tl.constexpr):
    """The PB bits of each position in its word of CTkvr's dedup map (PB a power of two <= 32: a
    position's bits never straddle two words), as an int32 mask."""
    if PB == 32:
        return pos * 0 - 1
    else:
        return ((1 << PB) - 1) << ((pos * PB) & 31)


@triton.jit
def _rank_of(u, RHO, P: tl.constexpr):
    """u // RHO for slots u < P * RHO (a probe rank): P - 1 compares for a small P instead of an
    integer division by a runtime value (~20 instructions: 6% of the select's before)."""
    if P <= 8:
        rank = (u >= RHO).to(tl.int32)
        for j in tl.static_range(2, P):
            rank += (u >= j * RHO).to(tl.int32)
    else:
        rank = u // RHO
    return rank


@triton.jit
def _survivors(BITMAP, NW, r, pos, u, RHO, PB: tl.constexpr):
    """CTkvr's dedup, decided: slot u (probe rank u // RHO) keeps position pos >= 0 when no lower
    rank set the position's bit in the row's map (the rerank's atomics are all done: this runs in
    the next launch). The lowest rank's slot survives, whichever program set its bit first, so the
    plan row's order (slot order) is the same on every run."""
    ok = pos >= 0
    at = pos * PB
    word = tl.load(BITMAP + r * NW + (at >> 5), mask=ok, other=0)
    rank = _rank_of(u, RHO, PB)
    lower = ((1 << rank) - 1).to(tl.int32) << (at & 31)  # rank < PB <= 32 bits below this one's
    return ok & ((word & lower) == 0)


@triton.jit
def _group_logits(kt, ok, QROW, sq_g, qk_scale, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                  BLOCK_U: tl.constexpr, ONE_MASK: tl.constexpr, DOT: tl.constexpr = False,
                  DOT_FP32: tl.constexpr = False):
    """The GQA group's logits q_g . k / sqrt(D) of a chunk's K rows kt [BLOCK_U, D] (as loaded) ->
    [BLOCK_U, G_PAD], -inf where not `ok` and in the padded heads. QROW: the group's
    first query head at this token. DOT: one tensor-core product [BLOCK_U, D] x [D, max(16, G_PAD)]
    (the heads' q as columns, zero past G; one wgmma per 16 of D on Hopper) instead of G row-wise
    FMA dot products and their shuffle reductions: CTkvr's rerank 21.4 -> 14.2 us at 128K, B = 1, kivf's
    54 -> 40 (H200, session 28; benchmarks/RESULTS.md). bf16 x bf16 products are exact in fp32, so
    the logits differ from the FMAs' (and torch's fp32 einsum) only by the summation order. ONE_MASK
    (the FMAs): the heads' dot products first, then one [BLOCK_U, G_PAD] mask; else each head's
    [BLOCK_U] vector masked on its own. The same values either way; the layouts differ: one mask is
    14 layout conversions in the rerank instead of 24 and CTkvr's rerank 23.3 -> 21.4 us at 128K, B = 1,
    on the H200, but kivf's 86.8 -> 91.5 (its SOURCE path under the same register cap), so kivf keeps
    the per-head masks (benchmarks/RESULTS.md, session 26)."""
    offs_d = tl.arange(0, D)
    ar_g = tl.arange(0, G_PAD)
    if DOT:
        G_DOT: tl.constexpr = 16 if G_PAD < 16 else G_PAD
        ar_q = tl.arange(0, G_DOT)
        qm = tl.load(QROW + ar_q[None, :] * sq_g + offs_d[:, None], mask=(ar_q < G)[None, :], other=0.0)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong: fp32 operands holding the same values
            acc = tl.dot(kt.to(tl.float32), qm.to(tl.float32), input_precision="ieee")
        else:  # 16-bit products are exact in fp32: the same sum as the FMAs', in another order
            acc = tl.dot(kt, qm.to(kt.dtype))  # [BLOCK_U, G_DOT] fp32
        if G_DOT > G_PAD:  # columns >= G are exact zeros: the sum over the reshape keeps the first G_PAD exactly
            acc = tl.sum(tl.reshape(acc, [BLOCK_U, G_DOT // G_PAD, G_PAD]), 1)
        lg = tl.where(ok[:, None] & (ar_g < G)[None, :], acc * qk_scale, float("-inf"))
    elif ONE_MASK:
        kt = kt.to(tl.float32)
        lg = tl.zeros([BLOCK_U, G_PAD], tl.float32)
        for g in tl.static_range(G):
            qv = tl.load(QROW + g * sq_g + offs_d).to(tl.float32)
            lg = tl.where(ar_g[None, :] == g, (tl.sum(kt * qv[None, :], 1) * qk_scale)[:, None], lg)
        lg = tl.where(ok[:, None] & (ar_g < G)[None, :], lg, float("-inf"))
    else:
        kt = kt.to(tl.float32)
        lg = tl.full([BLOCK_U, G_PAD], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            qv = tl.load(QROW + g * sq_g + offs_d).to(tl.float32)
            sg = tl.where(ok, tl.sum(kt * qv[None, :], 1) * qk_scale, float("-inf"))
            lg = tl.where(ar_g[None, :] == g, sg[:, None], lg)
    return lg


@triton.jit
def _list_pos(LISTS, FLISTS, h, sl_h, sl_c, sf_h, sf_c, u, ok, RHO, C, sel, P_PAD: tl.constexpr,
              HAS_FIFO: tl.constexpr, u0=0, ONE_LIST: tl.constexpr = False):
    """CTkvr's candidate slots u (slot u = item u % RHO of the list of the row's probe rank u // RHO:
    entry sel[rank], a persisted list below C, else the FIFO ring's) -> their positions as two loads,
    lists' and FIFO lists', each -1 where the other holds the slot (and both where not ok):
    `tl.maximum` of the two is the position. Two values, so a caller can keep them in flight and
    combine them where it needs them. ONE_LIST (`IvfConfig.rerank_chunk_lists`, where the chunk's slots
    u0 + [0, BLOCK_U) are items of one list: RHO % BLOCK_U == 0): the list's entry and its table are
    chosen once per chunk, as scalars, and the positions are one contiguous load (returned twice)."""
    if ONE_LIST:
        rank = _rank_of(u0, RHO, P_PAD)
        entry = tl.sum(tl.where(tl.arange(0, P_PAD) == rank, sel, 0), 0)
        item = u - rank * RHO
        if HAS_FIFO:
            if entry >= C:
                row = FLISTS + h * sf_h + (entry - C).to(tl.int64) * sf_c
            else:
                row = LISTS + h * sl_h + entry.to(tl.int64) * sl_c
        else:
            row = LISTS + h * sl_h + entry.to(tl.int64) * sl_c
        pa = tl.load(row + item, mask=ok, other=-1)
        return pa, pa
    p_idx = _rank_of(u, RHO, P_PAD)
    item = u - p_idx * RHO
    entry = tl.sum(tl.where(p_idx[:, None] == tl.arange(0, P_PAD)[None, :], sel[None, :], 0), 1)
    if HAS_FIFO:
        from_f = entry >= C
        pa = tl.load(LISTS + h * sl_h + entry.to(tl.int64) * sl_c + item, mask=ok & ~from_f, other=-1)
        pb = tl.load(FLISTS + h * sf_h + (entry - C).to(tl.int64) * sf_c + item, mask=ok & from_f, other=-1)
    else:
        pa = tl.load(LISTS + h * sl_h + entry.to(tl.int64) * sl_c + item, mask=ok, other=-1)
        pb = pa
    return pa, pb


@triton.jit
def _window_lo(QPOS, t, window, s_end, n_ctx):
    """Token t's position and the first context row of its window, the sink's end at least (frame_bounds)."""
    qp = tl.load(QPOS + t).to(tl.int32)
    return qp, tl.minimum(tl.maximum(qp - window + 1, s_end), n_ctx)


@triton.jit
def _frame_rows(j, s_end, window, n_loc, n_ctx, w_lo, qp):
    """Slot j of a token's frame (`frame_bounds`): sink rows [0, s_end), window rows w_lo + [0, window)
    inside the context, then local slots with n_ctx + slot <= q_pos. Returns (context row, local slot,
    whether a context row, whether visible at all)."""
    in_s = j < s_end
    in_w = (j >= s_end) & (j < s_end + window)
    in_l = (j >= s_end + window) & (j < s_end + window + n_loc)
    row = tl.where(in_s, j, w_lo + j - s_end)
    ctx_ok = in_s | (in_w & (row < n_ctx))
    slot = j - s_end - window
    return row, slot, ctx_ok, ctx_ok | (in_l & (n_ctx + slot <= qp))


@triton.jit
def _attend_chunk(m_a, l_a, acc, qm, kt, vt, keep, qk_scale, G: tl.constexpr, PRECISE: tl.constexpr,
                  DOT_FP32: tl.constexpr):
    """The attention's online state (m_a, l_a [G_DOT], acc [G_DOT, D] fp32; the group's heads as rows,
    rows >= G unused) after a chunk of K rows kt and values vt [BLOCK, D], those where `keep` [BLOCK].
    The flash-attention pattern with the attention kernel's rounding (decoder/kernels/attention.py:
    s = q·kᵀ, then P·V with P rounded to the values' dtype, l summing the same rounded P): qm [G_DOT,
    D], the heads' queries, zero past G. (Session 33 found Triton 3.6 computing P·V wrong on the H200
    with the values as the product's first operand; this is the form it computes right.)"""
    ar_q = tl.arange(0, qm.shape[0])
    if DOT_FP32:  # the interpreter's 16-bit dot is wrong: fp32 operands holding the same values
        sc = tl.dot(qm.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    elif kt.dtype == tl.float32:
        sc = tl.dot(qm, tl.trans(kt), input_precision="ieee")
    else:
        sc = tl.dot(qm.to(kt.dtype), tl.trans(kt))  # [G_DOT, BLOCK] fp32
    sc = tl.where((ar_q < G)[:, None] & keep[None, :], sc * qk_scale, float("-inf"))
    m_new = tl.maximum(m_a, tl.max(sc, 1))
    alpha = _exp(m_a - m_new, PRECISE)
    pw = _exp(sc - m_new[:, None], PRECISE)
    if DOT_FP32:
        pr = _round_as(pw, vt.dtype)
        pv = tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
    elif vt.dtype == tl.float32:
        pr = pw
        pv = tl.dot(pw, vt, input_precision="ieee")
    else:
        p16 = pw.to(vt.dtype)
        pr = p16.to(tl.float32)
        pv = tl.dot(p16, vt)  # [G_DOT, D] fp32
    return m_new, l_a * alpha + tl.sum(pr, 1), acc * alpha[:, None] + pv


@triton.jit
def _load_acquire(ptr, SLEEP_NS: tl.constexpr):
    """The int32 at ptr by an acquire load at GPU scope (after a pause of SLEEP_NS ns when > 0): this
    thread's later memory operations are ordered after it. GPU only (inline PTX)."""
    if SLEEP_NS > 0:
        return tl.inline_asm_elementwise(f"nanosleep.u32 {SLEEP_NS}; ld.acquire.gpu.global.u32 $0, [$1];", "=r,l",
                                         [ptr], dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _attend_part(Q, CK, CV, LK, LV, QPOS, PLAN, CTRL, PACC, PML, ATT, sq_h, sq_g, sq_t, sck_h, sck_n, scv_h, scv_n,
                 slk_h, slk_n, slv_h, slv_n, sa_h, sa_g, sa_t, r, a, n_work, n_rows, T, n_ctx, n_loc, s_end, window,
                 KP, scale, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, G_DOT: tl.constexpr,
                 BLOCK_A: tl.constexpr, W_PAD: tl.constexpr, PRECISE: tl.constexpr, DOT_FP32: tl.constexpr,
                 SLEEP_NS: tl.constexpr = 0, TS=None, STAMP: tl.constexpr = False, ACQUIRE: tl.constexpr = False):
    """Attention program a of row r (`_attend_kernel`; one token per row): the last of the row's n_work
    programs attends the frame (sink, window, visible request-local rows: the rows and masks of the
    attention backend and of the rerank's frame program) at once; program a < n_work - 1 waits until the
    row's plan is published (CTRL[r], `_select_kernel`'s PUBLISH), then attends its chunks a, a + n_work
    - 1, ... of BLOCK_A plan positions (valid: s_end <= pos < w_lo, -1 never). Each stores its softmax
    state (max, sum per head; acc [G, D]) in PML / PACC [rows, n_work, G_PAD, ...]; the last of the
    row's programs to take its ticket (CTRL[n_rows + r]) merges the n_work states in program order (the
    same sums on every run) into ATT [KVH, G, T, D] in its dtype."""
    stamp(TS, r * n_work + a, 0, STAMP)  # (timeline: 0 start, 2 plan published, 3 attended, 1 end)
    h = r // T
    t = r % T
    ar_q = tl.arange(0, G_DOT)
    offs_d = tl.arange(0, D)
    ar = tl.arange(0, BLOCK_A)
    qm = tl.load(Q + h * sq_h + t * sq_t + ar_q[:, None] * sq_g + offs_d[None, :], mask=(ar_q < G)[:, None], other=0.0)
    qp, w_lo = _window_lo(QPOS, t, window, s_end, n_ctx)
    m_a = tl.full([G_DOT], NEG_BIG, tl.float32)
    l_a = tl.zeros([G_DOT], tl.float32)
    acc = tl.zeros([G_DOT, D], tl.float32)
    if a == n_work - 1:  # the frame, as `_rerank_kernel`'s frame program walks it
        stamp(TS, r * n_work + a, 2, STAMP)
        n_fr = s_end + window + n_loc
        for c0 in range(0, n_fr, BLOCK_A):
            row, slot, ctx_ok, ok = _frame_rows(c0 + ar, s_end, window, n_loc, n_ctx, w_lo, qp)
            k_ptr = tl.where(ctx_ok[:, None], CK + h * sck_h + row[:, None].to(tl.int64) * sck_n + offs_d[None, :],
                             LK + h * slk_h + slot[:, None].to(tl.int64) * slk_n + offs_d[None, :])
            v_ptr = tl.where(ctx_ok[:, None], CV + h * scv_h + row[:, None].to(tl.int64) * scv_n + offs_d[None, :],
                             LV + h * slv_h + slot[:, None].to(tl.int64) * slv_n + offs_d[None, :])
            kt = tl.load(k_ptr, mask=ok[:, None], other=0.0)
            vt = tl.load(v_ptr, mask=ok[:, None], other=0.0)
            m_a, l_a, acc = _attend_chunk(m_a, l_a, acc, qm, kt, vt, ok, scale, G, PRECISE, DOT_FP32)
    else:
        # the row's select program runs (PDL lets this launch in only once every select program has passed its
        # counting pass, or its mass pass; without PDL this launch follows the select): it will publish (a release
        # of 1, after the plan's stores). Every thread polls the flag with acquire loads (ld.acquire.gpu, not
        # atomics, which all go to the flag's L2 slice), a pause between them: the load that sees 1 orders this
        # thread's later loads after it (SASS: LDG.E.STRONG.GPU + CCTL.IVALL), and the plan's addresses are
        # computed from its value, so no compiler can issue them before the wait ends either. Measured free
        # against sessions 34-35's volatile polls (H200, session 36), whose closing `tl.atomic_add(..., sem=
        # "acquire")`, its result unused, compiled to no instruction. The interpreter (ACQUIRE off: no inline
        # PTX) runs this launch after the select: plain loads there.
        if ACQUIRE:
            ready = _load_acquire(CTRL + r, 0)
            while ready == 0:
                ready = _load_acquire(CTRL + r, SLEEP_NS)
        else:
            ready = tl.load(CTRL + r, volatile=True)
            while ready == 0:
                ready = tl.load(CTRL + r, volatile=True)
        stamp(TS, r * n_work + a, 2, STAMP)
        plan_row = PLAN + r * KP + (ready - 1)  # ready == 1: the address depends on the acquired value
        for c in range(a, (KP + BLOCK_A - 1) // BLOCK_A, n_work - 1):
            j = c * BLOCK_A + ar
            pos = tl.load(plan_row + j, mask=j < KP, other=-1, cache_modifier=".cg")  # another SM's stores
            ok = (pos >= s_end) & (pos < w_lo)
            kt = tl.load(CK + h * sck_h + pos[:, None].to(tl.int64) * sck_n + offs_d[None, :], mask=ok[:, None],
                         other=0.0)
            vt = tl.load(CV + h * scv_h + pos[:, None].to(tl.int64) * scv_n + offs_d[None, :], mask=ok[:, None],
                         other=0.0)
            m_a, l_a, acc = _attend_chunk(m_a, l_a, acc, qm, kt, vt, ok, scale, G, PRECISE, DOT_FP32)
    stamp(TS, r * n_work + a, 3, STAMP)
    part = r * n_work + a
    g_ok = ar_q < G
    tl.store(PACC + (part * G_PAD + ar_q[:, None]) * D + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(PML + (part * G_PAD + ar_q) * 2, m_a, mask=g_ok)
    tl.store(PML + (part * G_PAD + ar_q) * 2 + 1, l_a, mask=g_ok)
    tl.debug_barrier()  # every thread's state stores before the ticket
    if tl.atomic_add(CTRL + n_rows + r, 1, sem="acq_rel") == n_work - 1:
        _merge_parts(PACC, PML, ATT, r * n_work, h, t, n_work, sa_h, sa_g, sa_t, G, G_PAD, D, W_PAD, PRECISE)
    stamp(TS, r * n_work + a, 1, STAMP)


@triton.jit
def _merge_parts(PACC, PML, ATT, base, h, t, n_work, sa_h, sa_g, sa_t, G: tl.constexpr, G_PAD: tl.constexpr,
                 D: tl.constexpr, W_PAD: tl.constexpr, PRECISE: tl.constexpr):
    """The n_work softmax states of a row (`_attend_part`) merged in one tile: out = sum_w acc_w
    exp(m_w - M) / sum_w l_w exp(m_w - M), M the largest max, stored as ATT[h, :, t, :] in its dtype.
    The states are other programs' stores, published by their tickets: read from L2 (".cg"; volatile
    loads were issued one after another: a 9 µs merge on the H200, session 34)."""
    ar_w = tl.arange(0, W_PAD)
    ar_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    okw = ar_w < n_work
    part = base + ar_w
    at = (part[:, None] * G_PAD + ar_g[None, :]) * 2
    m = tl.load(PML + at, mask=okw[:, None], other=NEG_BIG, cache_modifier=".cg")
    l_s = tl.load(PML + at + 1, mask=okw[:, None], other=0.0, cache_modifier=".cg")
    mx = tl.max(m, 0)
    wt = tl.where(okw[:, None], _exp(m - mx[None, :], PRECISE), 0.0)  # [W_PAD, G_PAD]
    acc = tl.load(PACC + (part[:, None, None] * G_PAD + ar_g[None, :, None]) * D + offs_d[None, None, :],
                  mask=okw[:, None, None], other=0.0, cache_modifier=".cg")
    o = tl.sum(acc * wt[:, :, None], 0) / tl.sum(l_s * wt, 0)[:, None]
    tl.store(ATT + h * sa_h + ar_g[:, None] * sa_g + t * sa_t + offs_d[None, :], o.to(ATT.dtype.element_ty),
             mask=(ar_g < G)[:, None])


@triton.jit(do_not_specialize=["T", "n_ctx", "n_loc", "s_end", "window", "U", "C", "RHO", "n_top", "NW",
                               "n_slot_progs", "chunks_per_prog"])
def _rerank_kernel(
    Q, CK, LK, QPOS, SRC_A, SRC_B, SRC_C, SRC_D, BITMAP, WS_S, WS_POS, WS_ML, HITS, CTRL,
    sq_h, sq_g, sq_t,  # q [KVH, G, T, D]
    sck_h, sck_n, slk_h, slk_n,  # ctx_k [KVH, N, D], loc_k [KVH, M, D]
    sa_h, sa_c, sb_h, sb_c,  # CTkvr: lists [KVH, C, RHO], FIFO lists [KVH, F, RHO]; kivf: order [KVH, N]
    T, n_ctx, n_loc, s_end, window, U, C, RHO, n_top, NW, n_slot_progs, chunks_per_prog, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_U: tl.constexpr,
    P: tl.constexpr, P_PAD: tl.constexpr, BLOCK_T: tl.constexpr, LOG_P: tl.constexpr,
    SOURCE: tl.constexpr, DEDUP: tl.constexpr, HAS_FIFO: tl.constexpr, PRECISE: tl.constexpr,
    EAGER_ROWS: tl.constexpr = False, ONE_MASK: tl.constexpr = True, DOT: tl.constexpr = False,
    DOT_FP32: tl.constexpr = False, PREFETCH: tl.constexpr = False, LOADS_FIRST: tl.constexpr = False,
    ONE_LIST: tl.constexpr = False, ZERO_CTRL: tl.constexpr = False, TS=None, STAMP: tl.constexpr = False,
):
    """SOURCE 0 (CTkvr): SRC_A/B = the probe's block bests (values, ids), SRC_C/D = lists / FIFO
    lists. SOURCE 1 (kivf): SRC_A = order, SRC_B = SEL_START, SRC_C = SEL_CUM. PREFETCH (CTkvr): each
    chunk issues the next chunk's list loads before its own work (`IvfConfig.rerank_prefetch`).
    LOADS_FIRST (`IvfConfig.rerank_loads_first`): a slot program loads the query position after its
    merge's and its first lists' loads (the compiled code issues loads in order and stalls at a value's
    first use: without it every program waits for the query position before its merge's loads issue).
    ONE_LIST (CTkvr, `IvfConfig.rerank_chunk_lists`): a chunk's slots are items of one list (RHO %
    BLOCK_U == 0), so its probe rank, entry and table are scalars (`_list_pos`). ZERO_CTRL: the plan is
    attended (`_attend_kernel`): each frame program zeroes its row's plan flag and merge ticket, CTRL[r]
    and CTRL[rows + r]."""
    s = tl.program_id(0)
    r = tl.program_id(1)
    stamp(TS, r * tl.num_programs(0) + s, 0, STAMP)
    h = (r // T).to(tl.int64)
    t = r % T
    r64 = r.to(tl.int64)
    offs_d = tl.arange(0, D)
    ar_g = tl.arange(0, G_PAD)
    ar_u = tl.arange(0, BLOCK_U)
    if not LOADS_FIRST:
        qp, w_lo = _window_lo(QPOS, t, window, s_end, n_ctx)
    m_v = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_v = tl.zeros([G_PAD], tl.float64)  # float64: see _lse_parts
    if s == n_slot_progs:
        if ZERO_CTRL:
            tl.store(CTRL + r, 0)
            tl.store(CTRL + tl.num_programs(1) + r, 0)
        if LOADS_FIRST:
            qp, w_lo = _window_lo(QPOS, t, window, s_end, n_ctx)
        # the frame: sink rows [0, s_end), window rows w_lo + [0, window) inside the context, local
        # slots j with n_ctx + j <= q_pos (frame_logsumexp); no logits are stored
        n_fr = s_end + window + n_loc
        for c0 in range(0, n_fr, BLOCK_U):
            row, slot, ctx_ok, ok = _frame_rows(c0 + ar_u, s_end, window, n_loc, n_ctx, w_lo, qp)
            ptr = tl.where(ctx_ok[:, None], CK + h * sck_h + row[:, None].to(tl.int64) * sck_n + offs_d[None, :],
                           LK + h * slk_h + slot[:, None].to(tl.int64) * slk_n + offs_d[None, :])
            kt = tl.load(ptr, mask=ok[:, None], other=0.0)
            lg = _group_logits(kt, ok, Q + h * sq_h + t * sq_t, sq_g, qk_scale, G, G_PAD, D, BLOCK_U, ONE_MASK, DOT,
                               DOT_FP32)
            m_new = tl.maximum(m_v, tl.max(lg, 0))
            l_v = (l_v * _exp(m_v - m_new, PRECISE).to(tl.float64)
                   + tl.sum(_exp(lg - m_new[None, :], PRECISE).to(tl.float64), 0))
            m_v = m_new
    else:
        if SOURCE == 0:
            sel = _merge_probe(SRC_A, SRC_B, r64 * n_top, n_top, P, P_PAD, BLOCK_T)  # [P_PAD] entry ids
            stamp(TS, r * tl.num_programs(0) + s, 2, STAMP)  # (timeline: 2 the merge, 3.. each chunk, 1 end)
            if HAS_FIFO:
                if s == 0:  # the probe-share statistic: probed entries that came from the FIFO
                    tl.store(HITS + r, tl.sum(((sel >= C) & (tl.arange(0, P_PAD) < P)).to(tl.int32), 0))
        n_ci = chunks_per_prog
        if SOURCE == 0:
            if PREFETCH:  # the first chunk's list loads; each chunk issues the next one's (below)
                u0 = s * chunks_per_prog * BLOCK_U + ar_u
                pa_nx, pb_nx = _list_pos(SRC_C, SRC_D, h, sa_h, sa_c, sb_h, sb_c, u0, u0 < U, RHO, C, sel, P_PAD,
                                         HAS_FIFO, s * chunks_per_prog * BLOCK_U, ONE_LIST)
        if SOURCE == 1:  # kivf: the chunks past the probed clusters' keys (the static width's padding) are skipped:
            # the select reads no slot past them (`_select_kernel`, N_ROW)
            live_end = tl.load(SRC_C + r64 * (P_PAD + 1) + P) - s * chunks_per_prog * BLOCK_U
            n_ci = tl.minimum(tl.maximum((live_end + BLOCK_U - 1) // BLOCK_U, 0), chunks_per_prog)
        if LOADS_FIRST:
            qp, w_lo = _window_lo(QPOS, t, window, s_end, n_ctx)
        for ci in range(0, n_ci):
            c_u0 = (s * chunks_per_prog + ci) * BLOCK_U
            u = c_u0 + ar_u
            in_u = u < U
            if SOURCE == 0:
                if ONE_LIST:
                    p_idx = _rank_of(c_u0, RHO, P_PAD)
                else:
                    p_idx = _rank_of(u, RHO, P_PAD)
                if PREFETCH:
                    pos = tl.maximum(pa_nx, pb_nx)
                    u_nx = u + BLOCK_U
                    pa_nx, pb_nx = _list_pos(SRC_C, SRC_D, h, sa_h, sa_c, sb_h, sb_c, u_nx,
                                             (u_nx < U) & (ci + 1 < n_ci), RHO, C, sel, P_PAD, HAS_FIFO,
                                             c_u0 + BLOCK_U, ONE_LIST)
                else:
                    pa, pb = _list_pos(SRC_C, SRC_D, h, sa_h, sa_c, sb_h, sb_c, u, in_u, RHO, C, sel, P_PAD, HAS_FIFO,
                                       c_u0, ONE_LIST)
                    pos = tl.maximum(pa, pb)
            else:
                # the probed cluster holding slot u: the last i with SEL_CUM[i] <= u (binary search)
                cum_row = SRC_C + r64 * (P_PAD + 1)
                total = tl.load(cum_row + P)
                lo = tl.zeros([BLOCK_U], tl.int32)
                hi = tl.full([BLOCK_U], P, tl.int32)
                for _ in tl.static_range(LOG_P):
                    mid = (lo + hi) // 2
                    cm = tl.load(cum_row + mid, mask=hi - lo > 1, other=0)
                    go = (hi - lo > 1) & (cm <= u)
                    stay = (hi - lo > 1) & (cm > u)
                    lo = tl.where(go, mid, lo)
                    hi = tl.where(stay, mid, hi)
                live = in_u & (u < total)  # slots past the probed clusters' keys: padding
                start = tl.load(SRC_B + r64 * P_PAD + lo, mask=live, other=0)
                cm = tl.load(cum_row + lo, mask=live, other=0)
                pos = tl.load(SRC_A + h * sa_h + (start + u - cm).to(tl.int64), mask=live, other=-1)
            ok = in_u & (pos >= s_end) & (pos < w_lo)  # selectable: outside the sink and the window
            k_ptr = CK + h * sck_h + pos[:, None].to(tl.int64) * sck_n + offs_d[None, :]
            if EAGER_ROWS:  # load every selectable row before the dedup's atomic answers: the two overlap
                kt = tl.load(k_ptr, mask=ok[:, None], other=0.0)
            first = ok
            if DEDUP:
                # bit p_idx of the position's P_PAD bits: which probe ranks hold it. The slot of the
                # lowest rank is the one the select keeps (`_survivors`: a function of the lists,
                # not of the programs' race); the first slot to set any of the position's bits
                # counts its logit in the lse (one per position, whichever it is: same value).
                at = pos * P_PAD + p_idx
                bit = (1 << (at & 31)).to(tl.int32)
                old = tl.atomic_or(BITMAP + r64 * NW + (at >> 5), bit, mask=ok, sem="relaxed")
                first = ok & ((old & _position_bits(pos, P_PAD)) == 0)
                ok = ok & ((old & bit) == 0)  # a list that held a position twice: one slot of it
            if not EAGER_ROWS:
                kt = tl.load(k_ptr, mask=ok[:, None], other=0.0)
            lg = _group_logits(kt, ok, Q + h * sq_h + t * sq_t, sq_g, qk_scale, G, G_PAD, D, BLOCK_U, ONE_MASK, DOT,
                               DOT_FP32)
            tl.store(WS_S + (r64 * U + u[:, None]) * G + ar_g[None, :], lg, mask=in_u[:, None] & (ar_g < G)[None, :])
            tl.store(WS_POS + r64 * U + u, tl.where(ok, pos, -1), mask=in_u)
            if DEDUP:
                lg = tl.where(first[:, None], lg, float("-inf"))
            stamp(TS, r * tl.num_programs(0) + s, tl.minimum(3 + ci, 6), STAMP)
            m_new = tl.maximum(m_v, tl.max(lg, 0))
            l_v = (l_v * _exp(m_v - m_new, PRECISE).to(tl.float64)
                   + tl.sum(_exp(lg - m_new[None, :], PRECISE).to(tl.float64), 0))
            m_v = m_new
    at = ((r64 * (n_slot_progs + 1) + s) * G_PAD + ar_g) * 2
    tl.store(WS_ML + at, m_v.to(tl.float64))
    tl.store(WS_ML + at + 1, l_v)
    stamp(TS, r * tl.num_programs(0) + s, 1, STAMP)


# ---------------------------------------------------------------------------------------------
# Group mass + top-K (shared)


@triton.jit
def _row_keys(WS_S, WS_POS, WS_ML, row, r, U, n, n_parts, BITMAP, NW, RHO, G: tl.constexpr, G_PAD: tl.constexpr,
              BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, PRECISE: tl.constexpr, SAMPLE: tl.constexpr = False,
              DEDUP: tl.constexpr = False, PB: tl.constexpr = 1, TS=None, prog=0, STAMP: tl.constexpr = False):
    """Row r's int keys -> row[0:n] (group mass as float bits + 1, 0 = not a candidate: DEDUP, also
    a CTkvr slot whose position a lower probe rank holds, `_survivors`; the row's first n slots of the
    rerank's U, the rest padding that nothing reads: `_select_kernel`'s N_ROW), and a lower
    bound > 0 of the valid keys, their count and an upper bound (exclusive) of all keys. Without
    SAMPLE, or when the row fits one block, the bounds are the smallest valid key and the max + 1,
    from a second pass over the stored keys (which every thread reads alike: a thread's own copy of
    a replicated float result may differ in the last bit, indexer/kernels/psa.py, _select_kernel);
    with SAMPLE and more keys than a block they are 1 and KEY_INF + 1 (the search's sample bracket
    finds the range) and the count is taken in the mass pass (validity does not depend on rounding).
    Counts and extremes accumulate per element over the chunks and reduce once."""
    lse = _lse_parts(WS_ML + r * n_parts * G_PAD * 2, n_parts, G, G_PAD, BLOCK_S, PRECISE)
    stamp(TS, prog, 1, STAMP)
    ar_g = tl.arange(0, G_PAD)
    ar = tl.arange(0, BLOCK)
    pos_row = WS_POS + r * U
    n_ok = tl.zeros([BLOCK], tl.int32)
    ok_g = (ar_g < G)[None, :]
    lse_k = tl.where(ar_g < G, lse, 0.0)  # padded heads (-inf): masked after, without inf - inf
    s_row = WS_S + r * U * G
    pos_nx = tl.load(pos_row + ar, mask=ar < n, other=-1)
    lg_nx = tl.load(s_row + ar[:, None] * G + ar_g[None, :], mask=(ar < n)[:, None] & ok_g, other=float("-inf"))
    for c0 in range(0, n, BLOCK):
        u = c0 + ar
        inn = u < n
        pos = pos_nx
        lg = lg_nx
        if DEDUP:  # (its map word's load in flight with the next chunk's and the masses)
            pos = tl.where(_survivors(BITMAP, NW, r, pos, u, RHO, PB), pos, -1)
        nx = u + BLOCK  # the next chunk's loads in flight while this one is computed
        pos_nx = tl.load(pos_row + nx, mask=nx < n, other=-1)
        lg_nx = tl.load(s_row + nx[:, None] * G + ar_g[None, :], mask=(nx < n)[:, None] & ok_g, other=float("-inf"))
        mass = tl.sum(tl.where(ok_g, _exp(lg - lse_k[None, :], PRECISE), 0.0), 1)
        valid = (pos >= 0) & (mass == mass)
        key = tl.where(valid, tl.minimum(mass.to(tl.int32, bitcast=True) + 1, KEY_INF), 0)
        tl.store(row + u, key, mask=inn)
        n_ok += (valid & inn).to(tl.int32)
    tl.debug_barrier()
    if SAMPLE & (n > BLOCK):
        key_min = n * 0 + 1
        n_valid = tl.sum(n_ok, 0)
        key_hi = n * 0 + KEY_INF + 1
    else:
        k_max = tl.zeros([BLOCK], tl.int32)
        k_min = tl.full([BLOCK], INT_MAX, tl.int32)
        n_ok = tl.zeros([BLOCK], tl.int32)
        for c0 in range(0, n, BLOCK):
            u = c0 + ar
            key = tl.load(row + u, mask=u < n, other=0)
            k_max = tl.maximum(k_max, key)
            k_min = tl.minimum(k_min, tl.where(key > 0, key, INT_MAX))
            n_ok += (key > 0).to(tl.int32)
        key_min = tl.min(k_min, 0)
        n_valid = tl.sum(n_ok, 0)
        key_hi = tl.max(k_max, 0) + 1
    return key_min, n_valid, key_hi


@triton.jit(do_not_specialize=["T", "U", "n_parts", "KP", "RHO", "scr_row", "NW", "sn_r", "KS"])
def _select_kernel(
    WS_S, WS_POS, WS_ML, SCR, OUT, PUSH, BITMAP, N_ROW, CTRL,
    T, U, n_parts, KP, RHO, scr_row, NW, sn_r, KS,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_PUSH: tl.constexpr, PRECISE: tl.constexpr, SAMPLE: tl.constexpr = False,
    DEDUP: tl.constexpr = False, PB: tl.constexpr = 1, HAS_N_ROW: tl.constexpr = False, SCAN_V: tl.constexpr = 1,
    PUBLISH: tl.constexpr = False, PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False, TS=None,
    STAMP: tl.constexpr = False,
):
    """Grid (rows, 1 + HAS_PUSH). Per row: lse per head over the parts (candidates + frame), mass of
    each slot = sum over heads of exp(logit - lse) (candidate_mass) as an int key (float bits + 1;
    0 = not a candidate), the top-KP -> OUT [rows, KP]; on the last token's rows (HAS_PUSH) also the
    top-RHO -> PUSH [KVH, RHO]. A push row's two sets are two programs, each over all of the row's
    keys (program 0 the push, 1 the plan; program 1 of another row has nothing to do): the mass
    arithmetic twice, in parallel, instead of the smaller set selected inside the larger one after
    it (52 -> 35 us at the 8B shape, H100; benchmarks/RESULTS.md). SCR row per program: [keys U |
    ping U | pong U]. HAS_N_ROW (kivf): row r's live slots are its first min(U, N_ROW[r * sn_r]), the
    probed clusters' keys (U is the static width, the most any probe can hold: 1.5-1.9x on real
    layers); the mass pass, the search and the emit stop there (the rerank skips the rest). KS: 1, the
    keys' stride in a scratch row, a run-time argument so that SCAN_V (`IvfConfig.count_rows`) gets its
    layout (`_chunk_offsets`). PUBLISH (the plan attended by `_attend_kernel`, launched next): a plan's
    program sets CTRL[r] = 1 (release) once the row is written; PDL: every program lets that launch
    start after its mass pass (its programs then wait for the flags while this one searches; let in at
    the start, they slowed the lse and mass pass by ~0.5 us on the H200, session 34); PDL_LATE
    (`IvfConfig.attend_late`, the default): after its counting pass (`_select_sampled`'s LET_IN), which
    they slowed by ~0.9 us (session 35)."""
    r = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    prog = r * tl.num_programs(1) + w  # (timeline stamps: slots 0 start, 1 lse, 2 keys, 3-6 search, 7 end)
    stamp(TS, prog, 0, STAMP)
    h = r // T
    t = r % T
    push_row = False
    if HAS_PUSH:
        push_row = t == T - 1
    if (w == 0) | push_row:
        row = SCR + (r * tl.num_programs(1) + w) * scr_row
        n = U
        if HAS_N_ROW:
            n = tl.minimum(tl.load(N_ROW + r * sn_r), U)
        key_min, n_valid, key_hi = _row_keys(WS_S, WS_POS, WS_ML, row, r, U, n, n_parts, BITMAP, NW, RHO, G, G_PAD,
                                             BLOCK, BLOCK_S, PRECISE, SAMPLE, DEDUP, PB, TS, prog, STAMP)
        if PDL & ((not PDL_LATE) | (not SAMPLE)):
            gdc_launch_dependents()
        stamp(TS, prog, 2, STAMP)
        if push_row & (w == 0):
            k = RHO
            out = PUSH + h * RHO
        else:
            k = KP
            out = OUT + r * KP
        if SAMPLE:
            _select_sampled(row, WS_POS + r * U, n, k, key_min, n_valid, key_hi, out, BLOCK, SCAN_V, KS, TS, prog,
                            STAMP, LET_IN=PDL & PDL_LATE)
        else:
            thr, take = _top_threshold(row, n, k, key_min, n_valid, key_hi, BLOCK)
            _emit(row, WS_POS + r * U, n, thr, take, k, out, BLOCK)
        if PUBLISH:
            if w == tl.num_programs(1) - 1:  # the plan's program (one token: program 1 of 2 with the push)
                tl.debug_barrier()  # every thread's plan stores before the flag
                tl.atomic_xchg(CTRL + r, 1, sem="release")
        stamp(TS, prog, 7, STAMP)
    elif PDL:  # (a program with nothing to select lets it in too: the launch waits for every program's)
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["T", "KP", "n_ctx", "n_loc", "s_end", "window"])
def _attend_kernel(Q, CK, CV, LK, LV, QPOS, PLAN, CTRL, PACC, PML, ATT, sq_h, sq_g, sq_t, sck_h, sck_n, scv_h, scv_n,
                   slk_h, slk_n, slv_h, slv_n, sa_h, sa_g, sa_t, T, n_ctx, n_loc, s_end, window, KP, scale,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, G_DOT: tl.constexpr, BLOCK_A: tl.constexpr,
                   W_PAD: tl.constexpr, PRECISE: tl.constexpr, DOT_FP32: tl.constexpr, SLEEP_NS: tl.constexpr = 0,
                   PDL: tl.constexpr = False, TS=None, STAMP: tl.constexpr = False, ACQUIRE: tl.constexpr = False):
    """Grid (n_work, rows): CTkvr's plan attended (`_attend_part`), launched right after the select
    that publishes the rows (PUBLISH). With PDL it starts while the select runs (every select program
    let it in at its start, so each one it waits for is running: no deadlock), and each program ends
    by waiting for the select's completion (`gdc_wait`), so what follows this launch on the stream sees
    the select's writes (the FIFO push's list) as after a plain launch."""
    _attend_part(Q, CK, CV, LK, LV, QPOS, PLAN, CTRL, PACC, PML, ATT, sq_h, sq_g, sq_t, sck_h, sck_n, scv_h, scv_n,
                 slk_h, slk_n, slv_h, slv_n, sa_h, sa_g, sa_t, tl.program_id(1).to(tl.int64), tl.program_id(0),
                 tl.num_programs(0), tl.num_programs(1), T, n_ctx, n_loc, s_end, window, KP, scale, G, G_PAD, D,
                 G_DOT, BLOCK_A, W_PAD, PRECISE, DOT_FP32, SLEEP_NS, TS, STAMP, ACQUIRE)
    if PDL:
        gdc_wait()


@triton.jit
def _select_sampled(ROW, POS, n, K, key_lo, n_valid, key_hi, OUT, BLOCK: tl.constexpr, SCAN_V: tl.constexpr = 1,
                    ks=1, TS=None, prog=0, STAMP: tl.constexpr = False, LET_IN: tl.constexpr = False):
    """The top-K of the keys ROW[0:n] (0 = empty; key_lo a lower bound > 0 of the valid ones, n_valid
    their count, key_hi an upper bound of all) written as their positions POS[0:n] into OUT[0:K] (the
    set `_top_threshold` + `_emit` write: valid keys first, -1 after), the search bracketed from a
    sample and the emit fused into its counting pass.

    `_sample_bracket` guesses a band [a, b); one pass over the keys writes the positions of the keys
    >= b into OUT (masked to K slots) and compacts the band's keys and positions into the ping and
    pong regions of ROW (layout [keys n | ping n | pong n]), both counts from one packed scan per
    chunk. When the counts confirm the guess (fewer than K keys >= b, at least K >= a) and the band
    fits one block, the search ends in registers over the band and the band's share of the top-K
    follows the keys >= b in OUT: OUT holds the same set as the plain emit's, in another order (the
    keys >= b in array order, then the band's). Otherwise the search goes on from what the counts
    proved (inside the band, or above b, or below a) and the plain emit rewrites OUT. Returns the
    path: 0 no search needed or no sample (n_valid <= K or n <= BLOCK), 1 the band in registers, 2
    the band confirmed but larger than a block, 3 the guess refuted (for the tests). LET_IN: the program
    lets its launch's dependent launch in (PDL) after the counting pass (before the plain search)."""
    tl.static_assert(BLOCK < 65536)
    ar = tl.arange(0, BLOCK)
    path = n * 0
    thr = n * 0
    take = n * 0
    if (n_valid > K) & (n > BLOCK):
        a, b = _sample_bracket(ROW, 0, n, K, key_lo, key_hi, BLOCK)
        stamp(TS, prog, 3, STAMP)
        n_ge = n * 0
        n_bd = n * 0
        for c0 in range(0, n, BLOCK):
            o = _chunk_offsets(c0, BLOCK, SCAN_V, ks)
            inn = o < n
            key = tl.load(ROW + o, mask=inn, other=-1)
            pos = tl.load(POS + o, mask=inn, other=-1)
            ge = (key >= b) & inn
            bd = (key >= a) & (key < b) & inn
            sc, tot = _chunk_scan(ge.to(tl.int32) + (bd.to(tl.int32) << 16))
            at_ge = n_ge + (sc & 0xFFFF) - 1
            at_bd = n_bd + (sc >> 16) - 1
            tl.store(OUT + at_ge, pos, mask=ge & (at_ge < K))
            tl.store(ROW + n + at_bd, key, mask=bd)
            tl.store(ROW + 2 * n + at_bd, pos, mask=bd)
            n_ge += tot & 0xFFFF
            n_bd += tot >> 16
        tl.debug_barrier()  # the band's stores (and OUT's) before other threads read (or rewrite) them
        stamp(TS, prog, 4, STAMP)
        if LET_IN:  # the dependent launch (`_attend_kernel`) may start now
            gdc_launch_dependents()
        if (n_ge < K) & (n_ge + n_bd >= K):
            if n_bd <= BLOCK:
                path = n * 0 + 1
                band = tl.load(ROW + n + ar, mask=ar < n_bd, other=-1)
                thr, take = _bisect_regs(band, n, K, a, b, n_ge, (n_ge + n_bd == K).to(tl.int32))
                stamp(TS, prog, 5, STAMP)
                if SCAN_V > 1:  # the emit's scan in the counting pass's layout (the band read again in it)
                    ob = _chunk_offsets(0, BLOCK, SCAN_V, ks)
                    band2 = tl.load(ROW + n + ob, mask=ob < n_bd, other=-1)
                    bpos = tl.load(ROW + 2 * n + ob, mask=ob < n_bd, other=-1)
                    _emit_slots(band2, bpos, thr, take, n_ge, n * 0, OUT, ROWS=True)
                else:
                    bpos = tl.load(ROW + 2 * n + ar, mask=ar < n_bd, other=-1)
                    _emit_slots(band, bpos, thr, take, n_ge, n * 0, OUT)
                stamp(TS, prog, 6, STAMP)
            else:  # the search goes on over the band in ping (its positions in pong are not needed)
                path = n * 0 + 2
                thr, take = _kth_search(ROW, n, n_bd, n, 2 * n, n, K, a, b, n_ge, n_bd,
                                        (n_ge + n_bd == K).to(tl.int32), BLOCK)
        elif n_ge >= K:  # the K-th key is >= b
            path = n * 0 + 3
            thr, take = _kth_search(ROW, n * 0, n, n, 2 * n, n, K, b, key_hi + n * 0, n * 0, n_ge,
                                    (n_ge == K).to(tl.int32), BLOCK)
        else:  # the K-th key is < a
            path = n * 0 + 3
            thr, take = _kth_search(ROW, n * 0, n, n, 2 * n, n, K, key_lo + n * 0, a, n_ge + n_bd,
                                    n_valid - n_ge - n_bd, n * 0, BLOCK)
    else:
        if LET_IN:
            gdc_launch_dependents()
        thr, take = _top_threshold(ROW, n, K, key_lo, n_valid, key_hi, BLOCK)
    if path != 1:
        _emit(ROW, POS, n, thr, take, K, OUT, BLOCK)
    return path


# ---------------------------------------------------------------------------------------------
# CTkvr FIFO push (update)


@triton.jit(do_not_specialize=["cap", "RHO", "rows"])
def _fifo_push_kernel(
    FCENT, FLISTS, PUSHES, SHARE, PQ, PL, HITS, TICKET,
    sfc_h, sfc_c, sfc_g, sfl_h, sfl_c, spq_h, spq_g,
    cap, RHO, rows, n_probed,
    G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (KVH, ceil(RHO / BLOCK)): program (h, c) copies chunk c of head h's pending list (c = 0:
    also its pending query) into ring slot pushes % cap. The last program to take the ticket (every
    other one has read `pushes` by then) adds the probe share (FIFO hits / probed entries) to SHARE,
    sets pushes += 1 and puts the ticket back to 0 for the next push on this stream."""
    h = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = tl.load(PUSHES)
    slot = n % cap
    o = c * BLOCK + tl.arange(0, BLOCK)
    lv = tl.load(PL + h * RHO + o, mask=o < RHO, other=-1)
    if c == 0:
        offs_d = tl.arange(0, D)
        for g in tl.static_range(G):
            qv = tl.load(PQ + h * spq_h + g * spq_g + offs_d)
            tl.store(FCENT + h * sfc_h + slot * sfc_c + g * sfc_g + offs_d, qv)
    tl.store(FLISTS + h * sfl_h + slot * sfl_c + o, lv, mask=o < RHO)
    ticket = tl.atomic_add(TICKET, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        ar = tl.arange(0, BLOCK)
        hits = rows * 0
        for c0 in range(0, rows, BLOCK):
            i = c0 + ar
            hits += tl.sum(tl.load(HITS + i, mask=i < rows, other=0), 0)
        share = hits.to(tl.float32) / n_probed
        tl.store(SHARE, tl.load(SHARE) + share)
        tl.store(PUSHES, n + 1)
        tl.store(TICKET, 0)


# ---------------------------------------------------------------------------------------------
# Launch configuration and workspaces (host ints from shapes only)


@dataclass(frozen=True)
class IvfConfig:
    """Tuning knobs (defaults swept or A/B-tested on an H100: benchmarks/RESULTS.md)."""

    block_c: int = 32  # probe: entries per program (64 -> 32: probe 18.2 -> 13.4 us at 128K, H100; RESULTS.md)
    block_u: int = 64  # rerank: candidate slots per chunk
    chunks_per_prog: int = 2  # rerank: chunks per program (1 -> 2: ctkvr's rerank 32.0 -> 27.4 µs, H100; RESULTS.md)
    select_block: int = 2048  # select: keys per chunk (capped at next_pow2(U))
    probe_warps: int = 4
    probe_one_load: bool = True  # probe: every head's centroid rows in one load (False: one head at a time;
    # probe 14.1-14.8 -> 9.0-11.4 us at 128K, H200; RESULTS.md)
    probe_fifo_blocks: bool = True  # probe: where C % block_c == 0, a block's table (persisted or FIFO) chosen per
    # program, not per element (RESULTS.md, session 32)
    probe_loads_first: bool = True  # probe: the block's rows loaded before the query and the push count
    probe_maxnreg: int | None = None  # probe: register cap per thread on CUDA (None: the compiler's)
    rerank_warps: int = 4
    rerank_maxnreg: int | None = 96  # rerank: register cap per thread on CUDA (0 / None: the compiler's, 159 at
    # the 8B shape, 3 programs per SM); 96: 5 per SM, rerank 27.5 -> 24.0 us at 128K (H100; RESULTS.md)
    select_warps: int = 8
    wide_select_from: int = 16384  # select: rows of at least this many candidate slots (U, from shapes) use the
    wide_select_block: int = 4096  # wide block and warps. kivf at 128K (U 45,615, ~26K of them probed keys):
    wide_select_warps: int = 16  # select 58.9 -> 44 us, step 153 -> 138; at 32K (U 12,485) 17.2 -> 21.7, and
    # CTkvr's U = 10,240 was slower too (H200, sessions 26-27; benchmarks/RESULTS.md)
    eager_rows: bool = True  # rerank: K rows loaded before the dedup atomic answers (rerank 30.1 -> 27.3 us, 128K)
    rerank_dot: bool = True  # rerank: q.k of 16-bit K rows on tensor cores (tl.dot), not row-wise FMAs (CTkvr's
    # rerank 21.4 -> 14.2 us at 128K, H200; RESULTS.md session 28)
    rerank_stages: int = 1  # rerank: Triton's num_stages for its chunk loop (2: rerank 14.2 -> 16.0 us with the dot)
    rerank_prefetch: bool = True  # rerank (CTkvr): each chunk issues the next chunk's list loads before its own work
    # (the second chunk 4.7 -> 3.7 us, a program 13.8 -> 13.1, the kernel's end 0.3 us sooner at 128K; H200, session 31)
    rerank_loads_first: bool = False  # rerank: the query position loaded after the merge's and the first lists'
    # loads (static SASS: otherwise every program waits for it first). H200, session 33: the merge phase 2.8 -> 2.3
    # us, the first chunk 5.1 -> 5.4, the step the same (128K 60.3-60.7 against 60.1-61.3 us): off
    rerank_chunk_lists: bool = True  # rerank (CTkvr): where rho % block_u == 0 a chunk's slots are one list's items:
    # its entry and table (persisted or FIFO) chosen once per chunk, its positions one contiguous load (session 33)
    attend: bool = True  # CTkvr, one token, asked (`ctkvr_plan(attend_scale=)`): the plan attended by `_attend_kernel`
    attend_block: int = 64  # its attention programs' chunk of plan positions (at most ATTEND_TILE_MAX // head_dim)
    attend_workers: int | None = None  # the plan's attention programs per row (None: `_attend_programs`)
    attend_sleep_ns: int = 64  # their pause between two polls of the plan's flag (GPU; 0: none)
    attend_warps: int = 4
    attend_pdl: bool = True  # launched under PDL (Hopper+): it starts while the select runs, not after it
    attend_late: bool = True  # the select lets it in after its counting pass, not after its mass pass (its count
    # 5.2 -> 4.3 us with no attention program beside it yet; 128K 55.0-55.1 -> 54.5-54.6 us, 512K 55.4-55.6 -> 54.6-54.8
    # (10.04-10.08x SDPA); H200, session 35)
    sample_select: bool = True  # select: `_select_sampled` (27.6 -> 19.5 us at 128K, H100; RESULTS.md); False: plain
    count_rows: int = 4  # select: consecutive keys per thread in the sampled select's counting pass and its band's
    # emit, a power of two (`_chunk_offsets`; 1: one key per thread per repetition of the chunk's layout). At 128K
    # (H200, RESULTS.md session 30) the pass took 6.2 us with 1, 4.8 with 2, 4.3 with 4, 5.4 with 8, 9.1 with 16


DEFAULT_CONFIG = IvfConfig()  # used when a call passes no cfg (tests swap it for tiny blocks)
MAX_PROBE_BESTS = 16384  # CTkvr: blocks x next_pow2(probe) bests merged by every rerank program
ATTEND_TILE_MAX = 64 * 128  # `_attend_kernel`: attend_block x head_dim at most. 64 x 128 takes 72 KB of shared
# memory; 128 x 128 asked for 266 KB, more than an H200 has (232 KB: OutOfResources; H200, session 35)

_WORKSPACES = Workspaces()


def _workspace(device: torch.device, dtype: torch.dtype, numel: int, tag: str, zero: bool = False) -> torch.Tensor:
    """A grow-only buffer per (device, stream, dtype, tag): `tag` separates buffers that one plan
    uses at the same time (the probe's outputs, read by the rerank, vs the rerank/select's own);
    `zero`: a new buffer starts zeroed (the push's ticket, which its last program resets)."""
    return _WORKSPACES.get(device, tag, numel, dtype, zero=zero)


def clear_workspace() -> None:
    _WORKSPACES.clear()


class _Carve:
    """Consecutive views of one flat workspace buffer."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes
        self.total = sum(sizes.values())

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out, at = {}, 0
        for name, n in self.sizes.items():
            out[name] = buf[at:at + n]
            at += n
        return out


def _precise() -> bool:
    return not interpreted()


def unsupported(q: torch.Tensor, *, ctkvr_probe: int | None = None, entries: int = 0) -> list[str]:
    """Reasons the fused plans cannot run for this query (empty = fine); the planners then keep the
    torch path. ctkvr_probe / entries: CTkvr's probed entries and C + F (kivf has no such limit)."""
    reasons = []
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head_dim {q.shape[-1]} is not supported by the fused IVF plans (powers of two 16..256)")
    if ctkvr_probe is not None:
        p_pad = triton.next_power_of_2(max(ctkvr_probe, 1))
        cfg = DEFAULT_CONFIG
        if ctkvr_probe > MAX_PROBE or _cdiv(entries, cfg.block_c) * p_pad > MAX_PROBE_BESTS:
            reasons.append(f"probing {ctkvr_probe} of {entries} entries is beyond the fused plan's unrolled merge")
    if q.device.type != "cuda" and not interpreted():
        reasons.append("fused IVF plans need CUDA tensors (or TRITON_INTERPRET=1)")
    if os.environ.get("CTXCACHE_FUSED_IVF", "1") == "0":
        reasons.append("fused IVF plans are switched off (CTXCACHE_FUSED_IVF=0)")
    return reasons


def _dot_logits(q: torch.Tensor, ctx_k: torch.Tensor, cfg: IvfConfig) -> bool:
    """The rerank's logits on tensor cores (`_group_logits`' DOT): 16-bit K and q of one dtype (the
    local rows are cast to the context's dtype before the launch)."""
    return cfg.rerank_dot and q.dtype == ctx_k.dtype and q.dtype in (torch.bfloat16, torch.float16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=256)
def _select_shape(u: int, cfg: IvfConfig) -> tuple[int, int]:
    """(keys per chunk, warps) of the select over rows of u candidate slots."""
    block, warps = ((cfg.wide_select_block, cfg.wide_select_warps) if u >= cfg.wide_select_from
                    else (cfg.select_block, cfg.select_warps))
    return max(16, min(block, triton.next_power_of_2(max(u, 1)))), warps


def _parts_block(n_parts: int) -> int:
    """Softmax-state parts combined per step by `_lse_parts` (one step for up to 512 parts)."""
    return max(16, min(512, triton.next_power_of_2(n_parts)))


def _rerank_and_select(q, kv, *, rows: int, u: int, sink: int, window: int, kp: int, rho: int, source: int,
                       src: tuple, n_top: int, p: int, p_pad: int, log_p: int, dedup: bool, has_fifo: bool,
                       bitmap, hits, push, cfg: IvfConfig, attend_scale: float | None = None):
    """Kernels 2 and 3 (shared by CTkvr and kivf) -> (plan positions [KVH, T, kp] int32, the plan's
    attention [KVH, G, T, D] in q's dtype or None). With `attend_scale` (CTkvr, one token: `attends`)
    a fourth launch, `_attend_kernel`, attends the frame and the plan at that scale."""
    kvh, g, t, d = q.shape
    dev = q.device
    n = kv.n_ctx
    ctx_k = _rows_contiguous(kv.ctx_k)
    loc_k = _rows_contiguous(kv.loc_k.to(ctx_k.dtype))  # one pointer type for the frame's rows
    attend = attend_scale is not None and attends(q, kv, source, cfg)
    ctx_v = _rows_contiguous(kv.ctx_v) if attend else ctx_k
    loc_v = _rows_contiguous(kv.loc_v.to(ctx_v.dtype)) if attend else loc_k
    q_pos = kv.q_pos
    g_pad = triton.next_power_of_2(g)
    s_end = min(sink, n)
    slots_per_prog = cfg.block_u * cfg.chunks_per_prog
    n_slot = _cdiv(u, slots_per_prog)
    n_parts = n_slot + 1
    scr_row = 3 * u
    n_sel = 2 if push is not None else 1  # select programs per row
    n_work = _attend_programs(dev, rows, n_sel, kp, cfg) if attend else 1  # attention programs per row
    f32 = _Carve({"s": rows * g * u, "pacc": rows * n_work * g_pad * d if attend else 0,
                  "pml": rows * n_work * g_pad * 2 if attend else 0})
    i32 = _Carve({"pos": rows * u, "scr": rows * n_sel * scr_row, "ctrl": 2 * rows})
    wf = f32.views(_workspace(dev, torch.float32, f32.total, "rerank"))
    wf["ml"] = _workspace(dev, torch.float64, rows * n_parts * g_pad * 2, "rerank")  # softmax states (_lse_parts)
    wi = i32.views(_workspace(dev, torch.int32, i32.total + 1, "rerank"))  # +1: never empty
    out = torch.empty(kvh, t, kp, dtype=torch.int32, device=dev)
    att = torch.empty(kvh, g, t, d, dtype=q.dtype, device=dev) if attend else None
    placeholder = wi["pos"]
    _rerank_kernel[(n_parts, rows)](
        q, ctx_k, loc_k, q_pos, *src, bitmap if bitmap is not None else placeholder, wf["s"], wi["pos"], wf["ml"],
        hits if hits is not None else placeholder, wi["ctrl"],
        q.stride(0), q.stride(1), q.stride(2),
        ctx_k.stride(0), ctx_k.stride(1), loc_k.stride(0), loc_k.stride(1),
        *_src_strides(source, src),
        t, n, loc_k.shape[1], s_end, window, u, _src_c(source, src), rho if source == 0 else 1, n_top,
        bitmap.shape[-1] if bitmap is not None else 1, n_slot, cfg.chunks_per_prog, float(d ** -0.5),
        G=g, G_PAD=g_pad, D=d, BLOCK_U=cfg.block_u, P=p, P_PAD=p_pad, BLOCK_T=triton.next_power_of_2(max(n_top, 1)),
        LOG_P=log_p, SOURCE=source, DEDUP=dedup, HAS_FIFO=has_fifo, PRECISE=_precise(),
        EAGER_ROWS=cfg.eager_rows and dedup, ONE_MASK=source == 0, DOT=_dot_logits(q, ctx_k, cfg),
        DOT_FP32=interpreted(), PREFETCH=cfg.rerank_prefetch and source == 0, LOADS_FIRST=cfg.rerank_loads_first,
        ONE_LIST=cfg.rerank_chunk_lists and source == 0 and rho % cfg.block_u == 0, ZERO_CTRL=attend,
        **stamp_args("rerank"),
        num_warps=cfg.rerank_warps, num_stages=cfg.rerank_stages,
        **({"maxnreg": cfg.rerank_maxnreg} if cfg.rerank_maxnreg and q.device.type == "cuda" else {}),
    )
    has_n_row = source == 1  # kivf: the row's probed keys, SEL_CUM[r, P]
    sel_block, sel_warps = _select_shape(u, cfg)
    pdl = pdl_launch(dev, cfg.attend_pdl) if attend else {}
    _select_kernel[(rows, n_sel)](
        wf["s"], wi["pos"], wf["ml"], wi["scr"], out, push if push is not None else out,
        bitmap if bitmap is not None else placeholder, src[2][p:] if has_n_row else placeholder, wi["ctrl"],
        t, u, n_parts, kp, rho, scr_row, bitmap.shape[-1] if bitmap is not None else 1, p_pad + 1, 1,
        G=g, G_PAD=g_pad, BLOCK=sel_block, BLOCK_S=_parts_block(n_parts), HAS_PUSH=push is not None,
        PRECISE=_precise(), SAMPLE=cfg.sample_select, DEDUP=dedup, PB=p_pad if dedup else 1, HAS_N_ROW=has_n_row,
        SCAN_V=min(cfg.count_rows, sel_block), PUBLISH=attend, PDL=bool(pdl), PDL_LATE=cfg.attend_late,
        **stamp_args("select"),
        num_warps=sel_warps,
    )
    if attend:
        _attend_kernel[(n_work, rows)](
            q, ctx_k, ctx_v, loc_k, loc_v, q_pos, out, wi["ctrl"], wf["pacc"], wf["pml"], att,
            q.stride(0), q.stride(1), q.stride(2), ctx_k.stride(0), ctx_k.stride(1), ctx_v.stride(0), ctx_v.stride(1),
            loc_k.stride(0), loc_k.stride(1), loc_v.stride(0), loc_v.stride(1), att.stride(0), att.stride(1),
            att.stride(2), t, n, loc_k.shape[1], s_end, window, kp, float(attend_scale),
            G=g, G_PAD=g_pad, D=d, G_DOT=max(16, g_pad), BLOCK_A=cfg.attend_block, W_PAD=triton.next_power_of_2(n_work),
            PRECISE=_precise(), DOT_FP32=interpreted(), SLEEP_NS=0 if interpreted() else cfg.attend_sleep_ns,
            ACQUIRE=not interpreted(),
            PDL=bool(pdl), **stamp_args("attend"), num_warps=cfg.attend_warps, **pdl,
        )
    return out, att


def attends(q: torch.Tensor, kv, source: int, cfg: IvfConfig) -> bool:
    """Whether a plan asked for its attention computes it (`_attend_kernel`): CTkvr (source 0),
    `IvfConfig.attend`, one token (a decode step), the values beside the keys (on q's device, in their
    dtype; not behind a host tier's row cache), and a chunk of `attend_block` rows of K and V that fits
    the kernel's shared memory (`ATTEND_TILE_MAX`; a larger one: the backend attends the plan)."""
    return (cfg.attend and source == 0 and q.shape[2] == 1 and cfg.attend_block * q.shape[-1] <= ATTEND_TILE_MAX
            and kv.v_cache is None and kv.ctx_v.device == q.device and kv.ctx_v.dtype == kv.ctx_k.dtype)


def _attend_programs(dev: torch.device, rows: int, n_sel: int, kp: int, cfg: IvfConfig) -> int:
    """Attention programs per row (`_attend_kernel`): the frame's, and one per plan chunk of
    `attend_block` positions (one chunk each: a program's first chunk costs most of its time) while
    the launch and the select's stay within two programs per SM, at least one; `attend_workers`
    overrides the plan's count."""
    chunks = _cdiv(kp, cfg.attend_block)
    if cfg.attend_workers:
        return min(cfg.attend_workers, chunks) + 1
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    return max(1, min(chunks, 2 * sms // rows - n_sel - 1)) + 1


def _src_strides(source: int, src: tuple) -> tuple:
    if source == 0:  # lists, FIFO lists
        lists, flists = src[2], src[3]
        return lists.stride(0), lists.stride(1), flists.stride(0), flists.stride(1)
    order = src[0]
    return order.stride(0), 0, 0, 0


def _src_c(source: int, src: tuple) -> int:
    return src[2].shape[1] if source == 0 else 0


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------
# Torch-facing functions


def ctkvr_plan(q: torch.Tensor, kv, cent: torch.Tensor, lists: torch.Tensor, fifo, *, sink: int, window: int,
               k: int, probe: int, cfg: IvfConfig | None = None, attend_scale: float | None = None):
    """CTkvr's plan (indexer/ctkvr.py, `_CTkvrPlanner.plan`) in 3 launches.

    q [KVH, G, T, D]; kv: KVView; cent [KVH, C, G, D] unit-norm; lists [KVH, C, rho] int32; fifo: the
    layer's `_Fifo` (cent [KVH, F, G, D], lists [KVH, F, rho], pushes [1]) or None (no update).
    Returns (positions [KVH, T, min(k, probe·rho)] int32, pending, attended) with pending = (query
    [KVH, G, D] in the centroids' dtype, list [KVH, rho] int32, hits [KVH·T] int32: probed FIFO entries
    per row) when fifo is given, else None; attended = the attention of q over the frame and the plan at
    `attend_scale` [KVH, G, T, D] in q's dtype where `attend_scale` is given and the plan `attends`
    (else None)."""
    cfg = cfg or DEFAULT_CONFIG
    kvh, g, t, d = q.shape
    dev = q.device
    c, rho = cent.shape[1], lists.shape[2]
    p = min(probe, c)
    u = p * rho
    n = kv.n_ctx
    rows = kvh * t
    kp = min(k, u)
    has_fifo = fifo is not None
    q = _rows_contiguous(q)
    cent = _rows_contiguous(cent)
    lists = lists if lists.stride(-1) == 1 else lists.contiguous()
    f = fifo.cap if has_fifo else 0
    fcent = fifo.cent if has_fifo else cent
    flists = fifo.lists if has_fifo else lists
    p_pad = triton.next_power_of_2(p)
    n_blocks = _cdiv(c + f, cfg.block_c)
    n_top = n_blocks * p_pad
    nw = max(1, _cdiv(n * p_pad, 32))  # the dedup map: p_pad bits (probe ranks) per context position
    words_per_prog = _cdiv(nw, n_blocks)
    i_carve = _Carve({"topi": rows * n_top, "bitmap": rows * nw})
    topv = _workspace(dev, torch.float32, rows * n_top, "probe")
    wi = i_carve.views(_workspace(dev, torch.int32, i_carve.total, "probe"))
    bitmap = wi["bitmap"].view(rows, nw)
    if has_fifo:
        pend_q = torch.empty(kvh, g, d, dtype=cent.dtype, device=dev)
        i_out = torch.empty(kvh * rho + rows, dtype=torch.int32, device=dev)
        push, hits = i_out[: kvh * rho], i_out[kvh * rho:]
    else:
        pend_q = push = hits = None
    _ctkvr_probe_kernel[(n_blocks, rows)](
        q, cent, fcent, fifo.pushes if has_fifo else wi["topi"], topv, wi["topi"],
        pend_q if has_fifo else topv, bitmap,
        q.stride(0), q.stride(1), q.stride(2),
        cent.stride(0), cent.stride(1), cent.stride(2),
        fcent.stride(0), fcent.stride(1), fcent.stride(2),
        *(pend_q.stride()[:2] if has_fifo else (0, 0)),
        t, c, f, n_blocks, nw, words_per_prog,
        G=g, G_PAD=triton.next_power_of_2(g), D=d, BLOCK_C=cfg.block_c, P=p, P_PAD=p_pad, HAS_FIFO=has_fifo,
        DEDUP=True, BLOCK_Z=256, ONE_LOAD=cfg.probe_one_load,
        FIFO_BLOCKS=has_fifo and cfg.probe_fifo_blocks and c % cfg.block_c == 0, LOADS_FIRST=cfg.probe_loads_first,
        **stamp_args("probe"),
        num_warps=cfg.probe_warps,
        **({"maxnreg": cfg.probe_maxnreg} if cfg.probe_maxnreg and q.device.type == "cuda" else {}),
    )
    out, att = _rerank_and_select(
        q, kv, rows=rows, u=u, sink=sink, window=window, kp=kp, rho=rho, source=0,
        src=(topv, wi["topi"], lists, flists), n_top=n_top, p=p, p_pad=p_pad, log_p=1, dedup=True,
        has_fifo=has_fifo, bitmap=bitmap, hits=hits, push=push, cfg=cfg, attend_scale=attend_scale,
    )
    return out, ((pend_q, push.view(kvh, rho), hits) if has_fifo else None), att


def fifo_push(fifo, pending, n_probed: int) -> None:
    """CTkvr's update: commit `pending` (from `ctkvr_plan`) into the ring `fifo` (`_Fifo`: cent,
    lists, pushes, share) in one launch of KVH x ceil(rho / 1024) programs (one program copying every
    head's list in turn took 19 us per layer at the 8B shape, H200: a chain of dependent copies);
    n_probed = rows x probe (the denominator of the share)."""
    pend_q, pend_l, hits = pending
    kvh, cap, g, d = fifo.cent.shape
    rho = fifo.lists.shape[2]
    block = 1024
    ticket = _workspace(fifo.pushes.device, torch.int32, 1, "push-ticket", zero=True)  # self-resetting
    _fifo_push_kernel[(kvh, _cdiv(rho, block))](
        fifo.cent, fifo.lists, fifo.pushes, fifo.share, pend_q, pend_l, hits, ticket,
        fifo.cent.stride(0), fifo.cent.stride(1), fifo.cent.stride(2),
        fifo.lists.stride(0), fifo.lists.stride(1), pend_q.stride(0), pend_q.stride(1),
        cap, rho, hits.numel(), float(n_probed),
        G=g, D=d, BLOCK=block, num_warps=4,
    )


def kivf_plan(q: torch.Tensor, kv, cent: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, *, width: int,
              sink: int, window: int, k: int, nprobe: int, cfg: IvfConfig | None = None) -> torch.Tensor:
    """kivf's plan (indexer/kivf.py, `_KIVFPlanner.plan`) in 4 launches. q [KVH, G, T, D]; cent
    [KVH, C, D] fp32; order [KVH, N] int32; offsets [KVH, C + 1] int32; width: the static candidate
    width (`selection.probe_width`). -> positions [KVH, T, min(k, width)] int32."""
    cfg = cfg or DEFAULT_CONFIG
    kvh, g, t, d = q.shape
    dev = q.device
    c = cent.shape[1]
    p = min(nprobe, c)
    rows = kvh * t
    if width == 0:  # no key in any probed cluster (the torch path's empty block)
        return torch.full((kvh, t, 0), -1, dtype=torch.int32, device=dev)
    u = width
    kp = min(k, u)
    q = _rows_contiguous(q)
    cent = _rows_contiguous(cent)
    order = order if order.stride(-1) == 1 else order.contiguous()
    offsets = offsets if offsets.stride(-1) == 1 else offsets.contiguous()
    g_pad = triton.next_power_of_2(g)
    p_pad = triton.next_power_of_2(p)
    n_blocks = _cdiv(c, cfg.block_c)
    blk = max(16, min(cfg.select_block, triton.next_power_of_2(c)))
    scr_row = 3 * c
    f_carve = _Carve({"pl": rows * g * c})
    i_carve = _Carve({"scr": rows * scr_row, "start": rows * p_pad, "cum": rows * (p_pad + 1)})
    wf = f_carve.views(_workspace(dev, torch.float32, f_carve.total, "probe"))
    wf["pml"] = _workspace(dev, torch.float64, rows * n_blocks * g_pad * 2, "probe")  # softmax states
    wi = i_carve.views(_workspace(dev, torch.int32, i_carve.total, "probe"))
    _kivf_probe_kernel[(n_blocks, rows)](
        q, cent, wf["pl"], wf["pml"],
        q.stride(0), q.stride(1), q.stride(2), cent.stride(0), cent.stride(1),
        t, c, n_blocks, float(d ** -0.5),
        G=g, G_PAD=g_pad, D=d, BLOCK_C=cfg.block_c, PRECISE=_precise(), num_warps=cfg.probe_warps,
    )
    _kivf_clusters_kernel[(rows,)](
        wf["pl"], wf["pml"], offsets, wi["scr"], wi["start"], wi["cum"],
        offsets.stride(0), t, c, n_blocks, scr_row, p,
        G=g, G_PAD=g_pad, P_PAD=p_pad, BLOCK=blk, BLOCK_S=_parts_block(n_blocks), PRECISE=_precise(),
        num_warps=cfg.select_warps,
    )
    return _rerank_and_select(
        q, kv, rows=rows, u=u, sink=sink, window=window, kp=kp, rho=0, source=1,
        src=(order, wi["start"], wi["cum"], wi["cum"]), n_top=0, p=p, p_pad=p_pad,
        log_p=max(1, (p - 1).bit_length()), dedup=False, has_fifo=False, bitmap=None, hits=None, push=None, cfg=cfg,
    )[0]


__all__ = ["IvfConfig", "MAX_PROBE", "ctkvr_plan", "fifo_push", "kivf_plan", "unsupported", "clear_workspace"]
