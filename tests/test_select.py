"""indexer/selection.py: the fixed-width selection helpers the planners share, against brute force."""

from __future__ import annotations

import pytest
import torch

from indexer.selection import (
    bmm_f32,
    candidate_mass,
    dedup_positions,
    expand_clusters,
    frame_logsumexp,
    gather_rows,
    probe_width,
    selectable,
    selectable_mask,
)
from indexer.base import KVView, frame_bounds


def _csr(assign: torch.Tensor, c: int):
    order = torch.argsort(assign, dim=-1, stable=True)
    counts = torch.stack([torch.bincount(a, minlength=c) for a in assign])
    offsets = torch.zeros(assign.shape[0], c + 1, dtype=torch.int64)
    offsets[:, 1:] = counts.cumsum(-1)
    return order, offsets


def test_expand_clusters_at_the_probe_width_lists_every_probed_key():
    gen = torch.Generator().manual_seed(0)
    kvh, n, c, t, p = 3, 500, 17, 4, 5
    assign = torch.randint(0, c, (kvh, n), generator=gen) ** 2 % c  # unequal sizes, some clusters empty
    order, offsets = _csr(assign, c)
    probe = torch.stack([torch.stack([torch.randperm(c, generator=gen)[:p] for _ in range(t)]) for _ in range(kvh)])
    width = probe_width(offsets, p)
    sizes = torch.stack([torch.bincount(a, minlength=c) for a in assign])
    assert width == int(sizes.sort(-1, descending=True).values[:, :p].sum(-1).max())
    got = expand_clusters(probe, order, offsets, width)
    assert got.shape == (kvh, t, width)
    for h in range(kvh):
        for i in range(t):
            want = sorted(j for j in range(n) if int(assign[h, j]) in set(probe[h, i].tolist()))
            ids = got[h, i][got[h, i] >= 0].tolist()
            assert sorted(ids) == want and len(ids) == len(set(ids))
    cut = expand_clusters(probe, order, offsets, 7)  # a smaller width keeps a prefix of the same list
    assert torch.equal(cut, got[..., :7])


def test_selectable_is_outside_sink_and_window():
    q_pos = torch.tensor([100, 101, 130])
    n, sink, window = 100, 4, 8
    s_end, w_lo = frame_bounds(q_pos, n, sink, window)
    assert s_end == 4 and w_lo.tolist() == [93, 94, 100]  # the last query's window holds no context token
    mask = selectable_mask(q_pos, n, sink, window)
    for i, p in enumerate(q_pos.tolist()):
        want = [j for j in range(n) if j >= sink and j < p - window + 1]
        assert mask[i].nonzero().flatten().tolist() == want
    pos = torch.arange(-1, n + 2).expand(3, -1)
    assert torch.equal(selectable(pos, q_pos, n, sink, window)[:, 1:n + 1], mask)
    assert not selectable(pos, q_pos, n, sink, window)[:, [0, -1, -2]].any()


def test_dedup_keeps_one_slot_per_position():
    gen = torch.Generator().manual_seed(3)
    pos = torch.randint(-1, 20, (4, 2, 30), generator=gen)
    got = dedup_positions(pos, 20)
    for a, b in zip(pos.reshape(-1, 30), got.reshape(-1, 30)):
        kept = b[b >= 0].tolist()
        assert sorted(kept) == sorted(set(a[a >= 0].tolist())) and len(kept) == len(set(kept))
        assert all(x == y for x, y in zip(a.tolist(), b.tolist()) if y >= 0)  # kept ones stay in their slot


def test_candidate_mass_with_the_frame_is_the_oracle_mass():
    """Over every selectable token, with the frame's rows in each head's normaliser, the pooled
    score is exactly the oracle's group attention mass (indexer/topk.py) at those positions;
    without them it is not (a sink-heavy head is rescaled)."""
    from indexer.topk import group_attention_mass

    gen = torch.Generator().manual_seed(5)
    kvh, g, t, d, n, m = 2, 3, 2, 16, 120, 6
    q = torch.randn(kvh, g, t, d, generator=gen)
    ctx_k = torch.randn(kvh, n, d, generator=gen)
    ctx_k[:, 0] = 4 * q[:, :, 0].mean(1)  # a sink that takes much of the mass
    kv = KVView(ctx_k, torch.randn(kvh, n, d, generator=gen), torch.randn(kvh, m, d, generator=gen),
                torch.randn(kvh, m, d, generator=gen), torch.tensor([n + 3, n + 4]))
    cand = torch.arange(n).expand(kvh, t, n)
    ok = selectable(cand, kv.q_pos, n, 4, 8)
    oracle = group_attention_mass(q, kv)[..., :n]
    got = candidate_mass(q, cand, ctx_k, ok, frame_logsumexp(q, kv, 4, 8))
    torch.testing.assert_close(got[ok], oracle[ok], atol=1e-5, rtol=1e-5)
    assert (got[~ok] == -1).all()
    alone = candidate_mass(q, cand, ctx_k, ok)
    assert not torch.allclose(alone[ok], oracle[ok], atol=1e-3)


def test_gather_rows_reads_views_in_place():
    x = torch.randn(3, 50, 8)
    view = x[:, 10:40]  # a context sliced out of a capture
    idx = torch.randint(0, 30, (3, 7))
    want = torch.stack([view[h, idx[h]] for h in range(3)])
    assert torch.equal(gather_rows(view, idx), want)
    assert torch.equal(gather_rows(x.transpose(0, 1).contiguous().transpose(0, 1)[:, 10:40], idx), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bmm_f32_accumulates_in_float32(dtype):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 64, generator=gen).to(dtype), torch.randn(2, 64, 9, generator=gen).to(dtype)
    got = bmm_f32(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a.double().bmm(b.double()).float(), atol=1e-4, rtol=1e-4)
