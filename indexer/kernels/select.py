"""Top-K selection without order: `topk_positions(score, k)` -> the indices of the k largest finite
scores of each row, in any order (what a plan needs: the backend attends a set of positions).

    score [..., U] float32 (any finite value; -inf = never chosen)  ->  idx [..., k] int32
    -1 where the row has fewer than k finite scores; every returned index is distinct and every
    unreturned finite score <= every returned one.

`topk_positions` dispatches: the Triton kernels below on CUDA tensors (and on CPU tensors under
Triton's interpreter when `CTXCACHE_TRITON_SELECT=1`, the tests' mode), else `topk_torch`
(`torch.topk(sorted=False)` + -1 masking: the reference and the CPU path).
`CTXCACHE_TRITON_SELECT=0` forces torch everywhere (A/B runs). Both return the same *set* per row
for tie-free inputs; the order differs (torch's unsorted order is its own). The kernel's row is a
function of the scores alone, the same on every run: the indices above the k-th largest score in
index order, then those equal to it, lowest index first, up to k (torch takes some of the tied
ones; the selected *values* always equal torch's). A plan's order matters although a plan is a set:
the bf16 attention over the same positions in another order rounds differently (benchmarks/
RESULTS.md, "Reproducible plans"), so an order that followed the programs' race made decode steps
differ from run to run.

Algorithm: exact radix select on the order-preserving uint32 key of float32 (key(x) = bits ^
0x80000000 for x >= +0, ~bits for x < 0: larger float, larger key), three digit levels, four
launches, everything on the device, launch sizes from (R, U, k) only (CUDA-graph capturable, no
host sync):

* level digits (defaults S1 = 22, S2 = 11): d1 = key >> 22 (1024 bins: sign, exponent, one
  mantissa bit = half-octave bins), d2 = bits 21..11 (2048 bins), d3 = bits 10..0 (2048 bins).
* `_level1_kernel`, grid (P, R): each program reads a chunk of its row (tiles of BLOCK scores)
  and adds the histogram of d1 over the finite scores to the row's histogram in a workspace.
  Per tile, `tl.histogram` over 64-bin windows (the window below the tile's largest remaining
  digit, repeated while digits remain: one window for most data, a few for rows spanning > 32
  octaves), then one masked `atomic_add` per non-empty bin: no per-element atomics, so no
  contention on popular bins. (A 1024-bin `tl.histogram` would cost ~400 instructions per
  score: Triton builds it from per-bit warp ballots and one popcount per bin a lane owns; 64 bins
  cost ~40: 7 ballots + 2 popcounts per score in the sm_90 PTX.)
* `_level2_kernel`: every program finds the threshold bin b1 of its row (largest bin with
  count(d1 >= b1) >= need, need = min(k, finite count)) from the level-1 histogram, and the count
  still needed inside it; then histograms d2 over the scores whose d1 == b1 (the candidates).
* `_level3_kernel`: the same one level down (b2, then d3 over the scores with key >> 11 == prefix).
  Candidates are a small, data-dependent part of the row: a tile whose candidates span < 64 bins
  takes one windowed `tl.histogram` (all-equal and clustered values: a handful of atomics), a tile
  with spread candidates one atomic per candidate (few, and spread over the bins). The slow case:
  a row inside one half-octave (e.g. uniform in [1, 2)): every score is a level-2 candidate, one
  atomic each (the benchmark's `narrow` input measures it).
* `_compact_kernel`: finds b3, i.e. the exact k-th key thr and `need` (how many scores equal to
  thr to take); each program counts its share's scores above thr and equal to it, publishes both
  counts, waits until every earlier share's are published (a share is a ticket, taken at the
  program's start: the programs it waits for have started, and wait only for earlier tickets, so
  no order of the grid deadlocks), and writes its indices at their prefix (an in-tile cumsum on
  top): those above thr in index order at [0, n_gt), the first `need` equal to it at [n_gt,
  total), -1 in slots [min(k, finite), k). The count pass reads the share's tiles once more
  (from L2) where a program has more than one.

Each program of levels 2, 3 and the compaction finds its threshold from the previous level's
histogram itself (redundantly; the first program of the row also stores it for the next level), so
no extra launch sits between the levels; each program issues its first tile's load before that
search and prefetches the next tile while processing one. The workspace (int32, per (device, stream,
row layout), grow-only) holds per row the three histograms, the ticket, the thresholds and the
shares' published counts; it cleans itself: level 1 zeroes the level-2/3 histograms, the ticket and
the counts (which it does not use), level 3 zeroes the level-1 histogram (no longer needed), so
every launch sequence starts from zeroed histograms without a memset. Like the attention kernels'
workspace: warm a stream up before capturing a graph on it, and do not replay two graphs captured on
one stream concurrently on different streams. A buffer that grows is kept alive (`_RETIRED`): a
graph captured with it may still replay.

Bytes and operations, R = 8, U = 131072, k = 6554 (the 128K plan at 5 %):
* scores: R·U·4 B = 4 MiB, read by each of the four launches: from HBM once (~1.4 µs at 3 TB/s),
  then from L2 (H100: 50 MB) three times; output R·k·4 B = 210 KB; histograms 8 rows x (1024 +
  2048 + 2048) x 4 B = 164 KB; each program of launches 2-4 reads one histogram of its row (4 or
  8 KB; 512 programs -> 2-4 MB per launch from L2, as much as the scores: fewer programs or a
  last-program-finds variant would cut it, see the benchmark's sweep).
* atomics: level 1 at most 64 per window per tile and only for non-empty bins (1024 tiles of 1024
  scores, ~1-2 windows: ~10^4-10^5); levels 2-3 one per candidate or per non-empty bin (candidates
  = scores in the threshold bin: a few % of a row for spread data).
* integer work: level 1 ~45 instructions per score (key, digit, window, the 64-bin ballot
  histogram), levels 2-3 ~15, compaction ~15 (two compares, two block sums, cumsums): ~90 per
  score, 9.4e7 for 1M scores, ~6 µs of the H100's INT32 rate if nothing overlapped. The floor is
  the four dependent launches (~1.5-2 µs each graph-replayed) plus ~3 µs of level 1.
  Target 10-15 µs vs torch.topk ~70 µs. Measured: see benchmarks/gpu_select.py (run by the lead).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from indexer.kernels import interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: topk_positions takes the torch path
    triton = None

ENV_FLAG = "CTXCACHE_TRITON_SELECT"  # "1": kernel also under the interpreter; "0": torch everywhere


# ---------------------------------------------------------------------------------------------
# Reference / CPU path and the dispatcher


def topk_torch(score: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: `torch.topk(sorted=False)`, -1 where the chosen score is -inf (fewer than k
    finite scores), padded with -1 when k > U. [..., U] -> [..., k] int32."""
    u = score.shape[-1]
    kk = min(k, u)
    val, idx = torch.topk(score, kk, dim=-1, sorted=False)
    idx = torch.where(val > float("-inf"), idx, -1).to(torch.int32)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], k - kk), -1)], dim=-1)
    return idx


def kernel_enabled(score: torch.Tensor) -> bool:
    """Whether `topk_positions` takes the Triton kernels for this tensor."""
    flag = os.environ.get(ENV_FLAG)
    if triton is None or flag == "0":
        return False
    if score.is_cuda:
        return True
    return flag == "1" and interpreted() and score.device.type == "cpu"


def topk_positions(score: torch.Tensor, k: int) -> torch.Tensor:
    """[..., U] scores -> [..., k] int32 indices of the k largest finite scores, any order, -1 where
    a row has fewer than k finite ones (module docstring). The kernels on CUDA, torch elsewhere."""
    if kernel_enabled(score):
        return topk_unordered(score, k)
    return topk_torch(score, k)


# ---------------------------------------------------------------------------------------------
# Launch configuration (host ints from shapes only)


@dataclass(frozen=True)
class SelectConfig:
    """Tuning knobs (benchmarks/gpu_select.py sweeps them)."""

    block: int = 1024  # scores per tile (power of two)
    num_warps: int = 4
    programs_per_sm: int = 4  # programs per launch ~ programs_per_sm x SMs, split over the rows
    shift1: int = 22  # level-1 digit = key >> shift1 (1 << (32 - shift1) bins)
    shift2: int = 11  # level-2 digit = bits shift1-1..shift2, level-3 digit = bits shift2-1..0
    window: int = 64  # bins of one tl.histogram window (power of two >= 32)
    tiles: int | None = None  # force tiles per program (tests: several programs per row)

    def bins(self) -> tuple[int, int, int]:
        return 1 << (32 - self.shift1), 1 << (self.shift1 - self.shift2), 1 << self.shift2


@dataclass(frozen=True)
class SelectLaunch:
    programs: int  # P, programs per row
    tiles: int  # tiles of BLOCK scores per program
    nb: tuple[int, int, int]  # bins per level
    row: int  # workspace int32 per row
    p_pad: int  # next power of two >= P: the compaction's published counts per row (two arrays)


MAX_ROWS_PER_LAUNCH = 65535  # CUDA's grid.y limit
N_COUNTERS = 2  # per row: the compaction's ticket (which share of the row a program takes), spare
N_STATE = 6  # per row: b1, need1, total, b2, need2, spare


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs per row, so tests cover several
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(idx)


@functools.lru_cache(maxsize=16)
def _cuda_sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


@functools.lru_cache(maxsize=1024)
def launch_sizes(r: int, u: int, sm_count: int, cfg: SelectConfig = SelectConfig()) -> SelectLaunch:
    n_tiles = max(1, -(-u // cfg.block))
    if cfg.tiles is not None:
        tiles = max(1, cfg.tiles)
    else:
        per_row = max(1, cfg.programs_per_sm * sm_count // max(r, 1))
        tiles = -(-n_tiles // per_row)
    programs = -(-n_tiles // tiles)
    nb = cfg.bins()
    p_pad = 1 << max(programs - 1, 0).bit_length()
    row = sum(nb) + N_COUNTERS + N_STATE + 2 * p_pad
    row = -(-row // 16) * 16
    return SelectLaunch(programs, tiles, nb, row, p_pad)


# Workspace per (device, stream, row layout): grow-only, zero-initialised; its level-1 histograms
# are zero again after every launch sequence (module docstring), the rest is zeroed by level 1. The
# row's length (bins and the compaction's published counts, which grow with the programs per row)
# is part of the key: rows of another length would put a level-1 histogram where another layout
# left counts.
_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _ws_key(device: torch.device, nb: tuple[int, int, int], row: int) -> tuple:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return str(device), stream, nb, row


def _workspace(device: torch.device, rows: int, row: int, nb: tuple[int, int, int]) -> torch.Tensor:
    key = _ws_key(device, nb, row)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < rows * row:
        old = 0 if buf is None else buf.numel() // row
        if buf is not None:
            _RETIRED.append(buf)  # a captured graph may still use it
        buf = torch.zeros(max(rows, 2 * old) * row, dtype=torch.int32, device=device)
        _WORKSPACE[key] = buf
    return buf


_RETIRED: list[torch.Tensor] = []


def clear_workspace() -> None:
    """Forget every workspace (tests; graphs captured before must not be replayed afterwards)."""
    _WORKSPACE.clear()
    _RETIRED.clear()


def topk_unordered(score: torch.Tensor, k: int, *, cfg: SelectConfig = SelectConfig(),
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' path of `topk_positions` (any device Triton runs on: CUDA, or CPU tensors
    under the interpreter). [..., U] -> [..., k] int32; four launches, no host sync; allocates
    `out` (unless given) and, on the first call of a shape/stream, the workspace."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    lead, u = score.shape[:-1], score.shape[-1]
    if out is not None and (out.shape != (*lead, k) or out.dtype != torch.int32 or not out.is_contiguous()):
        raise ValueError("out must be a contiguous int32 tensor of shape [..., k]")
    x = score.reshape(math.prod(lead), u)
    if x.dtype != torch.float32:
        x = x.float()
    if u > 0 and x.stride(-1) != 1:
        x = x.contiguous()
    r = x.shape[0]
    if out is None:
        out = torch.empty(*lead, k, dtype=torch.int32, device=score.device)
    if r == 0 or k == 0:
        return out
    if u == 0:
        return out.fill_(-1)
    o = out.view(r, k)
    rows = min(r, MAX_ROWS_PER_LAUNCH)
    ls = launch_sizes(rows, u, _sm_count(score.device), cfg)
    nb1, nb2, nb3 = ls.nb
    ws = _workspace(score.device, rows, ls.row, ls.nb)
    common = dict(NB1=nb1, NB2=nb2, NB3=nb3, S1=cfg.shift1, S2=cfg.shift2, ROW=ls.row, P_PAD=ls.p_pad,
                  BLOCK=cfg.block, WIN=cfg.window, num_warps=cfg.num_warps)
    try:
        for r0 in range(0, r, rows):  # one pass for any planner's shape; grid.y is limited to 65535
            xs, os_ = x[r0:r0 + rows], o[r0:r0 + rows]
            grid = (ls.programs, xs.shape[0])
            _level1_kernel[grid](xs, ws, u, x.stride(0), ls.tiles, **common)
            _level2_kernel[grid](xs, ws, u, x.stride(0), ls.tiles, k, **common)
            _level3_kernel[grid](xs, ws, u, x.stride(0), ls.tiles, **common)
            _compact_kernel[grid](xs, ws, os_, u, x.stride(0), ls.tiles, k, **common)
    except BaseException:
        # a launch that never ran would leave a level-1 histogram dirty: start the next call afresh
        dirty = _WORKSPACE.pop(_ws_key(score.device, ls.nb, ls.row), None)
        if dirty is not None:
            _RETIRED.append(dirty)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _ordered_key(x):
        """float32 -> uint32 with the same order (x >= +0: bits | 1 << 31; x < 0: ~bits)."""
        s = x.to(tl.int32, bitcast=True)
        return (s ^ ((s >> 31) | -2147483648)).to(tl.uint32, bitcast=True)

    @triton.jit
    def _find_bin(hist, need, NB: tl.constexpr):
        """Histogram hist[0..NB) and a count `need` (clamped to the histogram's total) -> (b, left,
        total): the largest bin b with count(bins >= b) >= need, left = need - count(bins > b)
        (how many to take from bin b; need 0 gives b = NB - 1, left 0)."""
        j = tl.arange(0, NB)
        h = tl.load(hist + j)
        total = tl.sum(h, 0)
        need = tl.minimum(need, total)
        ge = total - tl.cumsum(h, 0) + h  # count(bins >= j)
        b = tl.max(tl.where(ge >= need, j, -1), 0)
        above = tl.sum(tl.where(j == b, ge - h, 0), 0)
        return b, need - above, total

    @triton.jit
    def _add_spread(hist, d, cand, NB: tl.constexpr, WIN: tl.constexpr):
        """hist[d] += 1 for the candidates of one tile: one windowed tl.histogram when they span
        fewer than WIN bins (clustered or equal values), else one atomic per candidate."""
        c = tl.sum(cand.to(tl.int32), 0)
        if c > 0:
            hi = tl.max(tl.where(cand, d, -1), 0)
            lo = tl.min(tl.where(cand, d, NB), 0)
            if hi - lo < WIN:
                h = tl.histogram(hi - d, WIN, mask=cand)
                jw = tl.arange(0, WIN)
                tl.atomic_add(hist + hi - jw, h, mask=h > 0, sem="relaxed")
            else:
                tl.atomic_add(hist + d, tl.full(d.shape, 1, tl.int32), mask=cand, sem="relaxed")

    @triton.jit(do_not_specialize=["n_cols", "stride_r", "tiles"])
    def _level1_kernel(S, WS, n_cols, stride_r, tiles,
                       NB1: tl.constexpr, NB2: tl.constexpr, NB3: tl.constexpr, S1: tl.constexpr,
                       S2: tl.constexpr, ROW: tl.constexpr, P_PAD: tl.constexpr, BLOCK: tl.constexpr,
                       WIN: tl.constexpr):
        p = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        n_prog = tl.num_programs(0)
        ws = WS + row * ROW
        src = S + row * stride_r
        offs = p * tiles * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n_cols, other=float("-inf"))  # in flight during what follows
        # zero this row's level-2/3 histograms, ticket, state and published counts (used by the next
        # launches only; level 2 writes the state after this launch)
        ZLEN: tl.constexpr = NB2 + NB3 + 8 + 2 * P_PAD
        zb = tl.arange(0, 256)
        for z0 in range(p * 256, ZLEN, n_prog * 256):
            tl.store(ws + NB1 + z0 + zb, 0, mask=z0 + zb < ZLEN)

        jw = tl.arange(0, WIN)
        for t in range(0, tiles):
            nxt = offs + BLOCK  # prefetch the next tile while this one is processed
            x_next = tl.load(src + nxt, mask=(nxt < n_cols) & (t + 1 < tiles), other=float("-inf"))
            d = (_ordered_key(x) >> S1).to(tl.int32)
            rem = x > float("-inf")  # finite (and +inf); -inf, NaN and padding never count
            n_rem = tl.sum(rem.to(tl.int32), 0)
            while n_rem > 0:  # windows of WIN bins from the tile's largest remaining digit down
                top = tl.max(tl.where(rem, d, -1), 0)
                win = rem & (top - d < WIN)
                h = tl.histogram(top - d, WIN, mask=win)
                tl.atomic_add(ws + top - jw, h, mask=h > 0, sem="relaxed")
                rem = rem & ~win
                n_rem = n_rem - tl.sum(h, 0)
            x = x_next
            offs = nxt

    @triton.jit(do_not_specialize=["n_cols", "stride_r", "tiles", "k"])
    def _level2_kernel(S, WS, n_cols, stride_r, tiles, k,
                       NB1: tl.constexpr, NB2: tl.constexpr, NB3: tl.constexpr, S1: tl.constexpr,
                       S2: tl.constexpr, ROW: tl.constexpr, P_PAD: tl.constexpr, BLOCK: tl.constexpr,
                       WIN: tl.constexpr):
        p = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        ws = WS + row * ROW
        src = S + row * stride_r
        offs = p * tiles * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n_cols, other=float("-inf"))  # in flight during what follows
        st = ws + NB1 + NB2 + NB3 + 2
        b1, need1, total = _find_bin(ws, k, NB1)  # total = min(k, finite scores) after the clamp
        if p == 0:
            tl.store(st, b1)
            tl.store(st + 1, need1)
            tl.store(st + 2, tl.minimum(total, k))

        for t in range(0, tiles):
            nxt = offs + BLOCK  # prefetch the next tile while this one is processed
            x_next = tl.load(src + nxt, mask=(nxt < n_cols) & (t + 1 < tiles), other=float("-inf"))
            key = _ordered_key(x)
            cand = (x > float("-inf")) & ((key >> S1).to(tl.int32) == b1)
            d = ((key >> S2) & (NB2 - 1)).to(tl.int32)
            _add_spread(ws + NB1, d, cand, NB2, WIN)
            x = x_next
            offs = nxt

    @triton.jit(do_not_specialize=["n_cols", "stride_r", "tiles"])
    def _level3_kernel(S, WS, n_cols, stride_r, tiles,
                       NB1: tl.constexpr, NB2: tl.constexpr, NB3: tl.constexpr, S1: tl.constexpr,
                       S2: tl.constexpr, ROW: tl.constexpr, P_PAD: tl.constexpr, BLOCK: tl.constexpr,
                       WIN: tl.constexpr):
        p = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        n_prog = tl.num_programs(0)
        ws = WS + row * ROW
        src = S + row * stride_r
        offs = p * tiles * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n_cols, other=float("-inf"))  # in flight during what follows
        st = ws + NB1 + NB2 + NB3 + 2
        b1 = tl.load(st)
        need1 = tl.load(st + 1)
        b2, need2, _ = _find_bin(ws + NB1, need1, NB2)
        if p == 0:
            tl.store(st + 3, b2)
            tl.store(st + 4, need2)
        # the level-1 histogram is no longer needed: zero it for the next call
        zb = tl.arange(0, 256)
        for z0 in range(p * 256, NB1, n_prog * 256):
            tl.store(ws + z0 + zb, 0, mask=z0 + zb < NB1)

        prefix = b1 * NB2 + b2  # key >> S2 of the candidates
        for t in range(0, tiles):
            nxt = offs + BLOCK  # prefetch the next tile while this one is processed
            x_next = tl.load(src + nxt, mask=(nxt < n_cols) & (t + 1 < tiles), other=float("-inf"))
            key = _ordered_key(x)
            cand = (x > float("-inf")) & ((key >> S2).to(tl.int32) == prefix)
            d = (key & (NB3 - 1)).to(tl.int32)
            _add_spread(ws + NB1 + NB2, d, cand, NB3, WIN)
            x = x_next
            offs = nxt

    @triton.jit(do_not_specialize=["n_cols", "stride_r", "tiles", "k"])
    def _compact_kernel(S, WS, OUT, n_cols, stride_r, tiles, k,
                        NB1: tl.constexpr, NB2: tl.constexpr, NB3: tl.constexpr, S1: tl.constexpr,
                        S2: tl.constexpr, ROW: tl.constexpr, P_PAD: tl.constexpr, BLOCK: tl.constexpr,
                        WIN: tl.constexpr):
        # The program's share of the row is its ticket: the order programs start in, not its
        # program id, so every program whose counts this one waits for below has started (and waits
        # for nothing but earlier tickets): no deadlock, whatever order the GPU runs the grid in.
        row = tl.program_id(1).to(tl.int64)
        n_prog = tl.num_programs(0)
        ws = WS + row * ROW
        cnt = ws + NB1 + NB2 + NB3
        st = cnt + 2
        pub = st + 6  # [P_PAD] counts above thr + 1, then [P_PAD] counts equal to it + 1, per share
        p = tl.atomic_add(cnt, 1, sem="relaxed")
        src = S + row * stride_r
        base = p * tiles * BLOCK
        offs = base + tl.arange(0, BLOCK)
        x0 = tl.load(src + offs, mask=offs < n_cols, other=float("-inf"))  # in flight during what follows
        b1 = tl.load(st)
        total = tl.load(st + 2)
        b2 = tl.load(st + 3)
        need2 = tl.load(st + 4)
        b3, need, _ = _find_bin(ws + NB1 + NB2, need2, NB3)
        thr = (b1.to(tl.uint32) << S1) | (b2.to(tl.uint32) << S2) | b3.to(tl.uint32)  # the k-th key
        n_gt = total - need  # scores above thr: slots [0, n_gt); those equal to it: [n_gt, total)
        dst = OUT + row * k

        fb = tl.arange(0, 256)
        for f0 in range(total + p * 256, k, n_prog * 256):  # fewer than k finite scores: -1
            tl.store(dst + f0 + fb, -1, mask=f0 + fb < k)

        # 1. this share's counts (above thr, equal to it), published at once
        c_gt = p * 0
        c_eq = p * 0
        x = x0
        for t in range(0, tiles):
            nxt = offs + BLOCK
            x_next = tl.load(src + nxt, mask=(nxt < n_cols) & (t + 1 < tiles), other=float("-inf"))
            key = _ordered_key(x)
            ok = x > float("-inf")
            c_gt += tl.sum((ok & (key > thr)).to(tl.int32), 0)
            c_eq += tl.sum((ok & (key == thr)).to(tl.int32), 0)
            x = x_next
            offs = nxt
        tl.atomic_xchg(pub + p, c_gt + 1, sem="release")
        tl.atomic_xchg(pub + P_PAD + p, c_eq + 1, sem="release")
        # 2. the counts of every earlier share (0 = not published yet: read again)
        j = tl.arange(0, P_PAD)
        early = j < p
        g = tl.atomic_add(pub + j, 0, mask=early, sem="acquire")
        e = tl.atomic_add(pub + P_PAD + j, 0, mask=early, sem="acquire")
        while tl.min(tl.where(early, tl.minimum(g, e), 1), 0) == 0:
            g = tl.atomic_add(pub + j, 0, mask=early, sem="acquire")
            e = tl.atomic_add(pub + P_PAD + j, 0, mask=early, sem="acquire")
        at_gt = tl.sum(tl.where(early, g - 1, 0), 0)
        at_eq = tl.sum(tl.where(early, e - 1, 0), 0)
        # 3. the share's indices at their ranks in index order: above thr first, then the first
        # `need` equal to it (lowest index first); one share's tiles are in L2 since step 1
        offs = base + tl.arange(0, BLOCK)
        x = x0
        if tiles > 1:
            x = tl.load(src + offs, mask=offs < n_cols, other=float("-inf"))
        for t in range(0, tiles):
            nxt = offs + BLOCK  # prefetch the next tile while this one is processed
            x_next = tl.load(src + nxt, mask=(nxt < n_cols) & (t + 1 < tiles), other=float("-inf"))
            key = _ordered_key(x)
            ok = x > float("-inf")
            gt = ok & (key > thr)
            gt_i = gt.to(tl.int32)
            tl.store(dst + at_gt + tl.cumsum(gt_i, 0) - 1, offs, mask=gt)
            at_gt += tl.sum(gt_i, 0)
            eq = ok & (key == thr)
            eq_i = eq.to(tl.int32)
            rank = at_eq + tl.cumsum(eq_i, 0) - 1
            tl.store(dst + n_gt + rank, offs, mask=eq & (rank < need))
            at_eq += tl.sum(eq_i, 0)
            x = x_next
            offs = nxt


__all__ = ["ENV_FLAG", "SelectConfig", "SelectLaunch", "clear_workspace", "kernel_enabled", "launch_sizes",
           "topk_positions", "topk_torch", "topk_unordered"]
