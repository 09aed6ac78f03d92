"""Staging a one-token step's value rows from host memory into HBM, ahead of the attention.

Under `offload_v` (and `offload`) the attention reads the context's value rows it attends from
pinned host memory, over PCIe, and that read stalls the step: ~0.9 ms per layer for eight requests
at 128K (ctkvr: 1,024 scattered rows per KV head plus the frame), against ~0.41 ms for the rest of
the layer (benchmarks/RESULTS.md, "Offload_v's reads"). Scattered 256-byte rows of host memory
arrive at ~30 GB/s whatever the page size or launch, so the way to a faster step is to read them
while the GPU does something else. With `plan_ahead`, layer L's plan exists during layer L - 1:
`stage_rows` then copies the rows that plan attends into a GPU buffer of the context's shape (a
*mirror*: row p of the mirror holds row p of the context, wherever it is staged), on the planning
side stream, and layer L's attention reads the mirror instead of host memory. The attention
kernel is unchanged: it reads the mirror at the same positions, and it reads no other rows (a
mirror row that was not staged holds stale bytes nobody reads).

The rows a one-token step reads from the context (`decoder/kernels/attention.py`): the sink
[0, s_end), the window's context part [N - Wr, N), Wr = min(window - 1, N - s_end), and the plan's
positions (-1 = none). `stage_rows` copies exactly those, each once (a position inside the frame is
staged with the frame). One launch per request and layer, grid from shapes only (graph-capturable).
Keeping the frame's rows on the GPU instead (they need no plan: 20% of ctkvr's rows at 128K) was
measured and gained nothing (benchmarks/RESULTS.md, "Offload_v's reads"): contiguous rows are cheap.

**Row cache** (`RowCache`, one per request and layer): what makes scattered host rows slow is not
their bytes but their number. The GPU reads 64-byte to 1-KiB granules scattered over host memory
at the same ~33-78 per µs, 128-byte ones as slowly as 256-byte ones, while contiguous reads run at
51 GB/s (`benchmarks/gpu_host_reads.py --sections granule`, RESULTS.md "Scattered host reads"):
each read of a new part of host memory waits on address translation. So the stage reads from
host memory only the plan rows the step before did not plan: the cache holds the rows of the
layer's previous plan in HBM (`vals` [KVH, K, D], slot j = that plan's j-th position, `pos_of`
[KVH, K] the positions, `slot_of` [KVH, N] a position's slot, valid only where `pos_of` agrees).
Context rows never change, so a cached row is right for as long as the request lives. On the
default model, 69% of ctkvr's planned rows at 4K were planned by the step before
(`benchmarks/bench_value_reuse.py`). `stage_rows(..., cache=)` reads a plan row from the cache
when its slot holds it, else from host memory; then `refill` (a second launch on the same stream,
so that no program reads a slot another rewrites) makes the cache the rows of this plan, from the
mirror. `counts` [2] int64 accumulates (cache hits, plan rows staged) on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4

BLOCK_ROWS = 32


@triton.jit(do_not_specialize=["n_ctx", "s_end", "win_rows", "n_pos"])
def _stage_kernel(SRC, DST, POS, VALS, POS_OF, SLOT_OF, COUNTS, s_src_h, s_src_n, s_dst_h, s_dst_n, s_pos_h, n_ctx,
                  s_end, win_rows, n_pos, D: tl.constexpr, BLOCK: tl.constexpr, CACHED: tl.constexpr):
    """Program (row block, kv head): rows i of the list [sink | window | plan] of head h; with
    CACHED, a plan row whose cache slot holds it comes from VALS [KVH, n_pos, D] (module docstring)."""
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nf = s_end + win_rows
    in_frame = i < nf
    in_plan = (i >= nf) & (i < nf + n_pos)
    p = tl.load(POS + h * s_pos_h + (i - nf), mask=in_plan, other=-1).to(tl.int64)
    row = tl.where(i < s_end, i.to(tl.int64), tl.where(in_frame, (n_ctx - nf + i).to(tl.int64), p))
    plan_ok = in_plan & (row >= s_end) & (row < n_ctx - win_rows)  # plan rows in the frame go with it
    ok = in_frame | plan_ok
    d = tl.arange(0, D)
    h64 = h.to(tl.int64)
    host = ok
    if CACHED:
        slot = tl.load(SLOT_OF + h64 * n_ctx + row, mask=plan_ok, other=0)
        slot = tl.minimum(tl.maximum(slot, 0), n_pos - 1)
        hit = plan_ok & (tl.load(POS_OF + h * n_pos + slot, mask=plan_ok, other=-1).to(tl.int64) == row)
        host = ok & ~hit
        cached = tl.load(VALS + (h64 * n_pos + slot)[:, None] * D + d[None, :], mask=hit[:, None])
    x = tl.load(SRC + h64 * s_src_h + row[:, None] * s_src_n + d[None, :], mask=host[:, None])
    if CACHED:
        x = tl.where(hit[:, None], cached, x)
        tl.atomic_add(COUNTS, tl.sum(hit.to(tl.int64), axis=0))
        tl.atomic_add(COUNTS + 1, tl.sum(plan_ok.to(tl.int64), axis=0))
    tl.store(DST + h64 * s_dst_h + row[:, None] * s_dst_n + d[None, :], x, mask=ok[:, None])


@triton.jit(do_not_specialize=["n_ctx", "n_pos"])
def _refill_kernel(DST, POS, VALS, POS_OF, SLOT_OF, s_dst_h, s_dst_n, s_pos_h, n_ctx, n_pos, D: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program (slot block, kv head): the cache's slot j := the plan's j-th position and its row,
    read from the mirror DST (which holds every row the plan attends once `_stage_kernel` ran)."""
    h = tl.program_id(1)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < n_pos
    p = tl.load(POS + h * s_pos_h + j, mask=live, other=-1)
    ok = live & (p >= 0)
    p64 = p.to(tl.int64)
    h64 = h.to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(DST + h64 * s_dst_h + p64[:, None] * s_dst_n + d[None, :], mask=ok[:, None])
    tl.store(VALS + (h64 * n_pos + j)[:, None] * D + d[None, :], x, mask=ok[:, None])
    tl.store(POS_OF + h * n_pos + j, p, mask=live)
    tl.store(SLOT_OF + h64 * n_ctx + p64, j, mask=ok)


@dataclass
class RowCache:
    """One layer's cache of the value rows its previous plan staged (module docstring): `vals`
    [KVH, K, D], `pos_of` [KVH, K] int32 (-1 = empty), `slot_of` [KVH, N] int32, `counts` [2] int64
    (hits, plan rows staged so far)."""

    vals: torch.Tensor
    pos_of: torch.Tensor
    slot_of: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def empty(cls, kvh: int, n_ctx: int, k: int, d: int, dtype: torch.dtype, device) -> "RowCache":
        return cls(torch.zeros(kvh, k, d, dtype=dtype, device=device),
                   torch.full((kvh, k), -1, dtype=torch.int32, device=device),
                   torch.zeros(kvh, n_ctx, dtype=torch.int32, device=device),
                   torch.zeros(2, dtype=torch.int64, device=device))

    def fits(self, kvh: int, n_ctx: int, k: int) -> bool:
        return self.pos_of.shape == (kvh, k) and self.slot_of.shape == (kvh, n_ctx)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.vals, self.pos_of, self.slot_of, self.counts))


def frame_extent(n_ctx: int, sink: int, window: int) -> tuple[int, int]:
    """(s_end, Wr): the sink is context rows [0, s_end), the window's context part [N - Wr, N)."""
    s_end = min(sink, n_ctx)
    return s_end, min(max(window - 1, 0), n_ctx - s_end)


def stage_rows(src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, sink: int, window: int,
               cache: RowCache | None = None) -> None:
    """dst[h, p] = src[h, p] for every context row p a one-token step attends with this plan:
    src, dst [KVH, N, D] (src may be a mapped view of host memory), positions [KVH, 1, K] (-1 =
    none); with `cache`, plan rows the cache holds are read from it, and the cache then holds this
    plan's rows. Triton on CUDA (and through its interpreter when TRITON_INTERPRET=1), else torch."""
    kvh, n_ctx, d = src.shape
    if dst.shape != src.shape or dst.dtype != src.dtype or src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("dst must be src's shape and dtype, both with unit stride along D")
    if positions.dim() != 3 or positions.shape[:2] != (kvh, 1):
        raise ValueError("positions must be [KVH, 1, K]: one token's plan")
    n_pos = positions.shape[-1]
    if cache is not None and (not cache.fits(kvh, n_ctx, n_pos) or cache.vals.dtype != src.dtype):
        raise ValueError("the row cache must be [KVH, K, D] of src's dtype for a plan of K positions")
    s_end, win_rows = frame_extent(n_ctx, sink, window)
    if src.device.type != "cuda" and not interpreted():
        stage_rows_torch(src, dst, positions, sink, window, cache)
        return
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    c = cache
    args = (c.vals, c.pos_of, c.slot_of, c.counts) if c is not None else (dst, positions, positions, positions)
    grid = (triton.cdiv(s_end + win_rows + n_pos, BLOCK_ROWS), kvh)
    _stage_kernel[grid](src, dst, positions, *args, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
                        positions.stride(0), n_ctx, s_end, win_rows, n_pos, D=d, BLOCK=BLOCK_ROWS,
                        CACHED=c is not None)
    if c is not None and n_pos:
        _refill_kernel[(triton.cdiv(n_pos, BLOCK_ROWS), kvh)](dst, positions, c.vals, c.pos_of, c.slot_of,
                                                             dst.stride(0), dst.stride(1), positions.stride(0),
                                                             n_ctx, n_pos, D=d, BLOCK=BLOCK_ROWS)


def stage_rows_torch(src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, sink: int, window: int,
                     cache: RowCache | None = None) -> None:
    """The reference (and the CPU path) of `stage_rows`."""
    kvh, n_ctx, d = src.shape
    s_end, win_rows = frame_extent(n_ctx, sink, window)
    dev = src.device
    fixed = torch.cat([torch.arange(s_end, device=dev), torch.arange(n_ctx - win_rows, n_ctx, device=dev)])
    for h in range(kvh):
        pos = positions[h, 0].to(dev).long()
        pos = pos[(pos >= s_end) & (pos < n_ctx - win_rows)]
        if cache is None:
            dst[h, pos] = src[h, pos]
        else:
            slot = cache.slot_of[h, pos].long().clamp(0, positions.shape[-1] - 1)
            hit = cache.pos_of[h, slot].long() == pos
            dst[h, pos[hit]] = cache.vals[h, slot[hit]]
            dst[h, pos[~hit]] = src[h, pos[~hit]]
            cache.counts += torch.tensor([int(hit.sum()), pos.numel()], device=cache.counts.device)
        dst[h, fixed] = src[h, fixed]
    if cache is not None:
        for h in range(kvh):
            p = positions[h, 0].to(dev).long()
            ok = p >= 0
            j = torch.arange(p.numel(), device=dev)
            cache.vals[h, j[ok]] = dst[h, p[ok]]
            cache.pos_of[h] = positions[h, 0].to(cache.pos_of)
            cache.slot_of[h, p[ok]] = j[ok].to(cache.slot_of.dtype)


__all__ = ["BLOCK_ROWS", "RowCache", "frame_extent", "stage_rows", "stage_rows_torch"]
