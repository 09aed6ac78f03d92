"""The fused LFPS search and table update (indexer/kernels/lfps.py) against the torch path they
replace on a GPU (indexer/lfps.py, `_LFPSPlanner.search` / `update`), side by side over several
decode steps on fresh random inputs, so the tables evolve under both.

On a machine without CUDA the kernels run through Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1; a planner runs them there when `planner.fused = True`),
so shapes stay small; on a GPU the same tests run on CUDA tensors, plus the sync-free / CUDA-graph
test at the end.

What "equal" means (the kernel module's docstring): each row of the candidate set and of the plan
holds the same set of positions (any order: compared as sets), Plan.bypass is equal, the sparsity
estimate, Plan.rest_logit and the statistics agree to fp32 rounding (rtol 1e-5), and the tables after
each update agree to TABLE_RTOL = 1e-5 relative + TABLE_ATOL = 1e-8 (the weights are the same
formulas summed in another order; the tables' entries are ~1e-4-1e-1). Inputs are Gaussian (fp32 and
bf16 keys): no ties among table scores or masses.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import pytest
import torch

from indexer.base import DecodeContext, IndexReader, KVView, PrefillCapture, get_method
from synthetic import decode_steps

lk = pytest.importorskip("indexer.kernels.lfps", reason="triton is not installed")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = lk.LfpsConfig(block=32, block_score=16, block_moments=64, block_k=32, block_decay=128, block_states=2)
TABLE_RTOL, TABLE_ATOL = 1e-5, 1e-8
M_CAP = 16
NEG_BIG = float(torch.tensor(-1e30, dtype=torch.float32))  # the kernels' empty running max


def _spec(kvh, g, d):
    return SimpleNamespace(num_layers=1, num_heads=kvh * g, num_kv_heads=kvh, head_dim=d, group_size=g)


def _index(seed, kvh, g, d, n, params, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kvh * g, n, d, generator=gen) * 1.5
    k = torch.randn(1, kvh, n, d, generator=gen)
    v = torch.randn(1, kvh, n, d, generator=gen)
    cap = PrefillCapture(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), positions=torch.arange(n), spec=_spec(kvh, g, d))
    arrays = {name: a.to(DEVICE) for name, a in get_method("lfps").build(cap, params).items()}
    return IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays)), cap


def _steps(seed, kvh, g, d, n, ts, ctx, dtype=torch.float32, past=0):
    """Decode steps of a request (`synthetic.decode_steps`); `past` > 0: the request is that much
    longer than its M_CAP local slots (slash offsets past the tables' capacity, every slot visible)."""
    return decode_steps(seed, kvh, g, d, n, ts, ctx, DEVICE, m_cap=M_CAP, dtype=dtype, past=past)


def _rows(x):
    return [set(r) - {-1} for r in x.reshape(-1, x.shape[-1]).tolist()]


def _assert_same_search(got, want, what):
    assert got.plan.positions.shape == want.plan.positions.shape and got.plan.positions.dtype == torch.int32, what
    assert _rows(got.candidates) == _rows(want.candidates), f"{what}: candidate sets differ"
    assert _rows(got.plan.positions) == _rows(want.plan.positions), f"{what}: plan rows differ"
    for row in got.plan.positions.reshape(-1, got.plan.positions.shape[-1]).tolist():  # distinct, -1 only empty
        valid = [x for x in row if x >= 0]
        assert len(set(valid)) == len(valid), what
    if want.plan.bypass is None:
        assert got.plan.bypass is None and got.sparsity is None, what
    else:
        assert torch.equal(got.plan.bypass, want.plan.bypass), f"{what}: bypass differs"
        torch.testing.assert_close(got.sparsity, want.sparsity, rtol=1e-5, atol=1e-7, msg=what)
        torch.testing.assert_close(got.plan.rest_logit, want.plan.rest_logit, rtol=1e-5, atol=1e-5, msg=what)
        assert torch.equal(got.plan.rest_value, want.plan.rest_value)
    torch.testing.assert_close(got.stats, want.stats, rtol=1e-5, atol=1e-7, msg=what)


def _assert_same_tables(a, b, what):
    for x, y in zip(a._tables[0], b._tables[0]):
        torch.testing.assert_close(y, x, rtol=TABLE_RTOL, atol=TABLE_ATOL, msg=what)


CASES = {
    # name: ((kvh, g, d, n), params, query tokens per step, dtype)
    "decode_cap_binds": ((2, 2, 16, 400), dict(), [1, 1, 1, 1], torch.float32),  # expanded ~50% > cap 30%
    "decode_cap_free": ((2, 2, 16, 400), dict(max_candidates=1.0), [1, 1, 1], torch.float32),
    "bypass_off": ((2, 2, 16, 500), dict(bypass=False, max_candidates=0.2), [1, 1, 1], torch.float32),
    "some_heads_bypassed": ((2, 2, 16, 400), dict(bypass_threshold=0.004), [1, 1, 1, 1], torch.float32),
    "groups_bypassed": ((2, 2, 16, 400), dict(bypass_threshold=0.0085, sink=8), [1, 1, 1], torch.float32),
    "two_tokens": ((2, 2, 16, 450), dict(dense_prompt=False), [2, 1, 2], torch.float32),
    "two_tokens_cap_free": ((2, 2, 16, 300), dict(dense_prompt=False, max_candidates=1.0, window=8), [2, 2],
                            torch.float32),
    "k_beyond_candidates": ((2, 2, 16, 300), dict(ratio=0.6, max_candidates=1.0), [1, 1], torch.float32),
    "no_sink_wide_window": ((2, 3, 16, 350), dict(sink=0, window=100, local=40), [1, 1], torch.float32),
    "bf16": ((2, 2, 32, 600), dict(), [1, 1, 1], torch.bfloat16),
    "longer_than_max_local": ((2, 2, 16, 300), dict(), [1, 1], torch.float32),
}
PAST = {"longer_than_max_local": 40}


def _run(case, *, cfg=None, monkeypatch=None, select_kernel=False):
    (kvh, g, d, n), params, ts, dtype = CASES[case]
    if cfg is not None:
        monkeypatch.setattr(lk, "DEFAULT_CONFIG", cfg)
    if select_kernel:  # the radix select's kernels also under the interpreter
        monkeypatch.setenv("CTXCACHE_TRITON_SELECT", "1")
    seed = zlib.crc32(case.encode()) % 1000
    m = get_method("lfps")
    p = m.Params(**params)
    index, cap = _index(seed, kvh, g, d, n, p, dtype)
    ctx = DecodeContext(n, _spec(kvh, g, d), M_CAP)
    ref, fused = m.open(index, p, ctx), m.open(index, p, ctx)
    ref.fused, fused.fused = False, True
    seen = {"capped": 0, "bypassed": 0, "active": 0, "groups_bypassed": 0, "empty_slots": 0}
    for i, (q, kv) in enumerate(_steps(seed, kvh, g, d, n, ts, (cap.k[0], cap.v[0]), dtype, PAST.get(case, 0))):
        what = f"{case} step {i}"
        want = ref.search(0, q, kv)
        got = fused.search(0, q, kv)
        assert isinstance(got.update, lk.FusedUpdate), what
        _assert_same_search(got, want, what)
        seen["capped"] += int(want.stats[2] > 0)
        seen["empty_slots"] += int((want.plan.positions < 0).sum())
        if want.plan.bypass is not None:
            seen["bypassed"] += int(want.plan.bypass.sum())
            seen["active"] += int((~want.plan.bypass).sum())
            seen["groups_bypassed"] += int(want.plan.bypass.all(1).sum())  # rank with every head, no update
        ref.plan(0, q, kv)  # plan() = search() + bookkeeping: pending update, statistics
        fused.plan(0, q, kv)
        ref.update(0, None, None, kv.q_pos)
        fused.update(0, None, None, kv.q_pos)
        _assert_same_tables(ref, fused, what)
    want, got = ref.stats(), fused.stats()
    assert want.keys() == got.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-4 if key.endswith("per_layer") else 1e-7), key
    return seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_search_and_update_equal_torch(case):
    seen = _run(case)
    # the cases cover what their names say
    if case.startswith("decode_cap_binds") or case == "two_tokens":
        assert seen["capped"] > 0
    if case in ("decode_cap_free", "two_tokens_cap_free"):
        assert seen["capped"] == 0
    if case in ("some_heads_bypassed", "groups_bypassed"):
        assert seen["bypassed"] > 0 and seen["active"] > 0
    if case == "groups_bypassed":
        assert seen["groups_bypassed"] > 0
    if case == "k_beyond_candidates":
        assert seen["empty_slots"] > 0


def test_fused_search_with_tiny_blocks_and_the_select_kernel(monkeypatch):
    """Blocks of 16-64: several moment tiles, chunks and chosen-slot programs per row; the radix
    select's own kernels instead of torch.topk."""
    for case in ("decode_cap_binds", "two_tokens", "groups_bypassed"):
        _run(case, cfg=TINY, monkeypatch=monkeypatch, select_kernel=True)


@pytest.mark.parametrize("cfg", [dict(block_score=16, score_tiles=3),
                                 dict(score_mma=False, block_score=8, score_tiles=2)], ids=["mma", "cuda_cores"])
def test_fused_search_with_bf16_keys_and_score_knobs(cfg, monkeypatch):
    """bf16 keys through both logit paths of the score kernel (the tensor-core dot with the split
    query, and fp32 products), several programs per row and several tiles per program."""
    _run("bf16", cfg=lk.LfpsConfig(**cfg), monkeypatch=monkeypatch)


def _score(q, ck, cand, *, mma, block, tiles):
    """The score kernel's logits [rows, N, GP] (NaN where it wrote nothing), flags [rows, N] and its
    programs' softmax states [rows, P, 2, GP] for the candidate list cand [KVH, T, C]."""
    kvh, g, t, d = q.shape
    n, c, rows = ck.shape[1], cand.shape[-1], kvh * t
    gp, dp = lk._pow2(g, 2), lk._pow2(d, 16)
    logit = torch.full((rows, n, gp), float("nan"), device=q.device)
    flag = torch.zeros(rows, n, dtype=torch.int8, device=q.device)
    ps = lk._cdiv(c, block * tiles)
    states = torch.full((rows, ps, 2, gp), float("nan"), device=q.device)
    lk._score_kernel[(ps, rows)](
        q, ck, cand, logit, flag, states, t, n, c, q.stride(0), q.stride(1), q.stride(2), ck.stride(0), ck.stride(1),
        d ** -0.5, G=g, GP=gp, D=d, DP=dp, BR=block, TILES=tiles, MMA=mma, NQ=lk._pow2(3 * gp, 16), NUM_STAGES=1,
        INTERPRETED=lk.interpreted(), PRECISE=q.is_cuda)
    return logit, flag, states


@pytest.mark.parametrize("dtype,mma,block,tiles", [(torch.bfloat16, True, 16, 1), (torch.bfloat16, True, 32, 3),
                                                    (torch.bfloat16, False, 16, 2), (torch.float32, False, 8, 1)])
def test_score_kernel_logits_flags_and_states(dtype, mma, block, tiles):
    """The score kernel against float64 on a shuffled candidate list with empty slots: the candidates'
    logits q·k·scale to 2e-6 relative + 1e-5 (fp32 products, or exact bf16 products of the three-piece
    query summed in fp32 on tensor cores), -inf in the padded head column, nothing written elsewhere;
    the candidates' flags set and no other; each program's softmax state (max, sum of exp(x - max)
    per head) equal to that of its own slots' logits to 1e-5 relative (an empty program: max -1e30,
    sum 0). A permuted list gives bit-identical logits and flags, and states that merge into the same
    normaliser; the same list twice gives the same bits."""
    kvh, g, t, d, n, c = 2, 3, 2, 32, 300, 90
    gen = torch.Generator().manual_seed(7)
    q = (torch.randn(kvh, g, t, d, generator=gen) * 1.5).to(DEVICE)
    ck = torch.randn(kvh, n, d, generator=gen).to(dtype).to(DEVICE)
    cand = torch.stack([torch.randperm(n, generator=gen)[:c] for _ in range(kvh * t)]).view(kvh, t, c).int()
    cand[..., ::7] = -1  # empty slots anywhere
    cand[0, 0, :block * tiles] = -1  # one program with nothing to score
    cand = cand.to(DEVICE)
    logit, flag, states = _score(q, ck, cand, mma=mma, block=block, tiles=tiles)
    want = torch.einsum("hgtd,hnd->htng", q.double().cpu(), ck.double().cpu()) * d ** -0.5  # [KVH, T, N, G]
    got = logit.cpu().view(kvh, t, n, -1)
    on = torch.zeros(kvh * t, n, dtype=torch.bool)
    slots = cand.view(kvh * t, c).long().cpu()
    row = torch.arange(kvh * t)[:, None].expand_as(slots)
    on[row[slots >= 0], slots[slots >= 0]] = True
    assert torch.equal(flag.cpu().bool(), on)
    on = on.view(kvh, t, n)
    torch.testing.assert_close(got[..., :g][on].double(), want[on], rtol=2e-6, atol=1e-5)
    assert bool((got[..., g:][on] == float("-inf")).all()) and bool(got[~on].isnan().all())

    lg = logit.cpu().double()  # the states against the kernel's own logits, per program's slots
    per = block * tiles
    for r in range(kvh * t):
        for p in range(states.shape[1]):
            sl = slots[r, p * per:(p + 1) * per]
            x = lg[r, sl[sl >= 0], :g]  # [n_p, G]
            m, s = states[r, p, 0, :g].cpu().double(), states[r, p, 1, :g].cpu().double()
            if x.shape[0] == 0:
                assert bool((m == NEG_BIG).all()) and bool((s == 0).all())
                continue
            assert torch.equal(m, x.max(0).values)
            torch.testing.assert_close(s, torch.exp(x - m).sum(0), rtol=1e-5, atol=0)
    assert states[0, 0, 1].abs().sum() == 0  # the empty program

    def normaliser(st):
        m, s = st[:, :, 0, :g].double(), st[:, :, 1, :g].double()
        mx = m.max(1, keepdim=True).values
        return mx.squeeze(1), (s * torch.exp(m - mx)).sum(1)

    again = _score(q, ck, cand, mma=mma, block=block, tiles=tiles)
    assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip((logit, flag, states), again))
    perm = torch.randperm(c, generator=gen).to(DEVICE)
    logit2, flag2, states2 = _score(q, ck, cand[..., perm].contiguous(), mma=mma, block=block, tiles=tiles)
    assert torch.equal(logit.nan_to_num(), logit2.nan_to_num()) and torch.equal(flag, flag2)
    (m1, z1), (m2, z2) = normaliser(states.cpu()), normaliser(states2.cpu())
    assert torch.equal(m1, m2)
    torch.testing.assert_close(z1, z2, rtol=1e-5, atol=0)


def test_fused_path_is_deterministic():
    """Two planners with the same history: bit-identical plans (as sets), statistics and tables."""
    (kvh, g, d, n), params, ts, dtype = CASES["some_heads_bypassed"]
    m = get_method("lfps")
    p = m.Params(**params)
    index, cap = _index(3, kvh, g, d, n, p, dtype)
    ctx = DecodeContext(n, _spec(kvh, g, d), M_CAP)
    a, b = m.open(index, p, ctx), m.open(index, p, ctx)
    a.fused = b.fused = True
    for q, kv in _steps(3, kvh, g, d, n, ts, (cap.k[0], cap.v[0]), dtype):
        pa, pb = a.plan(0, q, kv), b.plan(0, q, kv)
        assert _rows(pa.positions) == _rows(pb.positions)
        assert torch.equal(pa.rest_logit, pb.rest_logit) and torch.equal(pa.bypass, pb.bypass)
        a.update(0, None, None, kv.q_pos)
        b.update(0, None, None, kv.q_pos)
        for x, y in zip(a._tables[0], b._tables[0]):
            assert torch.equal(x, y)
    assert a.stats() == b.stats()


def test_dense_question_steps_stay_on_torch():
    """A multi-token step with dense_prompt on is the question (`_prompt_search`): dense plan, torch
    update; the one-token steps after it take the fused path and agree with torch."""
    kvh, g, d, n = 2, 2, 16, 300
    m = get_method("lfps")
    p = m.Params()
    index, cap = _index(5, kvh, g, d, n, p)
    ctx = DecodeContext(n, _spec(kvh, g, d), M_CAP)
    ref, fused = m.open(index, p, ctx), m.open(index, p, ctx)
    ref.fused, fused.fused = False, True
    for i, (q, kv) in enumerate(_steps(5, kvh, g, d, n, [3, 1, 1], (cap.k[0], cap.v[0]))):
        want, got = ref.plan(0, q, kv), fused.plan(0, q, kv)
        assert want.is_dense == got.is_dense == (i == 0)
        if i:
            assert _rows(got.positions) == _rows(want.positions)
        ref.update(0, None, None, kv.q_pos)
        fused.update(0, None, None, kv.q_pos)
        _assert_same_tables(ref, fused, f"step {i}")


def test_unsupported_configurations_keep_the_torch_path(monkeypatch):
    kvh, g, d, n = 1, 2, 16, 200
    q = torch.zeros(kvh, g, 1, d, device=DEVICE)
    keys = torch.zeros(kvh, n, d, device=DEVICE)
    kv = KVView(keys, keys, keys[:, :4], keys[:, :4], torch.tensor([n], device=DEVICE))
    assert not lk.unsupported(q, kv)
    strided = torch.zeros(kvh, n, 2 * d, device=DEVICE)[..., ::2]
    assert lk.unsupported(q, KVView(strided, strided, keys[:, :4], keys[:, :4], kv.q_pos))
    monkeypatch.setenv("CTXCACHE_FUSED_LFPS", "0")
    assert lk.unsupported(q, kv)
    m = get_method("lfps")
    p = m.Params()
    index, cap = _index(1, kvh, g, d, n, p)
    planner = m.open(index, p, DecodeContext(n, _spec(kvh, g, d), M_CAP))
    planner.fused = True
    q, kv = next(_steps(1, kvh, g, d, n, [1], (cap.k[0], cap.v[0])))
    assert not isinstance(planner.search(0, q, kv).update, lk.FusedUpdate)


def test_fixed_point_sums_cannot_overflow():
    for k in (1, 2, 100, 6554, 1 << 20):
        assert k * 2.0 ** lk.fixed_point_shift(k) < 2.0 ** 63


@pytest.mark.gpu
def test_fused_step_makes_no_host_sync_and_replays_in_a_graph():
    """On CUDA, the fused plan + update runs under set_sync_debug_mode("error"), and a plan + update
    captured in a CUDA graph replays to the same positions and tables as the same step made eagerly
    by a twin planner with the same history."""
    kvh, g, d, n = 4, 4, 128, 8192
    m = get_method("lfps")
    p = m.Params()
    index, cap = _index(1, kvh, g, d, n, p, torch.bfloat16)
    ctx = DecodeContext(n, _spec(kvh, g, d), M_CAP)
    a, b = m.open(index, p, ctx), m.open(index, p, ctx)
    steps = list(_steps(2, kvh, g, d, n, [1] * 4, (cap.k[0], cap.v[0]), torch.bfloat16))
    for i, (q, kv) in enumerate(steps[:-1]):
        for planner, check in ((a, i > 0), (b, False)):  # the first step compiles and allocates
            torch.cuda.set_sync_debug_mode("error" if check else "default")
            try:
                planner.plan(0, q, kv)
                planner.update(0, None, None, kv.q_pos)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    q, kv = steps[-1]
    vert0, slash0 = (x.clone() for x in a._tables[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        a.plan(0, q, kv)  # warm up on the capture stream (its own workspaces); no update: tables unchanged
        a._pending.clear()
        with torch.cuda.graph(graph):
            got = a.plan(0, q, kv).positions
            a.update(0, None, None, kv.q_pos)
    torch.cuda.current_stream().wait_stream(side)
    for x, x0 in zip(a._tables[0], (vert0, slash0)):  # capturing ran nothing
        x.copy_(x0)
    graph.replay()
    want = b.plan(0, q, kv).positions
    b.fused = False  # and the torch path plans the same positions on the GPU (bf16 keys)
    assert _rows(b.search(0, q, kv).plan.positions) == _rows(want)
    b.fused = None
    b.update(0, None, None, kv.q_pos)
    torch.cuda.synchronize()
    assert _rows(got) == _rows(want)
    for x, y in zip(a._tables[0], b._tables[0]):
        assert torch.equal(x, y)
