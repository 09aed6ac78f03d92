"""The attention kernel reading a request's row cache (`frame_attention(..., v_cache=...)`,
`decoder/kernels/attention.py`; the cache's layout: `decoder.kernels.stage.RowCache`): over several
one-token steps, a plan row that one of the cache's last plans had is read from the cache, any other
row from the context's values (host memory under `offload_v`), and the step's plan replaces the
oldest plan's region. Through Triton's interpreter on CPU CI, compiled on the device."""

from __future__ import annotations

import pytest
import torch

from decoder.backends import frame_mask
from indexer.base import KVView, Plan

kernels = pytest.importorskip("decoder.kernels.attention", reason="triton is not installed")
from decoder.kernels.stage import RowCache, stage_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative L2 against float64 (test_triton_attention.py)


def _plans(kvh: int, k: int, steps: int, lo: int, hi: int, n: int, gen: torch.Generator, valid_first: bool) -> list:
    """Per step a [KVH, K] plan: half of it drawn from the last three steps' rows [lo, hi), the rest
    new, plus a -1, a sink row (0) and a window row (n - 1) the kernel must leave to the frame. Distinct rows
    per head. valid_first: the -1 last (a planner that reports lengths)."""
    sel = torch.arange(lo, hi)
    out = []
    for _ in range(steps):
        rows = []
        for h in range(kvh):
            old = torch.unique(torch.cat([p[h] for p in out[-3:]] or [torch.empty(0, dtype=torch.long)]))
            old = old[(old >= lo) & (old < hi)]
            old = old[torch.randperm(old.numel(), generator=gen)][: k // 2]
            new = sel[~torch.isin(sel, old)]
            new = new[torch.randperm(new.numel(), generator=gen)][: k - 3 - old.numel()]
            row = torch.cat([old, new, torch.tensor([0, n - 1])])
            row = row[torch.randperm(row.numel(), generator=gen)]
            rows.append(torch.cat([row, torch.tensor([-1])]) if valid_first else torch.cat([torch.tensor([-1]), row]))
        out.append(torch.stack(rows))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("plans_kept", [1, 2])
@pytest.mark.parametrize("cfg,lengths", [(kernels.KernelConfig(block_n=16, splits=3), False),
                                         (kernels.KernelConfig(), False),
                                         (kernels.KernelConfig(block_n=16, splits=2), True)],
                         ids=["split3", "default", "lengths"])
def test_attention_reads_cached_rows_from_the_cache_and_the_rest_from_the_context(dtype, plans_kept, cfg, lengths):
    """Six steps. The context's values differ from step to step (ctx_v = v + step) and the rows the
    cache should serve are NaN in it, so the output equals the reference only if every hit came from
    the cache (holding the values of the step that read the row from the context) and every other
    row from the context of this step. The counters and the step's region agree."""
    gen = torch.Generator().manual_seed(11 + plans_kept + 7 * lengths)
    kvh, g, d, n, sink, window, k, m_cap = 2, 3, 16, 120, 4, 8, 20, 16
    ctx_k = torch.randn(kvh, n, d, generator=gen).to(dtype)
    base_v = torch.randn(kvh, n, d, generator=gen).to(dtype)
    loc_k = torch.randn(kvh, m_cap, d, generator=gen).to(dtype)
    loc_v = torch.randn(kvh, m_cap, d, generator=gen).to(dtype)
    plans = _plans(kvh, k, 6, sink, n - window, n, gen, valid_first=lengths)
    cache = RowCache.empty(kvh, n, k, d, dtype, DEVICE, plans=plans_kept)
    regions = plans_kept + 1
    read_at: dict = {}  # (h, p) -> the step whose context the cached row came from
    hits = rows = 0
    for t, plan in enumerate(plans):
        q_pos = torch.tensor([n + t])  # the step's own key is local slot t
        w_lo = n - window + 1 + t
        ok = [[s_end_ok and p < w_lo for p, s_end_ok in zip(plan[h].tolist(), (plan[h] >= sink).tolist())]
              for h in range(kvh)]
        hit = [[o and any(p in set(x[h].tolist()) for x in plans[max(0, t - plans_kept):t])
                for p, o in zip(plan[h].tolist(), ok[h])] for h in range(kvh)]
        ctx_v = base_v + t
        want_v = ctx_v.clone()  # what the kernel must attend
        for h in range(kvh):
            for p, o, c in zip(plan[h].tolist(), ok[h], hit[h]):
                if c:
                    ctx_v[h, p] = float("nan")
                    want_v[h, p] = base_v[h, p] + read_at[h, p]
                elif o:
                    read_at[h, p] = t
                hits, rows = hits + c, rows + o
        q = torch.randn(kvh, g, 1, d, generator=gen).to(dtype)
        positions = plan[:, None].to(torch.int32)  # [KVH, 1, K]
        lens = (positions >= 0).sum(-1).to(torch.int32) if lengths else None
        out = kernels.frame_attention(
            q.to(DEVICE), ctx_k.to(DEVICE), ctx_v.to(DEVICE), loc_k.to(DEVICE), loc_v.to(DEVICE), q_pos.to(DEVICE),
            positions.to(DEVICE), sink, window, 0.25, lengths=None if lens is None else lens.to(DEVICE), cfg=cfg,
            v_cache=cache)
        kv = KVView(ctx_k, want_v, loc_k, loc_v, q_pos)
        mask = frame_mask(Plan(positions), kv, sink, window, g)
        s = torch.einsum("hgtd,hnd->hgtn", q.double(), torch.cat([ctx_k, loc_k], 1).double()) * 0.25
        ref = torch.einsum("hgtn,hnd->hgtd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1),
                           torch.cat([want_v, loc_v], 1).double())
        err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < TOL[dtype], (t, err)
        base = (n + t) % regions * k
        got = cache.pos_of.cpu()[:, base:base + k]
        for h in range(kvh):
            for j, (p, o) in enumerate(zip(plan[h].tolist(), ok[h])):
                if o:
                    assert got[h, j] == p, (t, h, j)
                    assert torch.equal(cache.vals.cpu()[h, base + j], want_v[h, p])
    assert 0 < hits < rows
    assert cache.counts.tolist() == [hits, rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lengths", [False, True])
def test_attention_reads_a_staged_region_and_the_context_for_rows_it_lacks(dtype, lengths):
    """`v_staged`: `stage_rows` filled the step's region with a plan that differs from the attended
    one in five rows per head, over a first staging of the attended plan itself (so the five rows'
    `slot_of` entries point at slots that now hold other rows). The staged rows are NaN in the
    context after staging, so the output equals the reference only if those came from the cache and
    the five others from the context; the attention writes nothing (the counters stay the stage's)."""
    gen = torch.Generator().manual_seed(5 + lengths)
    kvh, g, d, n, sink, window, k, m_cap = 2, 3, 16, 120, 4, 8, 20, 16
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    ctx_k, ctx_v, loc_k, loc_v, q = r(kvh, n, d), r(kvh, n, d), r(kvh, m_cap, d), r(kvh, m_cap, d), r(kvh, g, 1, d)
    step = n + 2  # two request tokens before this one
    plan, staged = [], []
    for _ in range(kvh):
        rows = (torch.randperm(n - window - sink, generator=gen) + sink)[: k + 2]  # outside the frame
        body = torch.cat([rows[: k - 3], torch.tensor([0, n - 1])])  # + a sink and a window duplicate
        body = body[torch.randperm(body.numel(), generator=gen)]
        plan.append(torch.cat([body, torch.tensor([-1])]))
        other = body.clone()
        other[torch.isin(other, rows[k - 8: k - 3])] = rows[k - 3: k + 2]  # five rows the stage has instead
        staged.append(torch.cat([other, torch.tensor([-1])]))
    plan, staged = torch.stack(plan)[:, None].to(torch.int32), torch.stack(staged)[:, None].to(torch.int32)
    cache = RowCache.empty(kvh, n, k, d, dtype, DEVICE)
    for p in (plan, staged):
        stage_rows(ctx_v.to(DEVICE), p.to(DEVICE), sink, window, cache, torch.tensor([step], device=DEVICE))
    counts = cache.counts.tolist()
    poisoned = ctx_v.clone()
    for h in range(kvh):
        s = staged[h, 0].long()
        s = s[(s >= sink) & (s < n - window + 1)]
        poisoned[h, s] = float("nan")
    q_pos = torch.tensor([step])
    lens = (plan >= 0).sum(-1).to(torch.int32) if lengths else None
    out = kernels.frame_attention(
        q.to(DEVICE), ctx_k.to(DEVICE), poisoned.to(DEVICE), loc_k.to(DEVICE), loc_v.to(DEVICE), q_pos.to(DEVICE),
        plan.to(DEVICE), sink, window, 0.25, lengths=None if lens is None else lens.to(DEVICE),
        cfg=kernels.KernelConfig(block_n=16, splits=3), v_cache=cache, v_staged=True)
    mask = frame_mask(Plan(plan), KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos), sink, window, g)
    s = torch.einsum("hgtd,hnd->hgtn", q.double(), torch.cat([ctx_k, loc_k], 1).double()) * 0.25
    ref = torch.einsum("hgtn,hnd->hgtd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1),
                       torch.cat([ctx_v, loc_v], 1).double())
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err
    assert cache.counts.tolist() == counts


def test_attention_row_cache_is_for_one_token_plans_that_fit():
    kvh, g, d, n = 2, 2, 16, 40
    z = lambda *s: torch.zeros(*s, device=DEVICE)  # noqa: E731
    q_pos = torch.tensor([n], device=DEVICE)
    pos = torch.zeros(kvh, 1, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="row cache"):  # the cache holds plans of 4 positions
        kernels.frame_attention(z(kvh, g, 1, d), z(kvh, n, d), z(kvh, n, d), z(kvh, 4, d), z(kvh, 4, d), q_pos, pos,
                                1, 2, 1.0, v_cache=RowCache.empty(kvh, n, 4, d, torch.float32, DEVICE))
    with pytest.raises(ValueError, match="row cache"):  # two tokens
        kernels.frame_attention(z(kvh, g, 2, d), z(kvh, n, d), z(kvh, n, d), z(kvh, 4, d), z(kvh, 4, d),
                                torch.tensor([n, n + 1], device=DEVICE), pos.expand(kvh, 2, 5), 1, 2, 1.0,
                                v_cache=RowCache.empty(kvh, n, 5, d, torch.float32, DEVICE))
