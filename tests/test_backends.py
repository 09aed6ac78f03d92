"""Attention backends against a plain float64 reference: dense attention masked to the frame ∪ plan
token set (`frame_mask`), on fresh random inputs. The triton backend's own tests are in
tests/test_triton_attention.py."""

from __future__ import annotations

import pytest
import torch

from decoder.backends import frame_fraction, frame_mask, frame_rows, get_backend
from indexer.base import KVView, Plan, frame_bounds


def _reference(q, kv: KVView, mask, scale, rest_logit=None, rest_value=None):
    """float64 attention over [ctx; loc] restricted to mask [KVH, G, T, N + M] (+ pseudo-token)."""
    k = torch.cat([kv.ctx_k, kv.loc_k], 1).double()
    v = torch.cat([kv.ctx_v, kv.loc_v], 1).double()
    s = torch.einsum("hgtd,hnd->hgtn", q.double(), k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if rest_logit is not None:
        s = torch.cat([s, rest_logit.double()[..., None]], -1)
        v_all = v[:, None, None].expand(-1, q.shape[1], q.shape[2], -1, -1)
        v_all = torch.cat([v_all, rest_value.double()[:, None, None, None].expand(-1, q.shape[1], q.shape[2], 1, -1)], -2)
        return torch.einsum("hgtn,hgtnd->hgtd", torch.softmax(s, -1), v_all)
    return torch.einsum("hgtn,hnd->hgtd", torch.softmax(s, -1), v)


def _inputs(seed, kvh=3, g=3, t=4, n=200, m_cap=10, m=6, d=16, k=40, dtype=torch.float32):
    """A step of t query tokens, the request holding m tokens in a buffer of m_cap slots."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    q = r(kvh, g, t, d)
    kv = KVView(r(kvh, n, d), r(kvh, n, d), r(kvh, m_cap, d), r(kvh, m_cap, d), n + m - t + torch.arange(t))
    # distinct positions (a plan's contract) with -1 padding, some inside the sink / window (the
    # backend masks those: they are attended once, as frame)
    pos = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(kvh * t)]).view(kvh, t, k)
    pos = torch.where(torch.rand(kvh, t, k, generator=gen) < 0.2, -1, pos).to(torch.int32)
    return q, kv, pos


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("backend", ["torch_ref", "offload", "offload_v"])
def test_backend_equals_masked_dense(seed, backend):
    q, kv, pos = _inputs(seed)
    plan = Plan(pos)
    out = get_backend(backend).run(q, kv, plan, 4, 8, 0.25)
    ref = _reference(q, kv, frame_mask(plan, kv, 4, 8, q.shape[1]), 0.25)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("backend", ["torch_ref", "offload", "offload_v"])
def test_dense_plan_is_causal_dense_attention(backend):
    q, kv, _ = _inputs(5)
    out = get_backend(backend).run(q, kv, Plan.dense(), 4, 8, 0.125)
    n, m = kv.n_ctx, kv.loc_k.shape[1]
    causal = (torch.arange(n + m)[None, :] <= kv.q_pos[:, None])[None, None].expand(3, 3, -1, -1)
    ref = _reference(q, kv, causal, 0.125)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_plan_of_everything_equals_dense():
    q, kv, _ = _inputs(7)
    n = kv.n_ctx
    everything = Plan(torch.arange(n, dtype=torch.int32).expand(3, q.shape[2], n))
    be = get_backend("torch_ref")
    torch.testing.assert_close(be.run(q, kv, everything, 4, 8, 0.125), be.run(q, kv, Plan.dense(), 4, 8, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_frame_mask_is_sink_window_local_and_plan():
    """The attended set, by hand: sink, context part of the window, the plan, every visible local slot."""
    q, kv, pos = _inputs(3, t=3, n=50, m_cap=8, m=5, k=6)
    sink, window = 4, 8
    mask = frame_mask(Plan(pos), kv, sink, window, q.shape[1])
    n = kv.n_ctx
    for h in range(3):
        for i in range(3):
            p = int(kv.q_pos[i])
            want = set(range(sink)) | {x for x in range(p - window + 1, p + 1)} | {int(x) for x in pos[h, i] if x >= 0}
            want |= set(range(n, p + 1))  # request-local tokens up to the query
            want = {x for x in want if 0 <= x <= p}
            got = set(mask[h, 0, i].nonzero().flatten().tolist())
            assert got == want
            assert (mask[h, :, i] == mask[h, 0, i]).all()  # the group shares it


def test_frame_rows_mask_duplicates_of_sink_and_window():
    q_pos = torch.tensor([103])
    s_end, w_lo = frame_bounds(q_pos, 100, 4, 8)
    assert s_end == 4 and int(w_lo[0]) == 96  # window: 96..103, of which 96..99 are context
    pos = torch.tensor([[[0, 3, 4, 95, 96, 99, -1, 50]]], dtype=torch.int32)  # 0, 3: sink; 96, 99: window
    rows, ok, nf = frame_rows(pos, q_pos, 100, 1, 4, 8)
    assert nf == 12
    assert ok[0, 0, :4].all() and ok[0, 0, 4:8].all() and not ok[0, 0, 8:12].any()  # window slots past the context
    assert ok[0, 0, nf:].tolist() == [False, False, True, True, False, False, False, True]


def test_bypass_and_pseudo_token():
    """A bypassed head attends the frame only, plus the pseudo-token standing for the rest."""
    q, kv, pos = _inputs(11, t=2)
    kvh, g, t, d = q.shape
    gen = torch.Generator().manual_seed(5)
    bypass = torch.rand(kvh, g, t, generator=gen) < 0.5
    rest_logit = torch.where(bypass, torch.randn(kvh, g, t, generator=gen), float("-inf"))
    rest_value = torch.randn(kvh, d, generator=gen)
    plan = Plan(pos, bypass=bypass, rest_logit=rest_logit, rest_value=rest_value)
    out = get_backend("torch_ref").run(q, kv, plan, 4, 8, 0.25)
    mask = frame_mask(plan, kv, 4, 8, g)
    assert not torch.equal(mask[bypass], frame_mask(Plan(pos), kv, 4, 8, g)[bypass])  # the plan is dropped there
    ref = _reference(q, kv, mask, 0.25, rest_logit, rest_value)
    assert (out.double() - ref).norm() / ref.norm() < 1e-5


def test_frame_fraction_counts_the_attended_set():
    q, kv, pos = _inputs(4)
    plan = Plan(pos)
    frac = frame_fraction(plan, kv, 4, 8)
    mask = frame_mask(plan, kv, 4, 8, q.shape[1])[:, 0]  # [KVH, T, N + M]
    torch.testing.assert_close(frac, mask.sum(-1).float() / (kv.q_pos + 1).float()[None])
    assert torch.equal(frame_fraction(Plan.dense(), kv, 4, 8), torch.ones(3, q.shape[2]))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_torch_ref_low_precision(dtype, tol):
    q, kv, pos = _inputs(9, dtype=dtype)
    plan = Plan(pos)
    out = get_backend("torch_ref").run(q, kv, plan, 4, 8, 0.25)
    assert out.dtype == dtype
    ref = _reference(q, kv, frame_mask(plan, kv, 4, 8, q.shape[1]), 0.25)
    assert (out.double() - ref).norm() / ref.norm() < tol


def test_offload_maps_only_pinned_host_memory():
    """`mapped` hands the GPU a view of host memory only where the driver mapped it: pageable memory
    is refused before any CUDA call (on a GPU worker the pipeline pins the context first)."""
    from decoder.backends.offload import mapped

    with pytest.raises(ValueError, match="pinned"):
        mapped(torch.zeros(4, 8))
