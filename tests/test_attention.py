"""Decode attention kernels against a plain dense-with-mask reference (fresh random inputs)."""

from __future__ import annotations

import pytest
import torch

from decoder.attention import dense_attention, merge_selection, sparse_attention


def _reference(q, ctx_k, ctx_v, loc_k, loc_v, mask, scale):
    """float64 dense attention over [ctx; loc] with a boolean mask [KVH, T, N + M]."""
    k = torch.cat([ctx_k, loc_k], 1).double()
    v = torch.cat([ctx_v, loc_v], 1).double()
    s = torch.einsum("hgtd,hnd->hgtn", q.double(), k) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("hgtn,hnd->hgtd", torch.softmax(s, -1), v)


def _inputs(seed, kvh=3, g=3, t=4, n=200, m=6, d=16):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return r(kvh, g, t, d), r(kvh, n, d), r(kvh, n, d), r(kvh, m, d), r(kvh, m, d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_matches_reference(seed):
    q, ck, cv, lk, lv = _inputs(seed)
    n, m, t = ck.shape[1], lk.shape[1], q.shape[2]
    q_pos = n + m - t + torch.arange(t)
    mask = (torch.arange(n + m)[None, :] <= q_pos[:, None]).expand(3, t, n + m)
    out = dense_attention(q, ck, cv, lk, lv, 0.25)
    ref = _reference(q, ck, cv, lk, lv, mask, 0.25)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_equals_masked_dense(seed):
    q, ck, cv, lk, lv = _inputs(seed)
    n, m, t = ck.shape[1], lk.shape[1], q.shape[2]
    q_pos = n + m - t + torch.arange(t)
    gen = torch.Generator().manual_seed(100 + seed)
    sel = torch.randint(-1, n + m, (3, t, 40), generator=gen)  # includes -1 padding, duplicates, future positions
    idx = merge_selection(sel, q_pos, n_sink=4, window=8)
    mask = torch.zeros(3, t, n + m, dtype=torch.bool)
    for h in range(3):
        for i in range(t):
            chosen = set(sel[h, i].tolist()) | set(range(4)) | set(range(q_pos[i] - 7, q_pos[i] + 1))
            for p in chosen:
                if 0 <= p <= q_pos[i]:
                    mask[h, i, p] = True
    # the merged set is exactly the union, deduplicated, padding at the end
    for h in range(3):
        for i in range(t):
            got = [p for p in idx[h, i].tolist() if p >= 0]
            assert got == sorted(set(got)) and set(got) == set(mask[h, i].nonzero().flatten().tolist())
            assert all(p == -1 for p in idx[h, i, len(got):].tolist())
    out = sparse_attention(q, idx, ck, cv, lk, lv, 0.25)
    ref = _reference(q, ck, cv, lk, lv, mask, 0.25)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_full_selection_equals_dense():
    q, ck, cv, lk, lv = _inputs(7)
    n, m, t = ck.shape[1], lk.shape[1], q.shape[2]
    q_pos = n + m - t + torch.arange(t)
    everything = torch.arange(n + m).expand(3, t, n + m)
    idx = merge_selection(everything, q_pos, 4, 8)
    out = sparse_attention(q, idx, ck, cv, lk, lv, 0.125)
    dense = dense_attention(q, ck, cv, lk, lv, 0.125)
    assert torch.allclose(out, dense, atol=1e-5, rtol=1e-5)
