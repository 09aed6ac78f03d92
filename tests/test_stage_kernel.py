"""decoder/kernels/stage.py: the value rows a one-token step attends, staged into a GPU mirror of
the context (through Triton's interpreter on CPU CI, on the device for real)."""

from __future__ import annotations

import pytest
import torch

from decoder.kernels.stage import RowCache, frame_extent, stage_rows, stage_rows_torch


def _attended(n: int, positions: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """[KVH, N] bool: the rows the step reads, built from the definition (not from the code under test)."""
    kvh = positions.shape[0]
    s_end = min(sink, n)
    wr = min(max(window - 1, 0), n - s_end)
    want = torch.zeros(kvh, n, dtype=torch.bool)
    want[:, :s_end] = True
    want[:, n - wr:] = True  # empty when wr = 0
    for h in range(kvh):
        p = positions[h, 0]
        want[h, p[p >= 0].long()] = True
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,sink,window,k", [(200, 4, 16, 24), (50, 0, 0, 40), (37, 64, 8, 5), (300, 4, 1, 0)])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_stage_copies_exactly_the_attended_rows(dtype, n, sink, window, k, impl):
    torch.manual_seed(n + k)
    kvh, d = 3, 32
    dev = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"  # else Triton's interpreter
    src = torch.randn(kvh, n, d).to(dtype)
    positions = torch.stack([torch.randperm(n)[:k] for _ in range(kvh)])[:, None].to(torch.int32)  # [KVH, 1, K]
    if k:
        positions[0, 0, : k // 3] = -1  # padding
        positions[1, 0, -1] = positions[1, 0, 0]  # a duplicate
        positions[2, 0, 0] = 0  # a row of the sink, again
    dst = torch.full_like(src, 7.0).to(dev)
    (stage_rows if impl == "triton" else stage_rows_torch)(src.to(dev), dst, positions.to(dev), sink, window)
    dst = dst.cpu()
    want = _attended(n, positions, sink, window)
    assert torch.equal(dst[want], src[want])  # every attended row, bit for bit
    assert bool((dst[~want] == 7.0).all())  # and nothing else


def test_stage_frame_extent_matches_the_attention_kernel():
    assert frame_extent(100, 4, 16) == (4, 15)
    assert frame_extent(10, 4, 16) == (4, 6)  # the window stops at the sink
    assert frame_extent(3, 4, 16) == (3, 0)
    assert frame_extent(100, 4, 0) == (4, 0)


def test_stage_refuses_what_it_cannot_stage():
    src = torch.zeros(2, 10, 8)
    with pytest.raises(ValueError, match="shape"):
        stage_rows(src, torch.zeros(2, 11, 8), torch.zeros(2, 1, 3, dtype=torch.int32), 1, 2)
    with pytest.raises(ValueError, match="one token"):
        stage_rows(src, torch.zeros_like(src), torch.zeros(2, 2, 3, dtype=torch.int32), 1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plans", [1, 2])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_stage_row_cache_serves_exactly_the_last_plans_rows(dtype, plans, impl):
    """Six steps over one layer's cache keeping `plans` plans. A plan row one of the last `plans`
    plans had comes from the cache (its host row is poisoned, yet the mirror is right); any other
    row, including one planned a step earlier than that, comes from host memory, which differs from
    step to step (host_t = src + t), so the mirror shows the step it was last read at. The
    device counters, and the slots this step's plan was written to, agree."""
    torch.manual_seed(3 + plans)
    kvh, n, d, sink, window, k = 3, 300, 32, 4, 16, 40
    dev = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    stage = stage_rows if impl == "triton" else stage_rows_torch
    src = torch.randn(kvh, n, d).to(dtype)
    selectable = torch.arange(sink, n - window + 1)  # outside the frame: the rows the cache may serve
    plans_of = []  # per step: [KVH, K], distinct per head, with -1 padding
    for t in range(6):
        rows = []
        for h in range(kvh):
            old = torch.unique(torch.cat([x[h] for x in plans_of[-3:]] or [torch.empty(0, dtype=torch.long)]))
            old = old[old >= 0][torch.randperm(int((old >= 0).sum()))][: k // 2]
            new = selectable[~torch.isin(selectable, old)]
            new = new[torch.randperm(new.numel())][: k - 1 - old.numel()]
            rows.append(torch.cat([old, new, torch.tensor([-1])]))
        plans_of.append(torch.stack(rows))
    step = torch.zeros(1, dtype=torch.long, device=dev)
    cache = RowCache.empty(kvh, n, k, d, dtype, dev, plans=plans)
    dst = torch.zeros(kvh, n, d, dtype=dtype, device=dev)
    read_at = {}  # (h, p) -> the step whose host the cached row came from
    hits = rows = 0
    for t, plan in enumerate(plans_of):
        expect_hit = [[p >= 0 and any(p in set(x[h].tolist()) for x in plans_of[max(0, t - plans):t])
                       for p in plan[h].tolist()] for h in range(kvh)]
        host = src + t
        for h in range(kvh):
            for p, hit in zip(plan[h].tolist(), expect_hit[h]):
                if hit:
                    host[h, p] = float("nan")
        step.fill_(100 + t)  # any start: the region is the step's position modulo plans + 1
        stage(host.to(dev), dst, plan[:, None].to(torch.int32).to(dev), sink, window, cache, step)
        got = dst.cpu()
        for h in range(kvh):
            for p, hit in zip(plan[h].tolist(), expect_hit[h]):
                if p < 0:
                    continue
                if not hit:
                    read_at[h, p] = t
                assert torch.equal(got[h, p], src[h, p] + read_at[h, p]), (t, h, p, hit)
                hits += hit
                rows += 1
        base = (100 + t) % (plans + 1) * k
        assert torch.equal(cache.pos_of.cpu()[:, base:base + k], plan.to(torch.int32))
    assert 0 < hits < rows
    assert cache.counts.tolist() == [hits, rows]


def test_stage_row_cache_must_fit_the_plan():
    src = torch.zeros(2, 10, 8)
    with pytest.raises(ValueError, match="row cache"):
        stage_rows(src, torch.zeros_like(src), torch.zeros(2, 1, 3, dtype=torch.int32), 1, 2,
                   RowCache.empty(2, 10, 4, 8, torch.float32, "cpu"), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="row cache"):  # no step
        stage_rows(src, torch.zeros_like(src), torch.zeros(2, 1, 3, dtype=torch.int32), 1, 2,
                   RowCache.empty(2, 10, 3, 8, torch.float32, "cpu"))
    with pytest.raises(ValueError, match="at least one"):
        RowCache.empty(2, 10, 3, 8, torch.float32, "cpu", plans=0)
