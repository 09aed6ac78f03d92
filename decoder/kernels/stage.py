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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from indexer.kernels import interpreted  # also makes Triton 3.6's interpreter work with NumPy 2.4

BLOCK_ROWS = 32


@triton.jit(do_not_specialize=["n_ctx", "s_end", "win_rows", "n_pos"])
def _stage_kernel(SRC, DST, POS, s_src_h, s_src_n, s_dst_h, s_dst_n, s_pos_h, n_ctx, s_end, win_rows, n_pos,
                  D: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row block, kv head): rows i of the list [sink | window | plan] of head h."""
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    nf = s_end + win_rows
    in_frame = i < nf
    in_plan = (i >= nf) & (i < nf + n_pos)
    p = tl.load(POS + h * s_pos_h + (i - nf), mask=in_plan, other=-1).to(tl.int64)
    row = tl.where(i < s_end, i.to(tl.int64), tl.where(in_frame, (n_ctx - nf + i).to(tl.int64), p))
    ok = in_frame | (in_plan & (row >= s_end) & (row < n_ctx - win_rows))  # plan rows in the frame go with it
    d = tl.arange(0, D)
    h64 = h.to(tl.int64)
    x = tl.load(SRC + h64 * s_src_h + row[:, None] * s_src_n + d[None, :], mask=ok[:, None])
    tl.store(DST + h64 * s_dst_h + row[:, None] * s_dst_n + d[None, :], x, mask=ok[:, None])


def frame_extent(n_ctx: int, sink: int, window: int) -> tuple[int, int]:
    """(s_end, Wr): the sink is context rows [0, s_end), the window's context part [N - Wr, N)."""
    s_end = min(sink, n_ctx)
    return s_end, min(max(window - 1, 0), n_ctx - s_end)


def stage_rows(src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, sink: int, window: int) -> None:
    """dst[h, p] = src[h, p] for every context row p a one-token step attends with this plan:
    src, dst [KVH, N, D] (src may be a mapped view of host memory), positions [KVH, 1, K] (-1 =
    none). Triton on CUDA (and through its interpreter when TRITON_INTERPRET=1), else torch."""
    kvh, n_ctx, d = src.shape
    if dst.shape != src.shape or dst.dtype != src.dtype or src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("dst must be src's shape and dtype, both with unit stride along D")
    if positions.dim() != 3 or positions.shape[:2] != (kvh, 1):
        raise ValueError("positions must be [KVH, 1, K]: one token's plan")
    s_end, win_rows = frame_extent(n_ctx, sink, window)
    n_pos = positions.shape[-1]
    if src.device.type != "cuda" and not interpreted():
        stage_rows_torch(src, dst, positions, sink, window)
        return
    if positions.stride(-1) != 1:
        positions = positions.contiguous()
    grid = (triton.cdiv(s_end + win_rows + n_pos, BLOCK_ROWS), kvh)
    _stage_kernel[grid](src, dst, positions, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
                        positions.stride(0), n_ctx, s_end, win_rows, n_pos, D=d, BLOCK=BLOCK_ROWS)


def stage_rows_torch(src: torch.Tensor, dst: torch.Tensor, positions: torch.Tensor, sink: int, window: int) -> None:
    """The reference (and the CPU path) of `stage_rows`."""
    kvh, n_ctx, d = src.shape
    s_end, win_rows = frame_extent(n_ctx, sink, window)
    dev = src.device
    fixed = torch.cat([torch.arange(s_end, device=dev), torch.arange(n_ctx - win_rows, n_ctx, device=dev)])
    for h in range(kvh):
        pos = positions[h, 0].to(dev).long()
        pos = pos[(pos >= s_end) & (pos < n_ctx - win_rows)]
        dst[h, pos] = src[h, pos]
        dst[h, fixed] = src[h, fixed]


__all__ = ["BLOCK_ROWS", "frame_extent", "stage_rows", "stage_rows_torch"]
