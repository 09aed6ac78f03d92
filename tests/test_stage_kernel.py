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
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_stage_row_cache_serves_exactly_the_previous_plans_rows(dtype, impl):
    """Three steps over one layer's cache. A plan row the step before planned comes from the cache
    (its host row is poisoned, yet the mirror is right); any other row, including one planned two
    steps before, comes from host memory (which then differs); the device counters agree."""
    torch.manual_seed(3)
    kvh, n, d, sink, window, k = 3, 300, 32, 4, 16, 40
    dev = "cuda" if impl == "triton" and torch.cuda.is_available() else "cpu"
    stage = stage_rows if impl == "triton" else stage_rows_torch
    src = torch.randn(kvh, n, d).to(dtype)
    selectable = torch.arange(sink, n - window + 1)  # outside the frame: the rows the cache may serve
    perm = torch.stack([selectable[torch.randperm(selectable.numel())] for _ in range(kvh)])  # distinct per head
    h2, q4 = k // 2, k // 4
    plans = [perm[:, :k],
             torch.cat([perm[:, :h2], perm[:, k:k + h2]], 1),  # half of step 0's plan, half new
             # step 0's rows step 1 did not plan, some of step 1's, new rows, padding
             torch.cat([perm[:, h2:h2 + q4], perm[:, k:k + q4], perm[:, 2 * k:2 * k + h2 - 1],
                        torch.full((kvh, 1), -1)], 1)]
    cache = RowCache.empty(kvh, n, k, d, dtype, dev)
    dst = torch.zeros(kvh, n, d, dtype=dtype, device=dev)
    hosts = [src, src.clone(), src + 1]
    for h in range(kvh):  # step 1's host: step 0's rows poisoned
        hosts[1][h, plans[0][h]] = float("nan")
    hits = 0
    for t, (host, plan) in enumerate(zip(hosts, plans)):
        stage(host.to(dev), dst, plan[:, None].to(torch.int32).to(dev), sink, window, cache)
        got = dst.cpu()
        for h in range(kvh):
            prev = set(plans[t - 1][h].tolist()) if t else set()
            for p in plan[h].tolist():
                if p >= 0:
                    assert torch.equal(got[h, p], src[h, p] if p in prev else host[h, p]), (t, h, p, p in prev)
                    hits += p in prev
    assert hits == kvh * (h2 + q4)
    assert cache.counts.tolist() == [hits, sum(int((x >= 0).sum()) for x in plans)]
    assert torch.equal(cache.pos_of.cpu(), plans[2].to(torch.int32))


def test_stage_row_cache_must_fit_the_plan():
    src = torch.zeros(2, 10, 8)
    with pytest.raises(ValueError, match="row cache"):
        stage_rows(src, torch.zeros_like(src), torch.zeros(2, 1, 3, dtype=torch.int32), 1, 2,
                   RowCache.empty(2, 10, 4, 8, torch.float32, "cpu"))
