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

**Row cache** (`RowCache`, one per request and layer; also read and refreshed by the attention kernel
itself when nothing is staged: `decoder/kernels/attention.py`): what makes scattered host rows slow is not
their bytes but their number. The GPU reads 64-byte to 1-KiB granules scattered over host memory
at the same ~31-37 per µs, 128-byte ones as slowly as 256-byte ones, while contiguous reads run at
51 GB/s (`benchmarks/gpu_host_reads.py --sections granule`; RESULTS.md, "Scattered host reads cost
by count"). So the stage reads from host memory only the plan rows that none of the layer's last
`plans` plans had: on the default model at 8K, 69% of ctkvr's planned rows were planned by the step
before, 76% by one of the two before, 82% by one of the four before (`benchmarks/bench_value_reuse.py`).
The cache has plans + 1 regions of K slots (`vals` [KVH, (plans + 1) K, D], `pos_of` the position a
slot holds, -1 = none) and `slot_of` [KVH, N], the slot a position was last cached in (valid only
where `pos_of` agrees: no clearing, ever). A step writes region `step % (plans + 1)` (`step`: the
device scalar of the step's position, so a replayed graph advances it) with its plan's rows, slot j
= the plan's j-th position, and reads hits only from the other regions: one launch, and no program
reads a slot another program writes. Context rows never change, so a cached row is right for as
long as the request lives. `counts` [2] int64 accumulates (cache hits, plan rows staged) on the
device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4

BLOCK_ROWS = 32


@triton.jit(do_not_specialize=["n_ctx", "s_end", "win_rows", "n_pos"])
def _stage_kernel(SRC, DST, POS, VALS, POS_OF, SLOT_OF, COUNTS, STEP, s_src_h, s_src_n, s_dst_h, s_dst_n, s_pos_h,
                  n_ctx, s_end, win_rows, n_pos, D: tl.constexpr, BLOCK: tl.constexpr, REGIONS: tl.constexpr):
    """Program (row block, kv head): rows i of the list [sink | window | plan] of head h. REGIONS > 0:
    with the row cache of that many regions of n_pos slots (module docstring)."""
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
    if REGIONS > 0:
        width = REGIONS * n_pos
        base = (tl.load(STEP) % REGIONS) * n_pos  # this step's region: written below, never read
        slot = tl.load(SLOT_OF + h64 * n_ctx + row, mask=plan_ok, other=0).to(tl.int64)
        slot = tl.minimum(tl.maximum(slot, 0), width - 1)
        mine = (slot >= base) & (slot < base + n_pos)
        hit = plan_ok & ~mine & (tl.load(POS_OF + h64 * width + slot, mask=plan_ok, other=-1).to(tl.int64) == row)
        host = ok & ~hit
        cached = tl.load(VALS + (h64 * width + slot)[:, None] * D + d[None, :], mask=hit[:, None])
    x = tl.load(SRC + h64 * s_src_h + row[:, None] * s_src_n + d[None, :], mask=host[:, None])
    if REGIONS > 0:
        x = tl.where(hit[:, None], cached, x)
        j = base + (i - nf)  # the plan's j-th position -> slot j of this step's region
        tl.store(VALS + (h64 * width + j)[:, None] * D + d[None, :], x, mask=plan_ok[:, None])
        tl.store(POS_OF + h64 * width + j, tl.where(plan_ok, row, -1).to(tl.int32), mask=in_plan)
        tl.store(SLOT_OF + h64 * n_ctx + row, j.to(tl.int32), mask=plan_ok)
        tl.atomic_add(COUNTS, tl.sum(hit.to(tl.int64), axis=0))
        tl.atomic_add(COUNTS + 1, tl.sum(plan_ok.to(tl.int64), axis=0))
    tl.store(DST + h64 * s_dst_h + row[:, None] * s_dst_n + d[None, :], x, mask=ok[:, None])


PLANS_KEPT = 2  # RowCache's default: the rows of the last two plans (76% of ctkvr's at 8K, against 69% for one)


@dataclass
class RowCache:
    """One layer's cache of the value rows its last `plans` plans staged (module docstring): `vals`
    [KVH, (plans + 1) K, D], `pos_of` [KVH, (plans + 1) K] int32 (-1 = empty), `slot_of` [KVH, N]
    int32, `counts` [2] int64 (hits, plan rows staged so far)."""

    vals: torch.Tensor
    pos_of: torch.Tensor
    slot_of: torch.Tensor
    counts: torch.Tensor
    plans: int = PLANS_KEPT

    @classmethod
    def empty(cls, kvh: int, n_ctx: int, k: int, d: int, dtype: torch.dtype, device,
              plans: int = PLANS_KEPT) -> "RowCache":
        if plans < 1:
            raise ValueError("a row cache keeps at least one plan's rows")
        width = (plans + 1) * k
        return cls(torch.zeros(kvh, width, d, dtype=dtype, device=device),
                   torch.full((kvh, width), -1, dtype=torch.int32, device=device),
                   torch.zeros(kvh, n_ctx, dtype=torch.int32, device=device),
                   torch.zeros(2, dtype=torch.int64, device=device), plans)

    def fits(self, kvh: int, n_ctx: int, k: int) -> bool:
        return self.pos_of.shape == (kvh, (self.plans + 1) * k) and self.slot_of.shape == (kvh, n_ctx)


def frame_extent(n_ctx: int, sink: int, window: int) -> tuple[int, int]:
    """(s_end, Wr): the sink is context rows [0, s_end), the window's context part [N - Wr, N)."""
    s_end = min(sink, n_ctx)
    return s_end, min(max(window - 1, 0), n_ctx - s_end)


def stage_rows(src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, sink: int, window: int,
               cache: RowCache | None = None, step: torch.Tensor | None = None) -> None:
    """dst[h, p] = src[h, p] for every context row p a one-token step attends with this plan:
    src, dst [KVH, N, D] (src may be a mapped view of host memory), positions [KVH, 1, K] (-1 =
    none). With `cache` (and `step`, the step's position as a device int64 [1]), plan rows one of
    the cache's last plans had come from the cache, and this plan's rows replace its oldest plan's.
    Triton on CUDA (and through its interpreter when TRITON_INTERPRET=1), else torch."""
    kvh, n_ctx, d = src.shape
    if dst.shape != src.shape or dst.dtype != src.dtype or src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("dst must be src's shape and dtype, both with unit stride along D")
    if positions.dim() != 3 or positions.shape[:2] != (kvh, 1):
        raise ValueError("positions must be [KVH, 1, K]: one token's plan")
    n_pos = positions.shape[-1]
    if cache is not None and (not cache.fits(kvh, n_ctx, n_pos) or cache.vals.dtype != src.dtype or step is None):
        raise ValueError("the row cache must be [KVH, (plans + 1) K, D] of src's dtype for a plan of K positions, "
                         "with the step's position")
    s_end, win_rows = frame_extent(n_ctx, sink, window)
    if src.device.type != "cuda" and not interpreted():
        stage_rows_torch(src, dst, positions, sink, window, cache, step)
        return
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    c = cache
    args = (c.vals, c.pos_of, c.slot_of, c.counts, step) if c is not None else (dst, positions, positions, positions,
                                                                                positions)
    grid = (triton.cdiv(s_end + win_rows + n_pos, BLOCK_ROWS), kvh)
    _stage_kernel[grid](src, dst, positions, *args, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
                        positions.stride(0), n_ctx, s_end, win_rows, n_pos, D=d, BLOCK=BLOCK_ROWS,
                        REGIONS=0 if c is None else c.plans + 1)


def stage_rows_torch(src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, sink: int, window: int,
                     cache: RowCache | None = None, step: torch.Tensor | None = None) -> None:
    """The reference (and the CPU path) of `stage_rows`."""
    kvh, n_ctx, d = src.shape
    s_end, win_rows = frame_extent(n_ctx, sink, window)
    dev = src.device
    fixed = torch.cat([torch.arange(s_end, device=dev), torch.arange(n_ctx - win_rows, n_ctx, device=dev)])
    k = positions.shape[-1]
    for h in range(kvh):
        pos = positions[h, 0].to(dev).long()
        ok = (pos >= s_end) & (pos < n_ctx - win_rows)
        if cache is None:
            dst[h, pos[ok]] = src[h, pos[ok]]
        else:
            width, base = (cache.plans + 1) * k, int(step) % (cache.plans + 1) * k
            slot = cache.slot_of[h, pos.clamp(0, n_ctx - 1)].long().clamp(0, width - 1)
            hit = ok & ((slot < base) | (slot >= base + k)) & (cache.pos_of[h, slot].long() == pos)
            rows = torch.where(hit[:, None], cache.vals[h, slot], src[h, pos.clamp(0, n_ctx - 1)])
            dst[h, pos[ok]] = rows[ok]
            j = base + torch.arange(k, device=dev)
            cache.vals[h, j[ok]] = rows[ok]
            cache.pos_of[h, j] = torch.where(ok, pos, -1).to(cache.pos_of.dtype)
            cache.slot_of[h, pos[ok]] = j[ok].to(cache.slot_of.dtype)
            cache.counts += torch.tensor([int(hit.sum()), int(ok.sum())], device=cache.counts.device)
        dst[h, fixed] = src[h, fixed]


__all__ = ["BLOCK_ROWS", "PLANS_KEPT", "RowCache", "frame_extent", "stage_rows", "stage_rows_torch"]
