"""The fused IVF plans (indexer/kernels/ivf.py) against the torch planners they replace on a GPU:
CTkvr (probe, dedup union, rerank, top-K, the FIFO push) and kivf (probe, CSR expansion, rerank,
top-K), run side by side over several decode steps on fresh random inputs.

On a machine without CUDA the kernels run through Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1; a planner runs them there when `planner.fused = True`),
so shapes stay small; on a GPU the same tests run on CUDA tensors, plus the sync-free / CUDA-graph
test at the end.

What "equal" means (the kernel module's docstring): every plan row holds the same set of positions
as the torch plan's row (the fused plan lists them in candidate order, the torch plan best first, so
rows are compared sorted), the FIFO rings hold the same entries (lists as sets, the pushed query up
to rounding of the normalisation, ~1 ulp) after the same number of pushes, and the probe-share
statistic is the same. Inputs are Gaussian (fp32: no ties among cosines or masses); in the bf16
cases the rounded cosines tie often, and the torch path gets torch.topk with CUDA's tie rule (lowest
index first, the kernel's rule), since the CPU torch.topk breaks ties in another order.
"""

from __future__ import annotations

import dataclasses
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from indexer.base import DecodeContext, IndexReader, KVView, PrefillCapture, get_method
from synthetic import decode_steps

ivf = pytest.importorskip("indexer.kernels.ivf", reason="triton is not installed")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = ivf.IvfConfig(block_c=16, block_u=16, chunks_per_prog=2, select_block=16, select_warps=4, wide_select_block=16,
                     wide_select_warps=4, eager_rows=False, probe_one_load=False)
# the default loads K rows before the dedup answers, TINY after; the default probe loads every head's
# centroid rows at once, TINY one head at a time


def _spec(kvh, g, d, layers=1):
    return SimpleNamespace(num_layers=layers, num_heads=kvh * g, num_kv_heads=kvh, head_dim=d, group_size=g)


def _capture(seed, kvh, g, d, n, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kvh * g, n, d, generator=gen) * 1.5
    k = torch.randn(1, kvh, n, d, generator=gen)
    v = torch.randn(1, kvh, n, d, generator=gen)
    return PrefillCapture(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), positions=torch.arange(n), spec=_spec(kvh, g, d))


def _reader(arrays):
    arrays = {k: v.to(DEVICE) for k, v in arrays.items()}
    return IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))


def _steps(seed, kvh, g, d, n, ts, m_cap=16, dtype=torch.float32, ctx=None):
    """Decode steps of a request: t query tokens per step (the last t of the request's m tokens)."""
    return decode_steps(seed, kvh, g, d, n, ts, ctx, DEVICE, m_cap=m_cap, dtype=dtype)


def _sorted_rows(pos):
    return pos.sort(dim=-1).values


def _assert_same_plan(fused, ref, what):
    assert fused.shape == ref.shape and fused.dtype == ref.dtype == torch.int32, what
    assert torch.equal(_sorted_rows(fused), _sorted_rows(ref)), f"{what}: fused plan differs from the torch plan"
    for row in fused.reshape(-1, fused.shape[-1]).tolist():  # valid first, then -1
        n_valid = sum(x >= 0 for x in row)
        assert all(x >= 0 for x in row[:n_valid]) and len(set(row[:n_valid])) == n_valid, what


def _assert_same_fifo(a, b, what):
    fa, fb = a.fifo[0], b.fifo[0]
    assert int(fa.pushes) == int(fb.pushes), what
    ulp = 1e-6 if fa.cent.dtype == torch.float32 else 2.0 ** -8  # the normalisation's rounding may differ by one ulp
    torch.testing.assert_close(fb.cent.float(), fa.cent.float(), atol=ulp, rtol=0, msg=what)
    assert torch.equal(_sorted_rows(fb.lists), _sorted_rows(fa.lists)), f"{what}: FIFO lists differ"


CTKVR_CASES = {
    # name: (capture: kvh, g, d, n; params; query tokens per step; dtype)
    "decode": ((2, 4, 32, 1000), dict(n_centroids=48, list_size=64, probe=4, k=100, fifo=4), [1, 1, 1, 1, 1]),
    "question_then_decode": ((2, 4, 32, 1000), dict(n_centroids=48, list_size=64, probe=4, k=100, fifo=8), [3, 1, 1]),
    "plan_wider_than_push": ((2, 4, 32, 1000), dict(n_centroids=48, list_size=40, probe=4, k=120, fifo=8), [1, 1, 1]),
    "no_fifo": ((2, 4, 32, 1000), dict(n_centroids=48, list_size=64, probe=3, k=50, fifo=0), [2, 1]),
    "k_beyond_candidates": ((2, 4, 32, 600), dict(n_centroids=40, list_size=50, probe=1, k=300, fifo=4,
                                                   window=200), [1, 1, 1]),
    "group_of_3_d64": ((2, 3, 64, 800), dict(n_centroids=40, list_size=48, probe=2, k=40, fifo=4), [1, 2, 1]),
    "frame_covers_everything": ((1, 4, 32, 300), dict(n_centroids=20, list_size=40, probe=2, k=30, fifo=4, sink=8,
                                                       window=400), [1, 1, 1]),
    # a probe rank from compares (probe <= 8: 7 of them here) and from the division (probe > 8), `_rank_of`
    "probe_7": ((2, 4, 32, 1000), dict(n_centroids=48, list_size=40, probe=7, k=100, fifo=4), [1, 1]),
    "probe_12": ((2, 4, 32, 1000), dict(n_centroids=48, list_size=32, probe=12, k=100, fifo=4), [1, 1]),
    # run with TINY blocks only
    "tiny_push_inside_plan": ((2, 4, 32, 400), dict(n_centroids=24, list_size=32, probe=3, k=20, fifo=2), [1, 2, 1, 1]),
    "tiny_plan_inside_push": ((2, 4, 32, 400), dict(n_centroids=24, list_size=32, probe=3, k=60, fifo=2), [1, 1, 1]),
}
TINY_CASES = ("tiny_push_inside_plan", "tiny_plan_inside_push")


def _run_ctkvr(case, *, seed, cfg=None, dtype=torch.float32, monkeypatch=None):
    (kvh, g, d, n), params, ts = CTKVR_CASES[case]
    if cfg is not None:
        monkeypatch.setattr(ivf, "DEFAULT_CONFIG", cfg)
    m = get_method("ctkvr")
    p = m.Params(**params)
    cap = _capture(seed, kvh, g, d, n, dtype)
    index = _reader(m.build(cap, p))
    ctx = DecodeContext(n, _spec(kvh, g, d), 16)
    ref, fused = m.open(index, p, ctx), m.open(index, p, ctx)
    ref.fused, fused.fused = False, True
    for i, (q, kv) in enumerate(_steps(seed, kvh, g, d, n, ts, dtype=dtype, ctx=(cap.k[0], cap.v[0]))):
        want = ref.plan(0, q, kv).positions
        got = fused.plan(0, q, kv).positions
        _assert_same_plan(got, want, f"{case} step {i}")
        if p.fifo:
            ref.update(0, None, None, kv.q_pos)
            fused.update(0, None, None, kv.q_pos)
            _assert_same_fifo(ref, fused, f"{case} step {i}")
    assert ref.stats() == pytest.approx(fused.stats(), rel=1e-6)
    return ref, fused


@pytest.mark.parametrize("case", sorted(set(CTKVR_CASES) - set(TINY_CASES)))
def test_ctkvr_fused_plan_equals_torch(case):
    ref, fused = _run_ctkvr(case, seed=zlib.crc32(case.encode()) % 1000)
    if case == "frame_covers_everything":  # nothing is selectable: every slot -1, pushes of empty lists
        assert (fused.fifo[0].lists[:, :3] == -1).all()
    if case == "decode":  # the ring wrapped and persisted centroids were evicted: the FIFO was recalled
        assert fused.stats()["fifo_probe_share"] > 0


def test_ctkvr_fused_plan_with_tiny_blocks(monkeypatch):
    """Blocks of 16: several probe blocks per row (the merge of their bests), several chunks per
    rerank program, and a select working set larger than a block, so the threshold search compacts
    its band (ping-pong), for the push and the plan sets alike."""
    for i, case in enumerate(TINY_CASES):
        _run_ctkvr(case, seed=5 + i, cfg=TINY, monkeypatch=monkeypatch)


# The plan's attention in the select launch (`ctkvr_plan(attend_scale=)`, asked by `KVView.attend_scale`)

# relative L2 against torch_ref over the plan's positions: fp32 measured ~3e-7 on the interpreter; bf16 at most
# ~5e-3 (its output and P rounded to bf16, as the triton backend's 3.6-3.8e-3 against float64)
ATTEND_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ATTEND_CFGS = {"default": ivf.IvfConfig(),  # on the interpreter: one plan program per row, beside the frame's
               "three_programs": ivf.IvfConfig(attend_block=16, attend_workers=3),  # chunks 0, 3, 6.. per program
               "tiny": dataclasses.replace(TINY, attend_block=16, attend_workers=2),
               "early": ivf.IvfConfig(attend_late=False)}  # on a GPU: the select lets the attention in after its keys


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("case, cfg_name, dtype", [
    ("decode", "default", torch.float32), ("decode", "three_programs", torch.float32),
    ("decode", "three_programs", torch.bfloat16), ("no_fifo", "three_programs", torch.float32),
    ("group_of_3_d64", "three_programs", torch.float32), ("k_beyond_candidates", "three_programs", torch.float32),
    ("frame_covers_everything", "default", torch.float32), ("tiny_plan_inside_push", "tiny", torch.float32),
    ("decode", "early", torch.bfloat16)])
def test_ctkvr_plan_attends_in_its_select(case, cfg_name, dtype, monkeypatch):
    """Asked for its attention, CTkvr's fused one-token plan returns the attention of q over the frame
    and its positions, as torch_ref computes it over the returned plan; the plan itself and the FIFO
    ring are those of the same planner not asked (exactly: the same select), a step of several tokens
    carries no attention, and the workspace's tickets and flags are reset by every plan (the steps reuse
    it). Cases: the FIFO push's select beside the plan's (2 select programs per row) or not, a group
    of 3 heads, fewer candidates than k (-1 slots), a frame covering the context (an empty plan: the
    frame's attention alone), several chunks per attention program."""
    from decoder.backends.torch_ref import TorchRef
    from indexer.base import Plan

    monkeypatch.setattr(ivf, "DEFAULT_CONFIG", ATTEND_CFGS[cfg_name])
    (kvh, g, d, n), params, ts = CTKVR_CASES[case]
    m = get_method("ctkvr")
    p = m.Params(**params)
    cap = _capture(zlib.crc32(case.encode()) % 1000, kvh, g, d, n, dtype)
    index = _reader(m.build(cap, p))
    ctx = DecodeContext(n, _spec(kvh, g, d), 16)
    asked, plain = m.open(index, p, ctx), m.open(index, p, ctx)
    asked.fused = plain.fused = True
    scale = d ** -0.5 * 0.9
    attended = 0
    for i, (q, kv) in enumerate(_steps(3, kvh, g, d, n, ts, dtype=dtype, ctx=(cap.k[0], cap.v[0]))):
        kv_a = dataclasses.replace(kv, attend_scale=scale)
        got, want = asked.plan(0, q, kv_a), plain.plan(0, q, kv)
        assert torch.equal(got.positions, want.positions), f"{case} step {i}: the plan changed"
        if q.shape[2] > 1:
            assert got.attended is None
        else:
            assert got.attended is not None and got.attended.serves(q, asked.sink, asked.window, scale)
            loc_k = torch.nan_to_num(kv.loc_k)  # torch_ref multiplies the invisible slots by 0: no NaN there
            ref = TorchRef().run(q, dataclasses.replace(kv, loc_k=loc_k), Plan(got.positions), asked.sink,
                                 asked.window, scale)
            err = _rel(got.attended.out, ref)
            assert got.attended.out.dtype == dtype and err < ATTEND_TOL[dtype], f"{case} step {i}: {err:.2e}"
            attended += 1
        if p.fifo:
            asked.update(0, None, None, kv.q_pos)
            plain.update(0, None, None, kv.q_pos)
            _assert_same_fifo(asked, plain, f"{case} step {i}")
    assert attended == ts.count(1)


def test_ctkvr_attends_only_where_it_can():
    """`attends`: CTkvr's plan computes its attention for one token with the values on the query's
    device in the keys' dtype, not for kivf, a step of several tokens, values behind a host tier's row
    cache, values in another dtype, chunks too large for the kernel's shared memory, or with
    `IvfConfig.attend` off (the backend then runs as usual)."""
    q1, q2 = torch.zeros(2, 4, 1, 32), torch.zeros(2, 4, 2, 32)
    k = torch.zeros(2, 10, 32)
    kv = KVView(k, k.clone(), k[:, :4], k[:, :4], torch.arange(10, 11))
    on = ivf.IvfConfig()
    assert ivf.attends(q1, kv, 0, on)
    assert not ivf.attends(q1, kv, 1, on)  # kivf
    assert not ivf.attends(q2, kv, 0, on)
    assert not ivf.attends(q1, dataclasses.replace(kv, v_cache=object()), 0, on)
    assert not ivf.attends(q1, dataclasses.replace(kv, ctx_v=k.half()), 0, on)
    assert not ivf.attends(q1, kv, 0, ivf.IvfConfig(attend=False))
    # chunks whose K and V tiles do not fit the kernel's shared memory: at D 128, 64 rows do, 128 do not (266 KB
    # asked on the H200, session 35); at D 32 the same bound lets 256 rows through
    q128 = torch.zeros(2, 4, 1, 128)
    k128 = torch.zeros(2, 10, 128)
    kv128 = KVView(k128, k128.clone(), k128[:, :4], k128[:, :4], torch.arange(10, 11))
    assert ivf.attends(q128, kv128, 0, ivf.IvfConfig(attend_block=64))
    assert not ivf.attends(q128, kv128, 0, ivf.IvfConfig(attend_block=128))
    assert ivf.attends(q1, kv, 0, ivf.IvfConfig(attend_block=256))


@pytest.mark.parametrize("fifo_blocks, loads_first", [(True, True), (True, False), (False, True)])
def test_ctkvr_probe_reads_the_fifo_table_per_block(fifo_blocks, loads_first, monkeypatch):
    """48 centroids in blocks of 16: every probe block is all persisted or all FIFO entries, so the
    probe picks its table per program (`probe_fifo_blocks`), not per element; the FIFO ring wraps and
    evicts persisted entries (case "decode"). Either order of the probe's loads (`probe_loads_first`)."""
    cfg = ivf.IvfConfig(block_c=16, probe_fifo_blocks=fifo_blocks, probe_loads_first=loads_first)
    for i, case in enumerate(("decode", "question_then_decode")):
        ref, fused = _run_ctkvr(case, seed=11 + i, cfg=cfg, monkeypatch=monkeypatch)
    assert fused.stats()["fifo_probe_share"] > 0  # FIFO entries were probed (and picked)


@pytest.mark.parametrize("chunk_lists, block_u, prefetch", [(True, 16, True), (True, 32, False), (False, 16, True)])
def test_ctkvr_rerank_reads_one_list_per_chunk(chunk_lists, block_u, prefetch, monkeypatch):
    """Lists of 64 in chunks of 16 or 32: every chunk's slots are items of one list, so the rerank
    picks its entry and table (persisted or FIFO) once per chunk (`rerank_chunk_lists`), with and
    without the next chunk's lists prefetched; the FIFO ring wraps, so chunks of FIFO lists are read
    (case "decode"; with chunks of 16 also a question step of 3 tokens, rows of their own lists). The
    same plans and FIFO as the torch planner's."""
    cfg = ivf.IvfConfig(block_u=block_u, rerank_chunk_lists=chunk_lists, rerank_prefetch=prefetch)
    cases = ("decode", "question_then_decode") if block_u == 16 and chunk_lists else ("decode",)  # (CI time)
    shares = [_run_ctkvr(case, seed=zlib.crc32(case.encode()) % 1000, cfg=cfg,  # seeds whose steps probe the FIFO
                         monkeypatch=monkeypatch)[1].stats()["fifo_probe_share"]
              for case in cases]
    assert shares[0] > 0  # FIFO entries were probed: chunks of FIFO lists were read


def test_rerank_loading_the_query_position_late_plans_the_same(monkeypatch):
    """`IvfConfig.rerank_loads_first`: the rerank's slot programs read the query position after their
    merge's and lists' loads (its frame program at its start). The window bound it gives decides which
    slots are selectable: cases where the frame excludes list positions, or all of them, and kivf's
    source, plan the torch path's sets."""
    cfg = ivf.IvfConfig(rerank_loads_first=True)
    for i, case in enumerate(("decode", "frame_covers_everything", "question_then_decode")):
        _run_ctkvr(case, seed=21 + i, cfg=cfg, monkeypatch=monkeypatch)
    _run_kivf("decode", seed=24, cfg=cfg, monkeypatch=monkeypatch)


def test_ctkvr_duplicates_are_counted_once():
    """Lists drawn from one small pool of positions: the union holds many duplicates (and each list
    several positions of the frame), the fused dedup must keep every position exactly once."""
    kvh, g, d, n, c, rho = 2, 4, 32, 500, 24, 32
    gen = torch.Generator().manual_seed(3)
    pool = torch.randperm(n, generator=gen)[:48]
    pool[:4] = torch.tensor([0, 1, n - 1, n - 2])  # sink and window positions: never selected
    lists = torch.stack([torch.stack([pool[torch.randperm(48, generator=gen)[:rho]] for _ in range(c)])
                         for _ in range(kvh)]).to(torch.int32)
    cent = F.normalize(torch.randn(kvh, c, g, d, generator=gen), dim=-1)
    arrays = {"centroids": cent[None], "lists": lists[None]}
    m = get_method("ctkvr")
    p = m.Params(n_centroids=c, list_size=rho, probe=4, k=60, fifo=2)
    ctx = DecodeContext(n, _spec(kvh, g, d), 16)
    ref, fused = m.open(_reader(arrays), p, ctx), m.open(_reader(arrays), p, ctx)
    ref.fused, fused.fused = False, True
    keys = torch.randn(kvh, n, d, generator=gen)
    for i, (q, kv) in enumerate(_steps(4, kvh, g, d, n, [1, 1, 1, 1], ctx=(keys, keys))):
        want, got = ref.plan(0, q, kv).positions, fused.plan(0, q, kv).positions
        _assert_same_plan(got, want, f"step {i}")
        assert ((got >= 0).sum(-1) <= 44).all()  # at most 48 pooled positions - 4 in the frame: fewer than k
        ref.update(0, None, None, kv.q_pos)
        fused.update(0, None, None, kv.q_pos)
        _assert_same_fifo(ref, fused, f"step {i}")


def _topk_lowest_index_first(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with CUDA's tie rule (its gather pass takes values equal to the k-th in index
    order); torch.topk on the CPU breaks ties in another, unspecified order."""
    v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


def test_ctkvr_bf16_with_probe_ties(monkeypatch):
    """bf16, structured data (tests/synthetic.py: queries and keys from one mixture, so centroids
    cluster): the probe's cosines, rounded to bf16 as the torch path's einsum output is, often tie at
    the P-th place (asserted below). The kernel takes the lowest entry id, as torch.topk does on
    CUDA, which the torch path is given here."""
    from synthetic import model_spec, structured_capture

    monkeypatch.setattr(torch, "topk", _topk_lowest_index_first)
    dots = []  # the rerank's choice of tensor-core logits (bf16 q and K: yes)
    real_dot = ivf._dot_logits
    monkeypatch.setattr(ivf, "_dot_logits", lambda *a: dots.append(real_dot(*a)) or dots[-1])
    kvh, g, d, n, steps = 2, 4, 64, 1000, 4
    spec = model_spec(1, kvh * g, kvh, d, 10000.0, "tiny")
    full = structured_capture(spec, n + steps, "cpu", seed=3, dtype=torch.bfloat16)
    cap = PrefillCapture(full.q[:, :, :n], full.k[:, :, :n], full.v[:, :, :n], full.positions[:n], spec)
    m = get_method("ctkvr")
    p = m.Params(n_centroids=64, list_size=48, probe=4, k=60, fifo=4)
    arrays = m.build(cap, p)
    ctx = DecodeContext(n, spec, 16)
    ref, fused = m.open(_reader(arrays), p, ctx), m.open(_reader(arrays), p, ctx)
    ref.fused, fused.fused = False, True
    ties = 0
    for s in range(steps):
        loc_k = torch.zeros(kvh, 16, d, dtype=torch.bfloat16)
        loc_k[:, :s + 1] = full.k[0, :, n:n + s + 1]
        q = full.q[0, :, n + s:n + s + 1].reshape(kvh, g, 1, d)
        kv = KVView(cap.k[0].to(DEVICE), cap.v[0].to(DEVICE), loc_k.to(DEVICE), loc_k.to(DEVICE),
                    torch.tensor([n + s], device=DEVICE))
        qn = F.normalize(q.float(), dim=-1).to(torch.bfloat16)
        cos = torch.einsum("hgtd,hcgd->htcg", qn, arrays["centroids"][0]).amax(-1).float()
        cos = cos.sort(-1, descending=True).values
        ties += int((cos[..., p.probe - 1] == cos[..., p.probe]).sum())
        q = q.to(DEVICE)
        _assert_same_plan(fused.plan(0, q, kv).positions, ref.plan(0, q, kv).positions, f"step {s}")
        ref.update(0, None, None, kv.q_pos)
        fused.update(0, None, None, kv.q_pos)
        _assert_same_fifo(ref, fused, f"step {s}")
    assert ties > 0, "no probe tie in this data: the test no longer checks the tie rule"
    assert dots and all(dots), "the bf16 plans no longer take the rerank's tensor-core logits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ctkvr_probe_ties_take_the_lowest_entry(dtype):
    """Entries 2 and 5 have the same centroid but different lists, and the query points at it: the
    two cosines are exactly equal, and the fused plan (probe 1) is entry 2's list, as torch.topk on
    CUDA would pick it (index order among equal values)."""
    kvh, g, d, n, c, rho = 1, 4, 32, 400, 8, 30
    gen = torch.Generator().manual_seed(1)
    cent = F.normalize(torch.randn(kvh, c, g, d, generator=gen), dim=-1)
    cent[:, 5] = cent[:, 2]
    lists = torch.stack([torch.randperm(n - 100, generator=gen)[:rho] + 50 for _ in range(c)])[None].to(torch.int32)
    arrays = {"centroids": cent.to(dtype)[None], "lists": lists[None]}
    m = get_method("ctkvr")
    p = m.Params(n_centroids=c, list_size=rho, probe=1, k=rho, fifo=0)
    planner = m.open(_reader(arrays), p, DecodeContext(n, _spec(kvh, g, d), 16))
    planner.fused = True
    q = (cent[:, 2, :, None, :] * 3.0).to(dtype).to(DEVICE)  # [KVH, G, 1, D]
    keys = torch.randn(kvh, n, d, generator=gen).to(dtype)
    kv = KVView(keys.to(DEVICE), keys.to(DEVICE), keys[:, :16].to(DEVICE), keys[:, :16].to(DEVICE),
                torch.tensor([n], device=DEVICE))
    got = planner.plan(0, q, kv).positions
    assert set(got[0, 0].tolist()) - {-1} == set(lists[0, 2].tolist())


KIVF_CASES = {
    "decode": ((2, 4, 32, 800), dict(n_clusters=24, nprobe=4, k=60), [1, 1]),
    "question": ((2, 3, 32, 600), dict(n_clusters=16, nprobe=3, k=40), [3, 1]),
    "every_cluster": ((2, 4, 32, 400), dict(n_clusters=10, nprobe=10, k=50), [1, 2]),  # exact top-K
    "k_beyond_candidates": ((2, 4, 32, 400), dict(n_clusters=12, nprobe=1, k=400), [1, 1]),
    "many_probes": ((1, 4, 32, 600), dict(n_clusters=120, nprobe=80, k=90), [1]),  # nprobe > 64 (128K: 290)
}


def _kivf_capture(seed, kvh, g, d, n):
    """Keys around 16 directions (clusterable), Gaussian queries."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(1, kvh, 16, d, generator=gen) * 3
    which = torch.randint(0, 16, (1, kvh, n), generator=gen)
    k = centers.gather(2, which[..., None].expand(-1, -1, -1, d)) + torch.randn(1, kvh, n, d, generator=gen)
    q, v = torch.randn(1, kvh * g, n, d, generator=gen), torch.randn(1, kvh, n, d, generator=gen)
    return PrefillCapture(q=q, k=k, v=v, positions=torch.arange(n), spec=_spec(kvh, g, d))


def _run_kivf(case, seed, cfg=None, monkeypatch=None):
    (kvh, g, d, n), params, ts = KIVF_CASES[case]
    if cfg is not None:
        monkeypatch.setattr(ivf, "DEFAULT_CONFIG", cfg)
    pytest.importorskip("faiss")
    m = get_method("kivf")
    p = m.Params(**params)
    cap = _kivf_capture(seed, kvh, g, d, n)
    index = _reader(m.build(cap, p))
    ctx = DecodeContext(n, _spec(kvh, g, d), 16)
    ref, fused = m.open(index, p, ctx), m.open(index, p, ctx)
    ref.fused, fused.fused = False, True
    for i, (q, kv) in enumerate(_steps(seed, kvh, g, d, n, ts, ctx=(cap.k[0], cap.v[0]))):
        _assert_same_plan(fused.plan(0, q, kv).positions, ref.plan(0, q, kv).positions, f"{case} step {i}")
    return fused


@pytest.mark.parametrize("case", sorted(KIVF_CASES))
def test_kivf_fused_plan_equals_torch(case):
    _run_kivf(case, seed=zlib.crc32(case.encode()) % 1000 + 1)


def test_kivf_fused_plan_with_tiny_blocks(monkeypatch):
    _run_kivf("question", seed=7, cfg=TINY, monkeypatch=monkeypatch)


@pytest.mark.parametrize("live", [False, True], ids=["all_slots", "live_prefix"])
@pytest.mark.parametrize("search", ["bisection", "sampled", "sampled_rows"])
@pytest.mark.parametrize("kp, rho", [(10, 24), (24, 10), (40, 5)])
def test_select_kernel_ties_take_the_lowest_slots(kp, rho, search, live):
    """The group-mass top-K on its own (kernel 3), with exact ties: every slot's logits come from 4
    classes (the same in both heads), so masses tie within a class. The plan row is the kp best
    valid slots, ties taken lowest slot first; the last token's row also gets the rho best (by a
    program of its own); -1 fills what the valid slots cannot. The plain search lists them in slot
    order; the sampled search (`ivf._select_sampled`) may list the same set in another order
    (sampled_rows: its counting pass with 4 consecutive keys per thread, `IvfConfig.count_rows`).
    live_prefix (kivf's N_ROW): a row's live slots are a prefix of its U (64, 37, 50 here); the slots
    past it hold what an earlier step left (valid positions, logits above every live one), which
    neither the mass pass nor the search nor the emit may read."""
    rows, g, u, block = 3, 2, 64, 16
    gen = torch.Generator().manual_seed(kp * 100 + rho)
    cls = torch.randint(0, 4, (rows, u), generator=gen)
    logits = (-cls.float())[:, None, :].expand(rows, g, u).contiguous()  # [rows, G, U]
    pos = torch.randperm(1000, generator=gen)[: rows * u].view(rows, u).to(torch.int32)
    pos[torch.rand(rows, u, generator=gen) < 0.3] = -1
    pos[2, :] = torch.where(torch.arange(u) < 6, pos[2, :], -1)  # a row with fewer valid slots than kp
    logits = logits.masked_fill((pos < 0)[:, None, :], float("-inf"))
    n_row = torch.tensor([u, 37, 50] if live else [u] * rows, dtype=torch.int32)
    is_live = torch.arange(u)[None, :] < n_row[:, None]  # [rows, U]
    m = logits.masked_fill(~is_live[:, None, :], float("-inf")).amax(-1)  # [rows, G]: one part, the live slots'
    lsum = torch.exp(logits - m[..., None]).masked_fill(~is_live[:, None, :], 0.0).sum(-1)
    ml = torch.stack([m, lsum], -1)[:, None].contiguous()  # [rows, 1, G, 2]
    stale = torch.randperm(1000, generator=gen)[: rows * u].view(rows, u).to(torch.int32) + 1000
    pos = torch.where(is_live, pos, stale)  # past the live prefix: valid-looking positions ...
    logits = torch.where(is_live[:, None, :], logits, torch.full_like(logits, 5.0))  # ... with the largest logits
    logits = logits.transpose(1, 2).contiguous()  # the rerank's layout: [rows, U, G]
    scr = torch.empty(rows, 2, 3 * u, dtype=torch.int32)
    out = torch.empty(rows, kp, dtype=torch.int32)
    push = torch.empty(rows, rho, dtype=torch.int32)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    t = 1  # every row is a last token's row (T = 1: one row per KV head)
    args = [d(logits), d(pos), d(ml), d(scr), d(out), d(push)]
    ivf._select_kernel[(rows, 2)](*args, args[1], d(n_row), args[1], t, u, 1, kp, rho, 3 * u, 1, 1, 1, G=g, G_PAD=g,
                                  BLOCK=block, BLOCK_S=32, HAS_PUSH=True, PRECISE=DEVICE == "cuda",
                                  SAMPLE=search != "bisection", HAS_N_ROW=live,
                                  SCAN_V=4 if search == "sampled_rows" else 1, num_warps=4)
    out, push = args[4].cpu(), args[5].cpu()
    for r in range(rows):
        ranked = sorted((int(cls[r, i]), i) for i in range(int(n_row[r])) if pos[r, i] >= 0)  # class asc = mass desc
        for got, k in ((out[r], kp), (push[r], rho)):
            want = [int(pos[r, i]) for _, i in ranked[:k]]
            if search != "bisection":
                assert sorted(got[: len(want)].tolist()) == sorted(want)
            else:
                assert got[: len(want)].tolist() == [x for x in pos[r].tolist() if x in set(want)]  # slot order
            assert (got[len(want):] == -1).all()


import triton  # noqa: E402 - after the importorskip above
import triton.language as tl  # noqa: E402


@triton.jit
def _threshold_probe(KEYS, SCR, OUT, n, K, BLOCK: tl.constexpr, IN_REGS: tl.constexpr):
    """Row r: (thr, take) of the top-K of KEYS[r, :n] (ints > 0 valid, 0 empty) -> OUT[r, 0:2], by
    the register search (IN_REGS, n <= BLOCK) or the scratch search with its L2 passes."""
    r = tl.program_id(0)
    ar = tl.arange(0, BLOCK)
    row = SCR + r * 3 * n
    n_valid = n * 0
    key_min = n * 0 + 2147483647
    key_max = n * 0
    for c0 in range(0, n, BLOCK):
        key = tl.load(KEYS + r * n + c0 + ar, mask=c0 + ar < n, other=0)
        tl.store(row + c0 + ar, key, mask=c0 + ar < n)
        n_valid += tl.sum((key > 0).to(tl.int32), 0)
        key_min = tl.minimum(key_min, tl.min(tl.where(key > 0, key, 2147483647), 0))
        key_max = tl.maximum(key_max, tl.max(key, 0))
    tl.debug_barrier()
    if IN_REGS:
        keys = tl.load(KEYS + r * n + ar, mask=ar < n, other=0)
        thr, take = ivf._top_threshold_regs(keys, n, K, key_min, n_valid, key_max + 1)
    else:
        thr, take = ivf._top_threshold(row, n, K, key_min, n_valid, key_max + 1, BLOCK)
    tl.store(OUT + r * 2, thr)
    tl.store(OUT + r * 2 + 1, take)


@pytest.mark.parametrize("in_regs", [True, False], ids=["registers", "scratch"])
def test_threshold_search_selects_the_top_k(in_regs):
    """The threshold search (`ivf._kth_largest` with its compacting L2 passes, `_bisect_regs` in
    registers) selects exactly the K largest keys, ties taken lowest index first: rows with many ties
    (keys from 5 values), with keys spread over 30 bits, with empty slots, with fewer valid keys than
    K, with K at an exact split (the K-th and K+1-th keys differ), all keys equal."""
    rows, n, k = 6, 256 if not in_regs else 64, 20
    block = n if in_regs else 16
    gen = torch.Generator().manual_seed(7 + in_regs)
    keys = torch.randint(1, 1 << 30, (rows, n), generator=gen, dtype=torch.int64)
    keys[0] = torch.randint(1, 6, (n,), generator=gen)  # ties
    keys[1] = keys[1] >> torch.randint(0, 29, (n,), generator=gen)  # spread over many magnitudes
    keys[2, torch.rand(n, generator=gen) < 0.5] = 0  # empty slots
    keys[3, k // 2:] = 0  # fewer valid keys than K
    keys[4] = torch.arange(n, 0, -1)  # distinct: the K-th and the K+1-th differ (an exact split)
    keys[5] = 7  # all equal
    keys = keys.to(torch.int32)
    scr = torch.zeros(rows, 3 * n, dtype=torch.int32)
    out = torch.zeros(rows, 2, dtype=torch.int32)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    args = [d(keys), d(scr), d(out)]
    _threshold_probe[(rows,)](*args, n, k, BLOCK=block, IN_REGS=in_regs, num_warps=4)
    _check_thresholds(keys, args[2].cpu(), k)


def _check_thresholds(keys, got, k):
    for r in range(keys.shape[0]):
        thr, take = int(got[r, 0]), int(got[r, 1])
        row = keys[r].tolist()
        eq = [i for i, x in enumerate(row) if x == thr]
        chosen = {i for i, x in enumerate(row) if x > thr and x > 0} | {i for i in eq[:take] if row[i] > 0}  # 0: empty
        ranked = sorted((-x, i) for i, x in enumerate(row) if x > 0)[:k]
        assert chosen == {i for _, i in ranked}, (r, thr, take)


@triton.jit
def _picks_probe(V, I, OUT_V, OUT_I, n, P: tl.constexpr, BLOCK: tl.constexpr):
    """Row r: P picks (`ivf._entry_key`, `ivf._pick_next`) over (V[r, :n], I[r, :n]) -> OUT_V/OUT_I[r, :P]."""
    r = tl.program_id(0)
    ar = tl.arange(0, BLOCK)
    v = tl.load(V + r * n + ar, mask=ar < n, other=float("-inf"))
    i = tl.load(I + r * n + ar, mask=ar < n, other=2147483647)
    key = ivf._entry_key(v, i)
    prev = tl.full([], 9223372036854775807, tl.int64)
    for j in tl.static_range(P):
        prev, pv, pi = ivf._pick_next(key, prev)
        tl.store(OUT_V + r * P + j, pv)
        tl.store(OUT_I + r * P + j, pi)


def _picks_reference(vals, ids, p):
    """The picks' order, as the probe's float compares define it: value desc, then id asc; a NaN is
    never picked; -0.0 equals 0.0; (-inf, INT_MAX) once nothing is left."""
    order = sorted(((v, i) for v, i in zip(vals, ids) if v == v), key=lambda e: (-e[0], e[1]))
    order += [(float("-inf"), 2147483647)] * p
    return order[:p]


def test_probe_picks_order_value_then_lowest_id():
    """A pick is one int64 max over (value, id) packed in one key: the same picks as comparing the
    floats and then the ids. Rows: ties (the lowest id first), -0.0 tied with 0.0, -inf entries (an
    evicted FIFO entry: picked after every finite one, lowest id first), NaN (never picked), fewer
    entries than picks, negative values, ids up to INT_MAX - 1, +inf."""
    n, p = 8, 6
    inf, nan = float("inf"), float("nan")
    rows = [
        ([0.5, 0.25, 0.5, -0.125, 0.5, 0.25, -1.0, 0.0], [7, 3, 2, 9, 5, 1, 4, 0]),
        ([0.0, -0.0, -0.0, 0.0, -0.5, -0.25, -0.5, -1.0], [6, 2, 5, 4, 1, 0, 3, 7]),
        ([-inf, 0.125, -inf, -inf, 0.125, -2.0, -inf, -inf], [5, 8, 1, 3, 2, 0, 9, 4]),
        ([nan, 0.75, nan, -inf, 0.75, nan, 0.5, nan], [0, 6, 1, 2, 3, 4, 5, 7]),
        ([nan, nan, 0.5, nan, -inf, nan, nan, nan], [0, 1, 2, 3, 4, 5, 6, 7]),
        ([inf, 3.0e38, -3.0e38, 1e-45, -1e-45, inf, 0.0, 2.0], [2147483646, 0, 1, 2, 3, 5, 6, 2147483000]),
    ]
    vals = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    ids = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    out_v = torch.zeros(len(rows), p, dtype=torch.float32)
    out_i = torch.zeros(len(rows), p, dtype=torch.int32)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    args = [d(vals), d(ids), d(out_v), d(out_i)]
    _picks_probe[(len(rows),)](*args, n, P=p, BLOCK=n)
    got_v, got_i = args[2].cpu(), args[3].cpu()
    for r, (v, i) in enumerate(rows):
        want = _picks_reference(vals[r].tolist(), i, p)  # the float32 values the kernel saw
        got = list(zip(got_v[r].tolist(), got_i[r].tolist()))
        assert [e[1] for e in got] == [e[1] for e in want], r
        assert [e[0] for e in got] == [e[0] for e in want], r  # -0.0 == 0.0 here: the rows agree as floats


@triton.jit
def _sampled_select_probe(KEYS, POSS, SCR, OUT, PATH, n, K, KS, BLOCK: tl.constexpr, SCAN_V: tl.constexpr):
    """Row r: `ivf._select_sampled` over KEYS[r, :n] with positions POSS[r, :n] -> OUT[r, :K], and
    the path it took -> PATH[r]."""
    r = tl.program_id(0)
    ar = tl.arange(0, BLOCK)
    row = SCR + r * 3 * n
    n_valid = n * 0
    for c0 in range(0, n, BLOCK):
        key = tl.load(KEYS + r * n + c0 + ar, mask=c0 + ar < n, other=0)
        tl.store(row + c0 + ar, key, mask=c0 + ar < n)
        n_valid += tl.sum((key > 0).to(tl.int32), 0)
    tl.debug_barrier()
    path = ivf._select_sampled(row, POSS + r * n, n, K, n * 0 + 1, n_valid, n * 0 + 0x7F800002, OUT + r * K,
                               BLOCK, SCAN_V, KS)
    tl.store(PATH + r, path)


@pytest.mark.parametrize("n, scan_v", [(2048, 1), (2048, 8), (1999, 4)])
def test_sampled_select_writes_the_top_k_positions_on_every_path(n, scan_v):
    """`ivf._select_sampled` (the select kernel's search bracketed from a strided sample, every 4th key
    here, with the emit fused into its counting pass) writes exactly the positions of the K largest
    keys, ties taken lowest index first, -1 after, on each of its paths: the band holds the K-th key
    and fits a block (ordinary keys, empty slots, ties across the K-th place); the band holds it but
    is larger than a block (a run of 700 equal keys); the counts refute the sample's guess on either
    side (the sample holds the row's largest or its smallest keys: the search goes on above b or
    below a, and the plain emit overwrites what the counting pass wrote); no search needed (exactly
    K or fewer valid keys). scan_v: consecutive keys per thread in the counting pass
    (`IvfConfig.count_rows`), whose scan order decides which of the tied keys the band takes; 1999
    keys end in a partial row."""
    rows, k, block = 9, 400, 512
    gen = torch.Generator().manual_seed(13)
    keys = torch.randperm(1 << 20, generator=gen)[: rows * n].view(rows, n).to(torch.int64) + 1  # distinct
    sampled = torch.arange(block) * n // block
    rest = torch.ones(n, dtype=torch.bool)
    rest[sampled] = False
    srt = torch.sort(keys[1], descending=True).values
    keys[1, sampled], keys[1, rest] = srt[:block], srt[block:]  # the sample holds the row's largest keys
    srt = torch.sort(keys[2]).values
    keys[2, sampled], keys[2, rest] = srt[:block], srt[block:]  # ... its smallest
    keys[3] = torch.randint(1, 200, (n,), generator=gen)  # ties everywhere
    keys[4, torch.rand(n, generator=gen) < 0.6] = 0  # empty slots
    keys[5, torch.randperm(n, generator=gen)[: n - k]] = 0  # exactly K valid keys
    keys[6, k // 2:] = 0  # fewer valid keys than K
    kth = int(torch.sort(keys[7], descending=True).values[k])
    keys[7, (keys[7] >= kth - 30000) & (keys[7] <= kth + 30000)] = kth  # a run of ties across the K-th place
    order = torch.argsort(keys[8], descending=True)
    keys[8, order[k - 350: k + 350]] = int(keys[8, order[k]])  # 700 ties around the K-th place: a wide band
    keys = keys.to(torch.int32)
    poss = torch.randperm(1 << 20, generator=gen)[: rows * n].view(rows, n).to(torch.int32)
    d = lambda x: x.to(DEVICE)  # noqa: E731
    zeros = lambda *shape: d(torch.zeros(*shape, dtype=torch.int32))  # noqa: E731
    args = [d(keys), d(poss), zeros(rows, 3 * n), zeros(rows, k), zeros(rows)]
    _sampled_select_probe[(rows,)](*args, n, k, 1, BLOCK=block, SCAN_V=scan_v, num_warps=4)
    out, path = args[3].cpu(), args[4].cpu().tolist()
    for r in range(rows):
        row = keys[r].tolist()
        ranked = sorted((-x, i) for i, x in enumerate(row) if x > 0)[:k]
        want = sorted(int(poss[r, i]) for _, i in ranked)
        got = out[r].tolist()
        assert sorted(got[: len(want)]) == want, r
        assert all(x == -1 for x in got[len(want):]), r
    assert path[0] == path[4] == path[7] == 1  # the band held the K-th key (ties across it in row 7)
    assert path[8] == 2  # ... but more keys than a block
    assert path[1] == path[2] == 3  # a misleading sample, refuted
    assert path[5] == path[6] == 0  # no search needed


def test_wide_rows_take_the_wide_select():
    """The select's block and warps follow the row's width (shapes only): rows of at least
    `wide_select_from` candidate slots take the wide block (kivf at 128K), narrower ones the default
    (CTkvr's 10,240; kivf at 32K), and a block is never wider than the row's next power of two."""
    cfg = ivf.IvfConfig()
    assert ivf._select_shape(10_240, cfg) == (cfg.select_block, cfg.select_warps)
    assert ivf._select_shape(cfg.wide_select_from - 1, cfg) == (cfg.select_block, cfg.select_warps)
    assert ivf._select_shape(cfg.wide_select_from, cfg) == (cfg.wide_select_block, cfg.wide_select_warps)
    assert ivf._select_shape(40_000, cfg) == (4096, 16)
    assert ivf._select_shape(100, cfg) == (128, cfg.select_warps)
    small = ivf.IvfConfig(wide_select_from=64, wide_select_block=1 << 20, wide_select_warps=2)
    assert ivf._select_shape(100, small) == (128, 2)


def test_unsupported_configurations_keep_the_torch_path():
    q = torch.zeros(1, 2, 1, 48, device=DEVICE)
    assert ivf.unsupported(q)  # head_dim 48
    q = torch.zeros(1, 2, 1, 64, device=DEVICE)
    assert not ivf.unsupported(q, ctkvr_probe=4, entries=2112)
    assert ivf.unsupported(q, ctkvr_probe=ivf.MAX_PROBE + 1, entries=4096)


def test_environment_switch_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv("CTXCACHE_FUSED_IVF", "0")
    assert ivf.unsupported(torch.zeros(1, 2, 1, 64, device=DEVICE))
    called = []
    monkeypatch.setattr(ivf, "ctkvr_plan", lambda *a, **k: called.append(1))
    (kvh, g, d, n), params, _ = CTKVR_CASES["no_fifo"]
    m = get_method("ctkvr")
    p = m.Params(**params)
    cap = _capture(0, kvh, g, d, n)
    planner = m.open(_reader(m.build(cap, p)), p, DecodeContext(n, _spec(kvh, g, d), 16))
    planner.fused = True
    q, kv = next(_steps(0, kvh, g, d, n, [1], ctx=(cap.k[0], cap.v[0])))
    assert planner.plan(0, q, kv).positions.shape[-1] == 50 and not called


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ctkvr", "kivf"])
def test_fused_plans_make_no_host_sync_and_replay_in_a_graph(name):
    """On CUDA, the fused plan (and CTkvr's fused update) runs under set_sync_debug_mode("error"),
    and a plan captured in a CUDA graph replays to the same positions as the same plan made eagerly
    by a twin planner with the same history."""
    kvh, g, d, n = 4, 4, 128, 4096
    if name == "kivf":
        pytest.importorskip("faiss")
    m = get_method(name)
    params = m.Params(k=256, list_size=512) if name == "ctkvr" else m.Params(ratio=0.05)
    # fp32: the last check compares with the torch path on the GPU, which bf16 probe ties could upset
    cap = _capture(1, kvh, g, d, n) if name == "ctkvr" else _kivf_capture(1, kvh, g, d, n)
    index = _reader(m.build(cap, params))
    ctx = DecodeContext(n, _spec(kvh, g, d), 16)
    a, b = m.open(index, params, ctx), m.open(index, params, ctx)
    steps = list(_steps(2, kvh, g, d, n, [1] * 4, dtype=cap.k.dtype, ctx=(cap.k[0], cap.v[0])))
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        a.plan(0, q, kv)  # warm up on the capture stream (its own workspace)
        with torch.cuda.graph(graph):
            got = a.plan(0, q, kv).positions
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    want = b.plan(0, q, kv).positions
    torch.cuda.synchronize()
    assert torch.equal(_sorted_rows(got), _sorted_rows(want))
    if name == "ctkvr":  # asked for its attention (the select launch's waiting programs), replayed: the same bits
        kv_a = dataclasses.replace(kv, attend_scale=d ** -0.5)
        graph_a = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            a.plan(0, q, kv_a)
            with torch.cuda.graph(graph_a):
                got_a = a.plan(0, q, kv_a).attended.out
        torch.cuda.current_stream().wait_stream(side)
        graph_a.replay()
        want_a = b.plan(0, q, kv_a).attended.out
        torch.cuda.synchronize()
        assert torch.equal(got_a, want_a)
    b.fused = False  # and the torch path plans the same positions on the GPU
    assert torch.equal(_sorted_rows(want), _sorted_rows(b.plan(0, q, kv).positions))
