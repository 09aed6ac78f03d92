"""The row cache: the context value rows a request's last plans read, kept in HBM; and staging a
step's rows into it from host memory ahead of the attention.

Under `offload_v` (and `offload`) the context's values live in pinned host memory and the attention
reads the rows it attends over PCIe, which stalls the step: ~0.9 ms per layer for eight requests at
128K (ctkvr: 1,024 scattered rows per KV head plus the frame), against ~0.41 ms for the rest of the
layer (benchmarks/RESULTS.md, "Offload_v's reads"). What makes those reads slow is not their bytes
but their number: the GPU reads 64-byte to 1-KiB granules scattered over host memory at the same
~31-37 per µs, 128-byte ones as slowly as 256-byte ones, while contiguous reads run at 51 GB/s
(`benchmarks/gpu_host_reads.py --sections granule`; RESULTS.md, "Scattered host reads cost by
count"). Consecutive plans overlap: on the default model at 8K, 69% of ctkvr's planned rows were
planned by the step before, 76% by one of the two before, 82% by one of the four before
(`benchmarks/bench_value_reuse.py`). So each request keeps, per layer, the rows its last `plans`
plans read (`RowCache`), and only the others cross PCIe.

**Layout** (`RowCache`): plans + 1 regions of K slots (`vals` [KVH, (plans + 1) K, D], `pos_of` the
position a slot holds, -1 = none) and `slot_of` [KVH, N], the slot a position was last cached in
(valid only where `pos_of` agrees: no clearing, ever). A step writes region `step % (plans + 1)`
(`step`: the device scalar of the step's position, so a replayed graph advances it) with its plan's
rows, slot j = the plan's j-th position, and reads hits only from the other regions: one launch, and
no program reads a slot another program of the launch writes. Context rows never change, so a cached
row is right for as long as the request lives. `counts` [2] int64 accumulates (cache hits, plan rows
read) on the device.

**Who fills it.** Without staging, the attention kernel looks each plan row up and writes the
step's region itself (`decoder/kernels/attention.py`, `v_cache`). With `plan_ahead` (layer L's plan
exists during layer L - 1), `stage_rows` fills layer L's region on the planning side stream, from
the other regions or from host memory, and layer L's attention then finds every plan row in the
cache (`v_staged`: lookups only): the PCIe reads leave layer L's critical path. The frame's rows
(sink, window) are not staged: contiguous, they are cheap to read in place (RESULTS.md, "The
attention reads the row cache": 0.91× of all-GPU with every plan row cached). A plan row the stage
leaves out is read from host memory by the attention, so the two only have to agree for speed; they
use the same bounds (`indexer.base.frame_bounds` of the step's position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from indexer.kernels import interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4

BLOCK_ROWS = 32


@triton.jit(do_not_specialize=["n_ctx", "s_end", "window", "n_pos"])
def _stage_kernel(SRC, POS, VALS, POS_OF, SLOT_OF, COUNTS, STEP, s_src_h, s_src_n, s_pos_h, n_ctx, s_end, window,
                  n_pos, D: tl.constexpr, BLOCK: tl.constexpr, REGIONS: tl.constexpr):
    """Program (slot block, kv head): plan slots j of head h -> this step's region (module docstring)."""
    h = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_plan = j < n_pos
    row = tl.load(POS + h * s_pos_h + j, mask=in_plan, other=-1).to(tl.int64)
    step = tl.load(STEP).to(tl.int64)
    w_lo = tl.minimum(tl.maximum(step - window + 1, s_end), n_ctx)  # indexer.base.frame_bounds
    ok = in_plan & (row >= s_end) & (row < w_lo)  # plan rows in the frame are read with it
    width = REGIONS * n_pos
    base = (step % REGIONS) * n_pos  # this step's region: written below, never read
    slot = tl.load(SLOT_OF + h * n_ctx + row, mask=ok, other=0).to(tl.int64)
    slot = tl.minimum(tl.maximum(slot, 0), width - 1)
    mine = (slot >= base) & (slot < base + n_pos)
    hit = ok & ~mine & (tl.load(POS_OF + h * width + slot, mask=ok, other=-1).to(tl.int64) == row)
    d = tl.arange(0, D)
    cached = tl.load(VALS + (h * width + slot)[:, None] * D + d[None, :], mask=hit[:, None])
    x = tl.load(SRC + h * s_src_h + row[:, None] * s_src_n + d[None, :], mask=(ok & ~hit)[:, None])
    x = tl.where(hit[:, None], cached, x)
    tl.store(VALS + (h * width + base + j)[:, None] * D + d[None, :], x, mask=ok[:, None])
    tl.store(POS_OF + h * width + base + j, tl.where(ok, row, -1).to(tl.int32), mask=in_plan)
    tl.store(SLOT_OF + h * n_ctx + row, (base + j).to(tl.int32), mask=ok)
    tl.atomic_add(COUNTS, tl.sum(hit.to(tl.int64), axis=0))
    tl.atomic_add(COUNTS + 1, tl.sum(ok.to(tl.int64), axis=0))


PLANS_KEPT = 2  # RowCache's default: the rows of the last two plans (76% of ctkvr's at 8K, against 69% for one)


@dataclass
class RowCache:
    """One layer's cache of the value rows its last `plans` plans read (module docstring): `vals`
    [KVH, (plans + 1) K, D], `pos_of` [KVH, (plans + 1) K] int32 (-1 = empty), `slot_of` [KVH, N]
    int32, `counts` [2] int64 (hits, plan rows read so far)."""

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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.vals, self.pos_of, self.slot_of, self.counts))

    def fits(self, kvh: int, n_ctx: int, k: int) -> bool:
        return self.pos_of.shape == (kvh, (self.plans + 1) * k) and self.slot_of.shape == (kvh, n_ctx)


def stage_rows(src: torch.Tensor, positions: torch.Tensor, sink: int, window: int, cache: RowCache,
               step: torch.Tensor) -> None:
    """Fill this step's region of `cache` with the plan's rows: src [KVH, N, D] the context's values
    (a mapped view of host memory under the offload backends), positions [KVH, 1, K] one token's
    plan (-1 = none), step the step's position (a device int64 [1]). A plan row one of the cache's
    last plans had comes from the cache, any other from src; rows in the step's frame (sink, window;
    `indexer.base.frame_bounds`) are left to the attention. Triton on CUDA (and through its
    interpreter when TRITON_INTERPRET=1), else torch."""
    kvh, n_ctx, d = src.shape
    if src.stride(-1) != 1:
        raise ValueError("src must have unit stride along D")
    if positions.dim() != 3 or positions.shape[:2] != (kvh, 1):
        raise ValueError("positions must be [KVH, 1, K]: one token's plan")
    n_pos = positions.shape[-1]
    if not cache.fits(kvh, n_ctx, n_pos) or cache.vals.dtype != src.dtype:
        raise ValueError("the row cache must be [KVH, (plans + 1) K, D] of src's dtype for a plan of K positions")
    if n_pos == 0:
        return
    if src.device.type != "cuda" and not interpreted():
        stage_rows_torch(src, positions, sink, window, cache, step)
        return
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    _stage_kernel[(triton.cdiv(n_pos, BLOCK_ROWS), kvh)](
        src, positions, cache.vals, cache.pos_of, cache.slot_of, cache.counts, step, src.stride(0), src.stride(1),
        positions.stride(0), n_ctx, min(sink, n_ctx), window, n_pos, D=d, BLOCK=BLOCK_ROWS, REGIONS=cache.plans + 1)


def stage_rows_torch(src: torch.Tensor, positions: torch.Tensor, sink: int, window: int, cache: RowCache,
                     step: torch.Tensor) -> None:
    """The reference (and the CPU path) of `stage_rows`."""
    kvh, n_ctx, d = src.shape
    s_end, k, at = min(sink, n_ctx), positions.shape[-1], int(step)
    w_lo = min(max(at - window + 1, s_end), n_ctx)
    width, base = (cache.plans + 1) * k, at % (cache.plans + 1) * k
    j = base + torch.arange(k, device=cache.vals.device)
    for h in range(kvh):
        pos = positions[h, 0].to(cache.vals.device).long()
        ok = (pos >= s_end) & (pos < w_lo)
        slot = cache.slot_of[h, pos.clamp(0, n_ctx - 1)].long().clamp(0, width - 1)
        hit = ok & ((slot < base) | (slot >= base + k)) & (cache.pos_of[h, slot].long() == pos)
        rows = torch.where(hit[:, None], cache.vals[h, slot], src[h, pos.clamp(0, n_ctx - 1)].to(cache.vals.device))
        cache.vals[h, j[ok]] = rows[ok]
        cache.pos_of[h, j] = torch.where(ok, pos, -1).to(cache.pos_of.dtype)
        cache.slot_of[h, pos[ok]] = j[ok].to(cache.slot_of.dtype)
        cache.counts += torch.tensor([int(hit.sum()), int(ok.sum())], device=cache.counts.device)


__all__ = ["BLOCK_ROWS", "PLANS_KEPT", "RowCache", "stage_rows", "stage_rows_torch"]
