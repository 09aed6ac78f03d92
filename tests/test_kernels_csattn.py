"""The fused csattn search (indexer/kernels/csattn.py) against the torch `search` it replaces on a
GPU (indexer/csattn.py), on fresh random tables and queries, for every switch of the search
(pooling, subspace weights, missing score, backoff), question chunks and one-token steps.

On a machine without CUDA the kernels run through Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay small; on a GPU the same tests run on
CUDA tensors, plus the sync-free / CUDA-graph test at the end.

What "equal" means (the kernel module's docstring): every plan row holds the same set of positions
as the torch plan's row (compared sorted), and the fused score buffer equals a float64 sum of the
torch path's fp32 terms up to one fp32 rounding (rtol 2e-6: the centroid choice's norms may differ
by an ulp) with -inf at the same places. Tables are random (Gaussian scores rounded to fp16, sorted
per list; distinct keys per list). With the paper's scoring (uniform weights, missing score 0) a
key's score is a sum of a few fp16 values, and exact ties at the K-th score are common: there the
rows must select the same multiset of scores (each path's select picks among the tied keys).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from indexer.selection import selectable_mask
from indexer.base import DecodeContext, IndexReader, KVView, get_method
from indexer.csattn import CSAttnParams, build_layer, search

cs = pytest.importorskip("indexer.kernels.csattn", reason="triton is not installed")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(seed, kvh, m, c, ds, n, lk, device=DEVICE):
    """Random persisted tables of one layer: unit fp16 centroids, lists of distinct keys with
    Gaussian fp16 scores sorted descending (the `build_layer` layout)."""
    gen = torch.Generator(device).manual_seed(seed)  # drawn where they live (the GPU test's are large)
    cent = F.normalize(torch.randn(kvh, m, c, ds, generator=gen, device=device), dim=-1).half()
    idx = torch.rand(kvh, m, c, n, generator=gen, device=device).argsort(-1)[..., :lk].to(torch.int32)
    score = (torch.randn(kvh, m, c, lk, generator=gen, device=device) * 2).sort(-1, descending=True).values.half()
    return cent, idx, score


def _queries(seed, kvh, g, t, d, n, dtype=torch.float32, scale=1.5):
    gen = torch.Generator().manual_seed(10_000 + seed)
    q = (torch.randn(kvh, g, t, d, generator=gen) * scale).to(dtype)
    return q.to(DEVICE), torch.arange(n + 3, n + 3 + t, device=DEVICE)


def _reference_scores(cent, idx, score, q, q_pos, n, p, sink, window):
    """The dense, masked score buffer of the torch search with its fp32 terms summed in float64
    (the centroid choice and list weights are torch's own formulas, copied from `search`)."""
    kvh, g, t, d = q.shape
    m, c, lk = cent.shape[1], cent.shape[2], idx.shape[-1]
    ds = d // m
    qs = q.float().reshape(kvh, g, t, m, ds)
    qn = qs.norm(dim=-1, keepdim=True)
    qt = qs / qn.clamp_min(1e-12)
    if p.pooling == "sum":
        qt = F.normalize(qt.sum(1, keepdim=True), dim=-1, eps=1e-12)
        qn = qn.mean(1, keepdim=True)
    tau = min(p.tau, c) if p.backoff is not None else 1
    cos = torch.einsum("hgtmd,hmcd->hgtmc", qt, cent.float())
    top_cos, cid = cos.topk(tau, dim=-1)
    use = torch.ones_like(top_cos, dtype=torch.bool)
    if tau > 1:
        use[..., 1:] = top_cos[..., :1] < p.backoff
    lw = torch.where(use, top_cos.clamp_min(1e-6), 0.0)
    lw = lw / lw.sum(-1, keepdim=True)
    wl = (qn if p.subspace_weights == "query_norm" else torch.ones_like(qn)) * lw  # [KVH, G', T, m, tau]
    h_ar = torch.arange(kvh, device=q.device).view(kvh, 1, 1, 1, 1)
    b_ar = torch.arange(m, device=q.device).view(1, 1, 1, m, 1)
    li = idx[h_ar, b_ar, cid].long()  # [KVH, G', T, m, tau, Lk]
    ls = score[h_ar, b_ar, cid].float()
    if p.missing_score == "list_min":
        ls = ls - ls[..., -1:]
    ls = (ls * wl[..., None]).double()
    li = torch.where(use[..., None], li, n).permute(0, 2, 1, 3, 4, 5).reshape(kvh, t, -1)
    ls = ls.permute(0, 2, 1, 3, 4, 5).reshape(kvh, t, -1)
    acc = torch.zeros(kvh, t, n + 1, dtype=torch.float64, device=q.device).scatter_add_(-1, li, ls)
    hit = torch.zeros(kvh, t, n + 1, dtype=torch.bool, device=q.device).scatter_(-1, li, True)
    ok = hit[..., :n] & selectable_mask(q_pos, n, sink, window)
    return acc[..., :n].masked_fill(~ok, float("-inf")), use


def _assert_same_plan(got, want, ref, what):
    """Rows equal as sets; where the K-th score ties (exactly equal reference scores: common with the
    paper's scoring, sums of a few fp16 values), the selected scores as multisets (the tied keys
    themselves may differ: each path's select picks among them)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.int32, what
    if torch.equal(got.sort(-1).values, want.sort(-1).values):
        return
    assert ref is not None, f"{what}: fused plan differs from the torch plan"

    def picked(pos):
        return torch.where(pos >= 0, ref.gather(-1, pos.long().clamp_min(0)), float("-inf")).sort(-1).values

    assert torch.equal(picked(got), picked(want)), f"{what}: fused plan differs from the torch plan"


def _assert_scores(got, ref, what):
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), f"{what}: -inf at other places"
    fin = torch.isfinite(ref)
    scale = ref.masked_fill(~fin, 0).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((got.double() - ref).abs() / scale).masked_fill(~fin, 0)
    rel = ((got.double() - ref).abs() / ref.abs().clamp_min(1e-30)).masked_fill(~fin, 0)
    assert float(torch.minimum(err, rel).max()) < 2e-6, f"{what}: scores differ beyond rounding"


SMALL = dict(kvh=2, g=2, d=16, m=4, c=8)


def _check(seed, p, *, n, lk, ts, k, sink=4, window=16, dtype=torch.float32, cfg=None, shape=SMALL, strided=False):
    """Searches over fresh queries with ts tokens each: fused == torch, scores == float64 reference.
    Returns how many lists were backed off to (tau > 1 in use)."""
    kvh, g, d, m, c = (shape[x] for x in ("kvh", "g", "d", "m", "c"))
    cent, idx, score = _tables(seed, kvh, m, c, d // m, n, lk)
    backed_off = 0
    for i, t in enumerate(ts):
        what = f"seed {seed} step {i} (T={t})"
        q, q_pos = _queries(seed * 7 + i, kvh, g, t, d, n, dtype)
        if strided:  # head dims not contiguous (stride T): the fused path copies
            q = q.transpose(2, 3).contiguous().transpose(2, 3)
        ref, use = _reference_scores(cent, idx, score, q, q_pos, n, p, sink, window)
        backed_off += int(use[..., 1:].sum())
        _assert_scores(cs.scores(cent, idx, score, q, q_pos, n, p, sink, window, cfg=cfg), ref, what)
        want = search(cent, idx, score, q, q_pos, n, k, p, sink, window)
        got = cs.search(cent, idx, score, q, q_pos, n, k, p, sink, window, cfg=cfg)
        _assert_same_plan(got, want, ref, what)
    return backed_off


SWITCHES = [(pool, wts, miss, bo) for pool in ("sum", "per_head") for wts in ("uniform", "query_norm")
            for miss in ("zero", "list_min") for bo in (0.7, None)]


@pytest.mark.parametrize("pooling, weights, missing, backoff", SWITCHES)
def test_fused_search_equals_torch(pooling, weights, missing, backoff):
    p = CSAttnParams(m=4, n_centroids=8, list_len=96, k=30, pooling=pooling, subspace_weights=weights,
                     missing_score=missing, backoff=backoff, sink=4, window=16)
    seed = zlib.crc32(f"{pooling}{weights}{missing}{backoff}".encode()) % 1000
    backed_off = _check(seed, p, n=300 + seed % 300, lk=96, ts=[1, 3], k=30)
    if backoff is not None:  # ds = 4, C = 8: the best cosine is often below 0.7
        assert backed_off > 0, "no subspace backed off: the test no longer covers the backoff"


def test_fused_search_wide_backoff_bf16_and_select_kernel(monkeypatch):
    """tau = 3 (three lists per backed-off subspace), bf16 queries with strided head dims, a group
    of 3 (padded heads), and the radix select kernel through the interpreter too
    (CTXCACHE_TRITON_SELECT=1)."""
    monkeypatch.setenv("CTXCACHE_TRITON_SELECT", "1")
    p = CSAttnParams(m=4, n_centroids=6, list_len=80, k=40, tau=3, backoff=0.9, pooling="per_head",
                     sink=2, window=8)
    shape = dict(kvh=2, g=3, d=32, m=4, c=6)
    assert _check(11, p, n=500, lk=80, ts=[2, 1], k=40, sink=2, window=8, dtype=torch.bfloat16, shape=shape,
                  strided=True) > 0


def test_long_chunks_are_searched_in_pieces():
    """A question chunk larger than the workspace is searched in chunks of query tokens (here 2 at a
    time: 4 rows of 400 cells per chunk): the same plan as the torch path's."""
    p = CSAttnParams(m=4, n_centroids=8, list_len=64, rho=0.1, sink=4, window=16)
    tiny = cs.CsattnConfig(block=32, block_n=128, scores_per_chunk=2 * 2 * 400)
    assert cs._chunk_tokens(5, 2, 400, tiny) == 2
    _check(3, p, n=400, lk=64, ts=[5], k=40, cfg=tiny)


def test_frame_covering_the_context_leaves_nothing():
    """A window that covers the whole context: every score -inf, every plan slot -1 (both paths)."""
    kvh, g, d, m, c, n = 2, 2, 16, 4, 8, 200
    p = CSAttnParams(m=m, n_centroids=c, list_len=50, k=20, sink=4, window=400)
    cent, idx, score = _tables(1, kvh, m, c, d // m, n, 50)
    q, q_pos = _queries(1, kvh, g, 2, d, n)
    assert torch.isinf(cs.scores(cent, idx, score, q, q_pos, n, p, 4, 400)).all()
    got = cs.search(cent, idx, score, q, q_pos, n, 20, p, 4, 400)
    assert (got == -1).all() and torch.equal(got, search(cent, idx, score, q, q_pos, n, 20, p, 4, 400))


def test_extreme_query_scales_keep_the_ranking():
    """The fixed-point exponent follows the row's largest list bound: queries scaled by 1e-9 and
    1e12 give the same plan as the torch path and scores within rounding (no overflow, no
    underflow to ties)."""
    p = CSAttnParams(m=4, n_centroids=8, list_len=96, k=30, sink=4, window=16)
    kvh, g, d, n = 2, 2, 16, 400
    cent, idx, score = _tables(5, kvh, 4, 8, d // 4, n, 96)
    for scale in (1e-9, 1e12):  # (|q|^2 must stay inside fp32 for both paths)
        q, q_pos = _queries(5, kvh, g, 2, d, n, scale=scale)
        ref, _ = _reference_scores(cent, idx, score, q, q_pos, n, p, 4, 16)
        _assert_scores(cs.scores(cent, idx, score, q, q_pos, n, p, 4, 16), ref, f"scale {scale}")
        _assert_same_plan(cs.search(cent, idx, score, q, q_pos, n, 30, p, 4, 16),
                          search(cent, idx, score, q, q_pos, n, 30, p, 4, 16), ref, f"scale {scale}")


def test_deterministic_and_poisoned_workspaces():
    """Two searches give bit-identical scores and the same plan; the list records and the score
    buffer start poisoned (garbage) in the second: every value read was written by that search;
    the int64 accumulator is left zeroed by every search (the next one starts from it)."""
    p = CSAttnParams(m=4, n_centroids=8, list_len=96, k=30, pooling="per_head", sink=4, window=16)
    kvh, g, d, n = 2, 2, 16, 400
    cent, idx, score = _tables(9, kvh, 4, 8, d // 4, n, 96)
    q, q_pos = _queries(9, kvh, g, 3, d, n)
    cs.clear_workspace()
    first = cs.scores(cent, idx, score, q, q_pos, n, p, 4, 16)
    plan = cs.search(cent, idx, score, q, q_pos, n, 30, p, 4, 16)
    assert all((buf == 0).all() for buf in cs._ACCUMULATORS.buffers())
    for buf in cs._WORKSPACES.buffers():
        if buf.is_floating_point():
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)) * 1e30)
            buf[::3] = float("nan")
        else:
            buf.copy_(torch.randint(-(2 ** 31), 2 ** 31 - 1, buf.shape, generator=torch.Generator().manual_seed(2)))
    again = cs.scores(cent, idx, score, q, q_pos, n, p, 4, 16)
    assert torch.equal(first, again)
    assert torch.equal(plan.sort(-1).values, cs.search(cent, idx, score, q, q_pos, n, 30, p, 4, 16).sort(-1).values)
    assert all((buf == 0).all() for buf in cs._ACCUMULATORS.buffers())


def test_interrupted_search_leaves_a_clean_accumulator(monkeypatch):
    p = CSAttnParams(m=4, n_centroids=8, list_len=96, k=30, sink=4, window=16)
    kvh, g, d, n = 2, 2, 16, 300
    cent, idx, score = _tables(4, kvh, 4, 8, d // 4, n, 96)
    q, q_pos = _queries(4, kvh, g, 1, d, n)
    want = cs.scores(cent, idx, score, q, q_pos, n, p, 4, 16)

    class Boom:
        def __getitem__(self, grid):
            raise RuntimeError("launch failed")

    with monkeypatch.context() as mp:
        mp.setattr(cs, "_finalize_kernel", Boom())
        with pytest.raises(RuntimeError, match="launch failed"):
            cs.scores(cent, idx, score, q, q_pos, n, p, 4, 16)
    assert all((buf == 0).all() for buf in cs._ACCUMULATORS.buffers())
    assert torch.equal(cs.scores(cent, idx, score, q, q_pos, n, p, 4, 16), want)


def test_planner_dispatch_on_built_tables(monkeypatch):
    """The planner with `fused = True` (the kernels; on CPU through the interpreter) plans what the
    torch planner plans over a question chunk and one-token steps, on tables from `build_layer`;
    CTXCACHE_FUSED_CSATTN=0 keeps it on torch."""
    n, kvh, g, d = 320, 2, 2, 16
    gen = torch.Generator().manual_seed(8)
    qc, kc = torch.randn(kvh * g, n, d, generator=gen), torch.randn(kvh, n, d, generator=gen)
    p = CSAttnParams(m=4, n_centroids=8, list_len=64, rho=0.1, sink=4, window=8)
    tables = build_layer(qc, kc, p, torch.Generator().manual_seed(0))
    arrays = {name: t[None].to(DEVICE) for name, t in zip(("centroids", "idx", "score"), tables)}
    reader = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    method = get_method("csattn")
    ctx = DecodeContext(n, None, 8)
    ref, fused = method.open(reader, p, ctx), method.open(reader, p, ctx)
    ref.fused, fused.fused = False, True
    calls = []
    real = cs.search
    monkeypatch.setattr(cs, "search", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    m_tok = 0
    for t in (4, 1, 1):
        m_tok += t
        q = torch.randn(kvh, g, t, d, generator=gen).to(DEVICE)
        loc = torch.randn(kvh, m_tok, d, generator=gen).to(DEVICE)
        kv = KVView(kc.to(DEVICE), kc.to(DEVICE), loc, loc, torch.arange(n + m_tok - t, n + m_tok, device=DEVICE))
        _assert_same_plan(fused.plan(0, q, kv).positions, ref.plan(0, q, kv).positions, None, f"T={t}")
        ref.update(0, None, None, kv.q_pos)
        fused.update(0, None, None, kv.q_pos)
    assert len(calls) == 3
    monkeypatch.setenv(cs.ENV_FLAG, "0")
    fused.plan(0, q, kv)
    assert len(calls) == 3


def test_unsupported_configurations_keep_the_torch_path(monkeypatch):
    q = torch.zeros(1, 2, 1, 128, device=DEVICE)
    assert not cs.unsupported(q, torch.zeros(1, 8, 64, 16))
    assert cs.unsupported(q, torch.zeros(1, 8, 4096, 16))  # the cosine tile of the choose kernel
    monkeypatch.setenv(cs.ENV_FLAG, "0")
    assert cs.unsupported(q, torch.zeros(1, 8, 64, 16))


def test_fixed_point_bits_leave_room():
    """|sum| < 2^F and v = sum + count · 2^(F+1) with count <= L lists stay below 2^62."""
    for n_lists in (1, 2, 3, 16, 64, 65, 4096, 1 << 16):
        f, lb = cs.fixed_point_bits(n_lists)
        assert (1 << lb) >= n_lists and n_lists * (1 << (f + 1)) + (1 << f) < 1 << 62


# ---------------------------------------------------------------------------------------------
# GPU (skipped on CPU CI with a reason, see conftest.py)


@pytest.mark.gpu
def test_fused_search_makes_no_host_sync_and_replays_in_a_graph():
    """The 8B layer's shape at a 16K context: the search runs under set_sync_debug_mode("error"),
    a CUDA graph of it replays to the same selection as an eager search (compared by the selected
    scores, so exact ties at the K-th score may pick other keys), and the torch path agrees."""
    kvh, g, d, m, c, n = 8, 4, 128, 8, 64, 16384
    lk = n // 5
    p = CSAttnParams(rho=0.05, sink=4, window=64)
    k = p.budget(n)
    cent, idx, score = _tables(1, kvh, m, c, d // m, n, lk, device="cuda")
    steps = [_queries(20 + i, kvh, g, 1, d, n, torch.bfloat16) for i in range(3)]
    for i, (q, q_pos) in enumerate(steps[:-1]):
        torch.cuda.set_sync_debug_mode("error" if i > 0 else "default")  # the first step compiles
        try:
            cs.search(cent, idx, score, q, q_pos, n, k, p, 4, 64)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    q, q_pos = steps[-1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        cs.search(cent, idx, score, q, q_pos, n, k, p, 4, 64)  # warm up on the capture stream (its workspaces)
        with torch.cuda.graph(graph):
            got = cs.search(cent, idx, score, q, q_pos, n, k, p, 4, 64)
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    want = cs.search(cent, idx, score, q, q_pos, n, k, p, 4, 64)
    sc = cs.scores(cent, idx, score, q, q_pos, n, p, 4, 64)
    torch.cuda.synchronize()
    assert (got >= 0).all()

    def picked(pos):
        return sc.gather(-1, pos.long()).sort(-1).values

    assert torch.equal(picked(got), picked(want))
    ref, _ = _reference_scores(cent, idx, score, q, q_pos, n, p, 4, 64)
    _assert_scores(sc, ref, "8B shape")
    torch_plan = search(cent, idx, score, q, q_pos, n, k, p, 4, 64)
    overlap = (torch_plan[..., :, None] == got[..., None, :]).any(-1).float().mean()
    assert float(overlap) >= 0.999  # torch's fp32 sums in scatter order: near-ties at the K-th may flip
