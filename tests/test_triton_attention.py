"""The triton backend (`decoder/backends/triton.py`, kernels in `decoder/kernels/attention.py`)
against `torch_ref` and against a float64 reference: dense attention masked to the frame ∪ plan
token set (`frame_mask`), on random inputs (a fresh seed per case).

On a machine without CUDA the kernels run through Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay small; on a GPU the same tests run on
CUDA tensors, plus the sync-free / CUDA-graph test at the end.

Tolerances (relative L2 error against float64): fp32 1e-5 (the kernels use ieee fp32 dots, no
tf32), fp16 5e-3, bf16 1e-2 (fp32 softmax and accumulation; P rounded to the input dtype before
P·V, as flash attention does; worst measured over these shapes in the interpreter: 3.8e-3 bf16,
3.2e-4 fp16, 2e-7 fp32; torch_ref 2.3e-3 / 3.2e-4 / 2e-7).
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from decoder.backends import backend_names, frame_mask, get_backend

kernels = pytest.importorskip("decoder.kernels.attention", reason="triton is not installed")
from decoder.backends.triton import TritonAttention  # noqa: E402
from indexer.base import BlockList, KVView, Plan  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
SMALL = kernels.KernelConfig(block_n=16, splits=3)  # chunks straddle the segments, several splits


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _inputs(seed, kvh=2, g=3, t=1, d=16, n=96, m_cap=8, m=4, k=12, dtype=torch.float32, garbage=0.0):
    """A step of t query tokens; the request holds m tokens (the last t are the step's) in a buffer of
    m_cap slots; slots m.. hold `garbage`. Plan rows: distinct positions, ~20 % -1, and each row
    starts with a sink position (0) and a window position (n - 1) when k >= 2 (the kernel skips both:
    the frame covers them)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    loc_k, loc_v = r(kvh, m_cap, d), r(kvh, m_cap, d)
    loc_k[:, m:], loc_v[:, m:] = garbage, garbage
    q_pos = n + m - t + torch.arange(t)
    kv = KVView(r(kvh, n, d), r(kvh, n, d), loc_k, loc_v, q_pos)
    rows = []
    for _ in range(kvh * t):
        rest = torch.randperm(n - 2, generator=gen)[: max(k - 2, 0)] + 1
        rows.append(torch.cat([torch.tensor([0, n - 1]), rest])[:k] if k >= 2 else rest[:k])
    pos = torch.stack(rows).view(kvh, t, k) if k else torch.zeros(kvh, t, 0, dtype=torch.long)
    pos = torch.where(torch.rand(kvh, t, k, generator=gen) < 0.2, -1, pos).to(torch.int32)
    return r(kvh, g, t, d), kv, pos


def _to(dev, q, kv: KVView, plan: Plan):
    kv = KVView(*(x.to(dev) for x in (kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos)))
    f = lambda x: None if x is None else x.to(dev)  # noqa: E731
    return q.to(dev), kv, Plan(f(plan.positions), f(plan.bypass), f(plan.rest_logit), f(plan.rest_value),
                               f(plan.lengths))


def _reference(q, kv: KVView, plan: Plan, sink, window, scale, m_used=None):
    """float64 attention over [ctx; loc] restricted to frame_mask (+ the pseudo-token). Local slots
    from m_used on are zeroed first (they may hold garbage that no query sees)."""
    g = q.shape[1]
    mask = frame_mask(plan, kv, sink, window, g)
    loc_k, loc_v = kv.loc_k.double().clone(), kv.loc_v.double().clone()
    if m_used is not None:
        loc_k[:, m_used:], loc_v[:, m_used:] = 0, 0
    k = torch.cat([kv.ctx_k.double(), loc_k], 1)
    v = torch.cat([kv.ctx_v.double(), loc_v], 1)
    s = torch.einsum("hgtd,hnd->hgtn", q.double(), k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    if plan.rest_logit is None or plan.is_dense:
        return torch.einsum("hgtn,hnd->hgtd", torch.softmax(s, -1), v)
    s = torch.cat([s, plan.rest_logit.double()[..., None]], -1)
    p = torch.softmax(s, -1)
    out = torch.einsum("hgtn,hnd->hgtd", p[..., :-1], v)
    return out + p[..., -1:] * plan.rest_value.double()[:, None, None, :]


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def _check(q, kv, plan, sink, window, scale, cfg=kernels.KernelConfig(), m_used=None):
    """Run the triton backend on DEVICE; compare with float64 and with torch_ref."""
    qd, kvd, pland = _to(DEVICE, q, kv, plan)
    out = TritonAttention(cfg).run(qd, kvd, pland, sink, window, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == qd.device
    assert torch.isfinite(out).all()
    ref = _reference(q, kv, plan, sink, window, scale, m_used)
    err = _rel(out.cpu(), ref)
    assert err < TOL[q.dtype], err
    if m_used is None:  # torch_ref multiplies garbage by 0 too (NaN stays NaN): compare on clean inputs
        want = get_backend("torch_ref").run(qd, kvd, pland, sink, window, scale)
        tol = TOL[q.dtype] if q.dtype == torch.float32 else 2 * TOL[q.dtype]  # both are rounded
        assert _rel(out.cpu(), want.cpu().double()) < tol
    return out


# (kvh, g, t, d, n, m_cap, m, k, sink, window)
SHAPES = [
    (2, 3, 1, 16, 96, 8, 4, 12, 4, 8),  # SmolLM2's group of 3
    (1, 4, 3, 16, 80, 8, 5, 10, 4, 8),  # 3 tokens, each with its own plan row
    (3, 1, 1, 64, 64, 4, 1, 9, 2, 4),  # MHA, head_dim 64
    (2, 4, 1, 128, 70, 6, 2, 7, 4, 16),  # Llama's head_dim
    (1, 3, 3, 64, 50, 6, 6, 0, 4, 8),  # K = 0 (streaming), the request fills its buffer
    (2, 4, 3, 16, 40, 8, 3, 30, 0, 0),  # no sink, no window
    (1, 1, 1, 32, 30, 4, 2, 5, 4, 64),  # window longer than the context
    (1, 2, 1, 256, 40, 4, 2, 6, 4, 8),  # the largest head_dim supported
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kvh{}-g{}-t{}-d{}-n{}-m{}of{}-k{}-s{}-w{}".format(*s))
def test_sparse_plan_matches_references(shape, dtype):
    kvh, g, t, d, n, m_cap, m, k, sink, window = shape
    q, kv, pos = _inputs(_seed(shape, dtype), kvh, g, t, d, n, m_cap, m, k, dtype)
    _check(q, kv, Plan(pos), sink, window, d ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "kvh{}-g{}-t{}-d{}".format(*s[:4]))
def test_small_chunks_and_forced_splits(shape, dtype):
    """Chunks of 16 rows straddle the sink/window/plan/local boundaries; 3 splits per block, merged
    by the second kernel (the small default shapes above mostly take the one-split path)."""
    kvh, g, t, d, n, m_cap, m, k, sink, window = shape
    q, kv, pos = _inputs(_seed("small", shape, dtype), kvh, g, t, d, n, m_cap, m, k, dtype)
    _check(q, kv, Plan(pos), sink, window, 0.3, cfg=SMALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [kernels.KernelConfig(), SMALL, kernels.KernelConfig(block_n=16, splits=7)],
                         ids=["default", "small", "7splits"])
@pytest.mark.parametrize("kvh,g,t", [(4, 3, 1), (1, 16, 2)], ids=["decode-step", "one-token-blocks"])
def test_plan_lengths_divide_only_the_filled_slots(kvh, g, t, dtype, cfg):
    """Rows valid-first with a -1 tail (`Plan.lengths`: empty, short, full rows): the splits share
    the filled slots only, and the output is the references' (frame ∪ plan, lengths change nothing).
    A length that cuts into a row's positions drops them: the kernel reads lengths (one token per
    query block: a decode step, or a group of 16 heads)."""
    d, n, k, sink, window = 16, 300, 96, 4, 8
    q, kv, pos = _inputs(_seed("lengths", kvh, g, t, dtype, cfg), kvh, g, t, d, n, 8, 4, k, dtype)
    lengths = torch.tensor([0, 17, k, 40, 1, 63, 96, 5][: kvh * t], dtype=torch.int32).view(kvh, t)
    slot = torch.arange(k)
    pos = torch.where(slot < lengths[..., None].long(), pos, -1)
    out = _check(q, kv, Plan(pos, lengths=lengths), sink, window, 0.2, cfg=cfg)
    qd, kvd, pland = _to(DEVICE, q, kv, Plan(pos))
    without = TritonAttention(cfg).run(qd, kvd, pland, sink, window, 0.2)
    assert _rel(out.cpu(), without.cpu().double()) < TOL[dtype]
    cut = lengths // 2
    qd, kvd, pland = _to(DEVICE, q, kv, Plan(pos, lengths=cut))
    got = TritonAttention(cfg).run(qd, kvd, pland, sink, window, 0.2)
    want = _reference(q, kv, Plan(torch.where(slot < cut[..., None].long(), pos, -1)), sink, window, 0.2)
    assert _rel(got.cpu(), want) < TOL[dtype]
    assert _rel(got.cpu(), _reference(q, kv, Plan(pos), sink, window, 0.2)) > 10 * TOL[dtype]


def _block_plan(seed, kvh, t, n, bs, sink, window, q_pos, dev):
    """A psa-like block list: per row the F = 2 dense-part ids (block 0 and the last block: their tokens in
    the sink or window are the frame's), then distinct random blocks in block order with ~20 % of them
    -1, and a -1 tail past `lengths` (a row may be empty). Ids in the frame and partial last blocks."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-n // bs)
    slots = max(2, nb // 2)
    ids = torch.full((kvh, t, 2 + slots), -1, dtype=torch.int32)
    lengths = torch.zeros(kvh, t, dtype=torch.int32)
    for h in range(kvh):
        for i in range(t):
            cnt = int(torch.randint(0, slots + 1, (1,), generator=gen)) if (h + i) % 3 else slots
            blocks = torch.randperm(nb - 2, generator=gen)[:cnt].sort().values + 1
            blocks = torch.where(torch.rand(cnt, generator=gen) < 0.2, -1, blocks)
            ids[h, i, :2 + cnt] = torch.cat([torch.tensor([0, nb - 1]), blocks]).to(torch.int32)
            lengths[h, i] = (2 + cnt) * bs
    return Plan(BlockList(ids.to(dev), bs, q_pos.to(dev), n, sink, window), lengths=lengths.to(dev))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [kernels.KernelConfig(), SMALL], ids=["default", "small"])
@pytest.mark.parametrize("kvh,g,t,bs", [(2, 3, 1, 8), (2, 4, 1, 16), (1, 4, 3, 8), (2, 3, 1, 12)],
                         ids=["step-bs8", "step-bs16", "t3-bs8", "step-bs12"])
def test_block_lists_read_as_ids_equal_their_positions(kvh, g, t, bs, dtype, cfg, monkeypatch):
    """A plan given as a block list (`BlockList`, psa's budget plan on a GPU): the split kernel reads its
    ids and expands them itself (`block_size`), with the bits of the run over the expanded positions
    (the same rows in the same order, the same masks), and the references' output. The backend reads
    ids only for the frame the list was made for, and not with `block_ids=0`."""
    d, n, m, sink, window = 16, 203, 4, 4, 8
    q, kv, _ = _inputs(_seed("blocks", kvh, g, t, bs, dtype, cfg), kvh, g, t, d, n, 8, m, 0, dtype)
    qd, kvd, _ = _to(DEVICE, q, kv, Plan.dense())
    plan = _block_plan(_seed("ids", kvh, t, bs), kvh, t, n, bs, sink, window, kvd.q_pos, DEVICE)
    blocks = plan.blocks
    assert (blocks.positions >= 0).any() and (blocks.positions == -1).any()
    args = (qd, kvd.ctx_k, kvd.ctx_v, kvd.loc_k, kvd.loc_v, kvd.q_pos)
    by_ids = kernels.frame_attention(*args, blocks.ids, sink, window, 0.3, lengths=plan.lengths, cfg=cfg,
                                     block_size=bs)
    by_pos = kernels.frame_attention(*args, blocks.positions, sink, window, 0.3, lengths=plan.lengths, cfg=cfg)
    assert torch.equal(by_ids, by_pos)
    ref = _reference(q, kv, Plan(blocks.positions.cpu()), sink, window, 0.3)
    assert _rel(by_ids.cpu(), ref) < TOL[dtype]
    want = get_backend("torch_ref").run(qd, kvd, plan, sink, window, 0.3)
    assert _rel(by_ids.cpu(), want.cpu().double()) < (TOL[dtype] if dtype == torch.float32 else 2 * TOL[dtype])

    seen = []
    run = kernels.frame_attention
    monkeypatch.setattr(kernels, "frame_attention", lambda *a, **k: seen.append(k["block_size"]) or run(*a, **k))
    for backend, win in ((TritonAttention(cfg), window), (TritonAttention(cfg), window + 1),
                         (TritonAttention(dataclasses.replace(cfg, block_ids=False)), window)):
        out = backend.run(qd, kvd, plan, sink, win, 0.3)
        if win == window:
            assert torch.equal(out, by_ids)
    assert seen == [bs, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] == 1] + [(1, 16, 2, 16, 60, 6, 5, 0, 2, 4)],
                         ids=lambda s: "kvh{}-g{}-t{}-d{}".format(*s[:4]))
def test_planless_one_token_blocks_mask_as_the_general_path(shape, dtype):
    """A step without plan positions (streaming's frame, dense attention) whose query blocks hold one
    token each (decode steps; g = 16 with 16-row blocks makes one-token blocks of a two-token step)
    masks the scores by key row alone (`KernelConfig.one_token`): the general path's output, bit for
    bit, with and without the pseudo-token and dense, in one split and in several."""
    kvh, g, t, d, n, m_cap, m, _, sink, window = shape
    cfgs = [kernels.KernelConfig(max_query_rows=16), kernels.KernelConfig(block_n=16, splits=3, max_query_rows=16)]
    for cfg in cfgs:  # the blocks hold one token each
        assert min(t, kernels.launch_plan(kvh, g, t, d, 4, n, m_cap, 0, sink, window, 4, cfg).tokens_per_block) == 1
    q, kv, pos = _inputs(_seed("one-token", shape, dtype), kvh, g, t, d, n, m_cap, m, 0, dtype)
    gen = torch.Generator().manual_seed(_seed("one-token-extra", shape))
    rest_logit = torch.where(torch.rand(kvh, g, t, generator=gen) < 0.5, torch.randn(kvh, g, t, generator=gen),
                             float("-inf"))
    plans = [Plan(pos), Plan(pos, rest_logit=rest_logit, rest_value=torch.randn(kvh, d, generator=gen)), Plan.dense()]
    for cfg in cfgs:
        for plan in plans:
            args = _to(DEVICE, q, kv, plan)
            fast = TritonAttention(cfg).run(*args, sink, window, 0.25)
            general = TritonAttention(dataclasses.replace(cfg, one_token=False)).run(*args, sink, window, 0.25)
            assert torch.equal(fast, general)
            assert _rel(fast.cpu(), _reference(q, kv, plan, sink, window, 0.25)) < TOL[dtype]


@pytest.mark.parametrize("splits", [18, 70])
def test_more_splits_than_one_merge_chunk(splits):
    """The merge kernel takes the splits in chunks of MERGE_BLOCK_S (64): 18 splits fit one, 70 take two (a step
    with few KV heads and query blocks on a large GPU gets up to programs_per_sm x SMs splits). Each against float64
    and torch_ref, dense and over a plan with the pseudo-token (merged last) on half of the rows. Row lists of 70
    chunks of 16 rows (69 of context or plan rows, one of the 8 local slots), so that every split has rows, also
    those past the first chunk of splits."""
    kvh, g, t, d, n, k, sink, window = 1, 4, 1, 16, 1104, 1093, 4, 8  # n = 4 + 7 + k = 69 · 16
    q, kv, pos = _inputs(_seed("merge-chunks", splits), kvh, g, t, d, n, 8, 4, k)
    gen = torch.Generator().manual_seed(_seed("merge-chunks-rest", splits))
    rest_logit = torch.where(torch.rand(kvh, g, t, generator=gen) < 0.5, torch.randn(kvh, g, t, generator=gen),
                             float("-inf"))
    cfg = kernels.KernelConfig(block_n=16, splits=splits)
    for n_pos in (None, k):  # dense, and the plan's row list
        lp = kernels.launch_plan(kvh, g, t, d, 4, n, 8, n_pos, sink, window, 4, cfg)
        assert (lp.splits, lp.chunks_per_split) == (splits, -(-70 // splits))
    assert (splits > kernels.MERGE_BLOCK_S) == (splits == 70)
    for plan in (Plan.dense(), Plan(pos, rest_logit=rest_logit, rest_value=torch.randn(kvh, d, generator=gen))):
        _check(q, kv, plan, sink, window, 0.25, cfg=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cfg", [kernels.KernelConfig(), SMALL], ids=["default", "small"])
def test_dense_plan(dtype, cfg):
    q, kv, _ = _inputs(_seed("dense", dtype), kvh=2, g=4, t=3, d=64, n=150, m_cap=8, m=5, dtype=dtype)
    _check(q, kv, Plan.dense(), 4, 8, 0.125, cfg=cfg)


@pytest.mark.parametrize("t", [3, 1], ids=["t3", "t1"])
@pytest.mark.parametrize("splits", [3, 1], ids=["merged", "direct"])
@pytest.mark.parametrize("k", [9, 0])
def test_bypass_and_pseudo_token(k, splits, t):
    """A bypassed head attends the frame only, plus the pseudo-token standing for the rest (added
    by the merge kernel, or by the split kernel itself when there is one split), for a decode step
    (t = 1) and a question chunk."""
    kvh, g, d = 2, 4, 16
    cfg = kernels.KernelConfig(block_n=16, splits=splits)
    assert (kernels.launch_plan(kvh, g, t, d, 4, 60, 6, k, 4, 8, 4, cfg).splits == 1) == (splits == 1)
    q, kv, pos = _inputs(_seed("bypass", k), kvh, g, t, d, n=60, m_cap=6, m=4, k=k)
    gen = torch.Generator().manual_seed(_seed("bypass-extra", k))
    bypass = torch.rand(kvh, g, t, generator=gen) < 0.5
    rest_logit = torch.where(bypass, torch.randn(kvh, g, t, generator=gen) + 2.0, float("-inf"))
    rest_value = torch.randn(kvh, d, generator=gen)
    plan = Plan(pos, bypass=bypass, rest_logit=rest_logit, rest_value=rest_value)
    out = _check(q, kv, plan, 4, 8, 0.25, cfg=cfg)
    without = TritonAttention(cfg).run(*_to(DEVICE, q, kv, Plan(pos)), 4, 8, 0.25)
    changed = (out - without).abs().amax(-1).cpu() > 1e-6  # [KVH, G, T]
    assert torch.equal(changed, bypass)  # the plan is dropped and/or the pseudo-token added there only


def test_large_t_spans_several_query_blocks():
    """20 tokens x 4 heads = 80 query rows: blocks of 64 rows (16 tokens), the last block partial;
    with a plan longer than the shared rows, blocks of 16 rows (4 tokens)."""
    q, kv, pos = _inputs(_seed("large-t"), kvh=1, g=4, t=20, d=16, n=60, m_cap=24, m=22, k=6)
    lp = kernels.launch_plan(1, 4, 20, 16, 4, 60, 24, 6, 4, 8, sm_count=4)
    assert (lp.block_m, lp.tokens_per_block, lp.n_qb) == (64, 16, 2)
    _check(q, kv, Plan(pos), 4, 8, 0.25)
    q, kv, pos = _inputs(_seed("large-t-plan"), kvh=1, g=4, t=20, d=16, n=90, m_cap=24, m=22, k=50)
    lp = kernels.launch_plan(1, 4, 20, 16, 4, 90, 24, 50, 4, 8, sm_count=4)
    assert (lp.block_m, lp.tokens_per_block, lp.n_qb) == (16, 4, 5)
    _check(q, kv, Plan(pos), 4, 8, 0.25)


def test_non_contiguous_views():
    """ctx K/V sliced along N out of a longer capture laid out [N, KVH, D]; q a transposed view;
    positions expanded over kv heads (stride 0); loc K/V a slice of a larger cache."""
    kvh, g, t, d, n, m = 2, 3, 2, 16, 70, 5
    gen = torch.Generator().manual_seed(_seed("views"))
    cap_k = torch.randn(n + 9, kvh, d, generator=gen).transpose(0, 1)[:, :n]  # [KVH, N, D], row stride KVH·D
    cap_v = torch.randn(n + 9, kvh, d, generator=gen).transpose(0, 1)[:, :n]
    cache_k = torch.randn(kvh, 12, d, generator=gen)[:, 2:2 + m + 3]  # [KVH, M, D] inside a bigger buffer
    cache_v = torch.randn(kvh, 12, d, generator=gen)[:, 2:2 + m + 3]
    q = torch.randn(t, kvh, g, d, generator=gen).permute(1, 2, 0, 3)  # [KVH, G, T, D], not contiguous
    assert not (cap_k.is_contiguous() or q.is_contiguous() or cache_k.is_contiguous())
    kv = KVView(cap_k, cap_v, cache_k, cache_v, n + m - t + torch.arange(t))
    pos = torch.randperm(n, generator=gen)[:12].to(torch.int32).view(1, 1, 12).expand(kvh, t, 12)
    _check(q, kv, Plan(pos), 4, 8, 0.25, cfg=SMALL)
    _check(q, kv, Plan.dense(), 4, 8, 0.25, cfg=SMALL)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_unused_local_slots_and_poisoned_buffers(garbage):
    """Slots after the request's last token may hold anything; the output buffer and the split
    workspace start poisoned (NaN): every value read must have been written by this call."""
    q, kv, pos = _inputs(_seed("garbage", str(garbage)), kvh=2, g=3, t=2, d=16, n=60, m_cap=8, m=3, k=10,
                         garbage=garbage)
    qd, kvd, pland = _to(DEVICE, q, kv, Plan(pos))
    kernels.clear_workspace()
    kernels.frame_attention(qd, kvd.ctx_k, kvd.ctx_v, kvd.loc_k, kvd.loc_v, kvd.q_pos, pland.positions, 4, 8, 0.25,
                            cfg=SMALL)  # sizes the workspace ...
    for buf in kernels._WORKSPACES.buffers():
        buf.fill_(float("nan"))  # ... which is then poisoned
    out = torch.full_like(qd, float("nan"))
    got = kernels.frame_attention(qd, kvd.ctx_k, kvd.ctx_v, kvd.loc_k, kvd.loc_v, kvd.q_pos, pland.positions,
                                  4, 8, 0.25, out=out, cfg=SMALL)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), _reference(q, kv, Plan(pos), 4, 8, 0.25, m_used=3)) < 1e-5
    out.fill_(float("nan"))  # one split: the split kernel writes `out` itself
    kernels.frame_attention(qd, kvd.ctx_k, kvd.ctx_v, kvd.loc_k, kvd.loc_v, kvd.q_pos, pland.positions, 4, 8, 0.25,
                            out=out, cfg=kernels.KernelConfig(block_n=16, splits=1))
    assert torch.isfinite(out).all()
    assert _rel(out.cpu(), _reference(q, kv, Plan(pos), 4, 8, 0.25, m_used=3)) < 1e-5
    _check(q, kv, Plan(pos), 4, 8, 0.25, m_used=3)  # the backend's own output buffer


def test_launch_plan_is_shapes_only_and_covers_every_chunk():
    """Split counts come from shapes; every chunk of the row list belongs to exactly one split; an
    H100-sized decode step (8 kv heads, 128K context, 5 % plan) fills the 132 SMs."""
    cases = [  # kvh, g, t, d, itemsize, n, m, k (None = dense), sink, window
        (8, 4, 1, 128, 2, 131072, 64, 6554, 4, 32),
        (8, 4, 1, 128, 2, 524288, 64, None, 4, 32),
        (8, 4, 1, 128, 2, 32768, 1, 0, 4, 32),
        (8, 4, 200, 128, 2, 131072, 256, 6554, 4, 32),
        (3, 3, 1, 64, 4, 1000, 16, 50, 4, 32),
        (1, 1, 1, 16, 4, 1, 1, 1, 0, 0),
    ]
    for kvh, g, t, d, item, n, m, k, sink, window in cases:
        lp = kernels.launch_plan(kvh, g, t, d, item, n, m, k, sink, window, sm_count=132)
        chunks = -(-lp.rows // lp.block_n)
        assert (lp.splits - 1) * lp.chunks_per_split < max(chunks, 1) <= lp.splits * lp.chunks_per_split
        assert lp.block_m >= 16 and lp.tokens_per_block >= 1 and lp.tokens_per_block * g <= lp.block_m
        assert lp.n_qb * lp.tokens_per_block >= t
    lp = kernels.launch_plan(8, 4, 1, 128, 2, 131072, 64, 6554, 4, 32, sm_count=132)
    assert lp.block_m == 16 and lp.block_n == 128 and 8 * lp.splits >= 132
    assert lp.rows == 4 + 31 + 6554 + 64


def test_registered_and_validate_configuration():
    from types import SimpleNamespace

    assert "triton" in backend_names()
    be = get_backend("triton")
    spec = SimpleNamespace(head_dim=128)
    assert be.validate_configuration(spec, "cuda", torch.bfloat16) == []
    reasons = be.validate_configuration(SimpleNamespace(head_dim=96), "cuda", torch.float16)
    assert any("head_dim 96" in r for r in reasons)
    assert be.validate_configuration(spec, "cuda", torch.int8)
    # a CPU is refused even with the interpreter on (these tests' mode): serving through it would crawl
    assert any("CUDA" in r for r in be.validate_configuration(spec, "cpu", torch.float32))


@pytest.mark.gpu
def test_no_host_sync_and_cuda_graph_replay():
    """A decode step's run() makes no host sync (sync debug mode "error") and replays from a CUDA
    graph; replayed with new inputs written in place, it equals an eager run on those inputs."""
    torch.manual_seed(0)
    kvh, g, t, d, n, m_cap, m, k = 8, 4, 1, 128, 8192, 64, 17, 410
    dt = torch.bfloat16
    q, kv, pos = _inputs(_seed("graph"), kvh, g, t, d, n, m_cap, m, k, dt)
    q, kv, plan = _to("cuda", q, kv, Plan(pos))
    be = get_backend("triton")
    for p in (plan, Plan.dense(), Plan(plan.positions[..., :0])):  # split + merge kernels, then one split
        be.run(q, kv, p, 4, 32, d ** -0.5)  # compile
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = be.run(q, kv, p, 4, 32, d ** -0.5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = _reference(q.cpu(), KVView(*(x.cpu() for x in (kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos))),
                         Plan(None if p.is_dense else p.positions.cpu()), 4, 32, d ** -0.5)
        assert _rel(out.cpu(), ref) < TOL[dt]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        be.run(q, kv, plan, 4, 32, d ** -0.5)  # warm the side stream's workspace outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_graph = be.run(q, kv, plan, 4, 32, d ** -0.5)
    torch.cuda.current_stream().wait_stream(side)
    q2, kv2, pos2 = _inputs(_seed("graph-2"), kvh, g, t, d, n, m_cap, m, k, dt)
    q.copy_(q2.cuda())
    kv.ctx_k.copy_(kv2.ctx_k.cuda())
    plan.positions.copy_(pos2.cuda())
    graph.replay()
    want = be.run(q, kv, plan, 4, 32, d ** -0.5)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_graph, want, atol=0, rtol=0)
