"""decoder/kernels/stage.py: the value rows a one-token step's plan attends, staged into the step's
region of the request's row cache (through Triton's interpreter on CPU CI, on the device for real)."""

from __future__ import annotations

import pytest
import torch

from decoder.kernels.stage import RowCache, stage_rows, stage_rows_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter


def _stage(impl: str):
    return stage_rows if impl == "triton" else stage_rows_torch


def _selectable(n: int, sink: int, window: int, step: int) -> torch.Tensor:
    """The rows a plan may stage, from the definition (indexer.base.frame_bounds), not from the code."""
    s_end = min(sink, n)
    w_lo = min(max(step - window + 1, s_end), n)
    return torch.arange(s_end, w_lo)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,sink,window,k,step", [(200, 4, 16, 24, 203), (50, 0, 0, 40, 50), (37, 64, 8, 5, 37),
                                                  (300, 4, 1, 0, 300), (120, 4, 32, 30, 140)])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_stage_fills_the_region_with_exactly_the_plan_rows(dtype, n, sink, window, k, step, impl):
    """An empty cache: slot j of the step's region holds the plan's j-th row when the row is outside
    the step's frame (duplicates of the sink and the window, and -1, leave the slot empty), the
    other regions stay empty, and every row came from the context."""
    torch.manual_seed(n + k)
    kvh, d, plans = 3, 32, 2
    src = torch.randn(kvh, n, d).to(dtype)
    positions = torch.stack([torch.randperm(n)[:k] for _ in range(kvh)])[:, None].to(torch.int32)  # [KVH, 1, K]
    if k:
        positions[0, 0, : k // 3] = -1  # padding
        positions[1, 0, -1] = positions[1, 0, 0]  # a duplicate
        positions[2, 0, 0] = 0  # a row of the sink
    cache = RowCache.empty(kvh, n, k, d, dtype, DEVICE, plans=plans)
    _stage(impl)(src.to(DEVICE), positions.to(DEVICE), sink, window, cache, torch.tensor([step], device=DEVICE))
    ok = torch.isin(positions[:, 0].long(), _selectable(n, sink, window, step))  # [KVH, K]
    base = step % (plans + 1) * k
    pos_of, vals = cache.pos_of.cpu(), cache.vals.cpu()
    assert torch.equal(pos_of[:, base:base + k], torch.where(ok, positions[:, 0], -1))
    others = torch.ones(pos_of.shape[1], dtype=torch.bool)
    others[base:base + k] = False
    assert bool((pos_of[:, others] == -1).all())
    for h in range(kvh):
        for j in range(k):
            if ok[h, j]:
                p = int(positions[h, 0, j])
                assert torch.equal(vals[h, base + j], src[h, p])  # bit for bit
                slots = base + (positions[h, 0] == p).nonzero().flatten()  # a duplicate: either of its slots
                assert int(cache.slot_of.cpu()[h, p]) in slots.tolist()
    assert cache.counts.tolist() == [0, int(ok.sum())]


def test_stage_refuses_what_it_cannot_stage():
    src = torch.zeros(2, 10, 8)
    step = torch.tensor([10])
    with pytest.raises(ValueError, match="one token"):
        stage_rows(src, torch.zeros(2, 2, 3, dtype=torch.int32), 1, 2, RowCache.empty(2, 10, 3, 8, torch.float32,
                                                                                        "cpu"), step)
    with pytest.raises(ValueError, match="row cache"):  # the cache holds plans of 4 positions
        stage_rows(src, torch.zeros(2, 1, 3, dtype=torch.int32), 1, 2, RowCache.empty(2, 10, 4, 8, torch.float32,
                                                                                        "cpu"), step)
    with pytest.raises(ValueError, match="at least one"):
        RowCache.empty(2, 10, 3, 8, torch.float32, "cpu", plans=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plans", [1, 2])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_stage_serves_exactly_the_last_plans_rows_from_the_cache(dtype, plans, impl):
    """Six steps over one layer's cache keeping `plans` plans. A plan row one of the last `plans`
    plans had comes from the cache (its host row is poisoned, yet the region is right); any other
    row, including one planned a step earlier than that, comes from host memory, which differs from
    step to step (host_t = src + t), so the region shows the step it was last read at. The device
    counters agree."""
    torch.manual_seed(3 + plans)
    kvh, n, d, sink, window, k = 3, 300, 32, 4, 16, 40
    src = torch.randn(kvh, n, d).to(dtype)
    selectable = torch.arange(sink, n - window + 1)  # outside every step's frame below
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
    cache = RowCache.empty(kvh, n, k, d, dtype, DEVICE, plans=plans)
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
        step = n + t  # the step's position: its region is step % (plans + 1)
        _stage(impl)(host.to(DEVICE), plan[:, None].to(torch.int32).to(DEVICE), sink, window, cache,
                     torch.tensor([step], device=DEVICE))
        base = step % (plans + 1) * k
        got = cache.vals.cpu()
        assert torch.equal(cache.pos_of.cpu()[:, base:base + k], plan.to(torch.int32))
        for h in range(kvh):
            for j, (p, hit) in enumerate(zip(plan[h].tolist(), expect_hit[h])):
                if p < 0:
                    continue
                if not hit:
                    read_at[h, p] = t
                assert torch.equal(got[h, base + j], src[h, p] + read_at[h, p]), (t, h, p, hit)
                hits += hit
                rows += 1
    assert 0 < hits < rows
    assert cache.counts.tolist() == [hits, rows]
