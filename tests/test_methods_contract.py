"""The method contract, checked for every registered method (`method_names()`) on real captured
tensors of the default model: build -> open -> plan over decode steps -> update.

* plans are fixed-shape: [KVH, T, K] int32, K the same at every step and for every query (it may
  depend on params, n_ctx and the index only), or dense (None); valid positions are distinct,
  inside the context and outside the frame's sink and window (the backend attends those);
* the persisted arrays are never written;
* planners are isolated: two interleaved requests on one index plan exactly as each one alone;
* `torch_ref` over a plan equals dense attention masked to the plan's token set (float64 reference).

The GPU half (no host sync under `set_sync_debug_mode("error")`, one step captured in a CUDA graph)
is tests/test_gpu_decode.py. Method-specific behaviour stays in each method's own test file.
"""

from __future__ import annotations

import pytest
import torch

from conftest import natural_document
from decoder.backends import frame_mask, get_backend
from evaluation.fidelity import build_index, truncate_capture
from indexer.base import DecodeContext, KVView, frame_bounds, get_method, method_names

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N_CTX = 480  # context tokens the index is built from; the next tokens of the capture are the request
STEPS = [3, 1, 1, 1, 1]  # a 3-token question chunk, then one-token steps
LAYERS = (0, 1, 7, 15, 29)


@pytest.fixture(scope="module")
def cap(lm):
    from decoder.prefill import prefill

    ids = lm.context_ids(natural_document(450))[: N_CTX + sum(STEPS)]
    assert len(ids) == N_CTX + sum(STEPS)
    return prefill(lm, ids)


def _params(name, saap_model):
    method = get_method(name)
    if name == "saap":
        return method, method.Params(model_dir=str(saap_model), nprobe=4)
    return method, method.Params()


@pytest.fixture(scope="module")
def built(cap, request):
    """method name -> (method, params, arrays or None), built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            saap_model = request.getfixturevalue("saap_small_model") if name == "saap" else None
            method, params = _params(name, saap_model)
            arrays = method.build(truncate_capture(cap, N_CTX), params) if method.has_index else None
            cache[name] = (method, params, arrays)
        return cache[name]

    return get


def _reader(arrays):
    from indexer.base import IndexReader

    return None if arrays is None else IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))


def _steps(cap, spec, q_noise: float = 0.0, seed: int = 0):
    """Yield (step index, layer, q [KVH, G, T, D], KVView, new k, new v) in the decoder's order, over a
    request buffer of fixed capacity (slots after the last query unused)."""
    gen = torch.Generator().manual_seed(seed)
    kvh, g = spec.num_kv_heads, spec.group_size
    m_cap = sum(STEPS) + 4
    pos = N_CTX
    for i, t in enumerate(STEPS):
        q_pos = torch.arange(pos, pos + t)
        for layer in LAYERS:
            d = cap.k.shape[-1]
            loc_k = torch.zeros(kvh, m_cap, d)
            loc_v = torch.zeros(kvh, m_cap, d)
            m = pos + t - N_CTX
            loc_k[:, :m] = cap.k[layer, :, N_CTX:pos + t]
            loc_v[:, :m] = cap.v[layer, :, N_CTX:pos + t]
            q = cap.q[layer, :, pos:pos + t].reshape(kvh, g, t, d)
            if q_noise:
                q = q + q_noise * q.std() * torch.randn(q.shape, generator=gen)
            kv = KVView(cap.k[layer, :, :N_CTX], cap.v[layer, :, :N_CTX], loc_k, loc_v, q_pos)
            yield i, layer, q, kv, loc_k[:, m - t:m], loc_v[:, m - t:m]
        pos += t


def _replay(method, params, arrays, cap, spec, **kw):
    planner = method.open(_reader(arrays), params, DecodeContext(N_CTX, spec, sum(STEPS) + 4))
    plans = []
    for i, layer, q, kv, k_new, v_new in _steps(cap, spec, **kw):
        plan = planner.plan(layer, q, kv)
        plans.append((i, layer, q, kv, plan))
        planner.update(layer, k_new, v_new, kv.q_pos)
    planner.stats()  # must not fail
    planner.close()
    return plans


@pytest.mark.parametrize("name", method_names())
def test_plans_are_fixed_shape_and_selectable(name, built, cap, lm):
    method, params, arrays = built(name)
    spec = lm.spec
    a = _replay(method, params, arrays, cap, spec)
    b = _replay(method, params, arrays, cap, spec, q_noise=0.5, seed=1)  # other queries, same shapes
    sink, window = params.frame(N_CTX)
    shapes: dict[tuple[int, int], object] = {}
    for (i, layer, q, kv, plan), (_, _, _, _, other) in zip(a, b):
        t = q.shape[2]
        if plan.positions is None:
            assert other.positions is None, f"layer {layer}: dense for one query, sparse for another"
            got = None
        else:
            pos = plan.positions
            assert pos.dtype == torch.int32 and pos.dim() == 3 and pos.shape[:2] == (spec.num_kv_heads, t)
            assert other.positions is not None and other.positions.shape == pos.shape
            got = pos.shape[-1]
            valid = pos >= 0
            assert (pos[valid] < N_CTX).all()
            s_end, w_lo = frame_bounds(kv.q_pos, N_CTX, sink, window)
            inside = (pos >= s_end) & (pos.long() < w_lo[None, :, None])
            assert inside[valid].all(), f"layer {layer}: plans a position the frame attends anyway"
            for row in pos.reshape(-1, pos.shape[-1]) if pos.shape[-1] else []:
                row = row[row >= 0]
                assert row.unique().numel() == row.numel(), f"layer {layer}: duplicate positions"
        key = (layer, t)
        assert shapes.setdefault(key, got) == got, f"layer {layer}: K changed between steps"


@pytest.mark.parametrize("name", method_names())
def test_persisted_arrays_are_never_written(name, built, cap, lm):
    method, params, arrays = built(name)
    if arrays is None:
        pytest.skip(f"{name} persists no index")
    before = {k: v.clone() for k, v in arrays.items()}
    _replay(method, params, arrays, cap, lm.spec)
    for k, v in arrays.items():
        assert torch.equal(v, before[k]), f"{name} wrote its persisted array {k!r}"


@pytest.mark.parametrize("name", method_names())
def test_planners_are_isolated(name, built, cap, lm):
    """Two requests on one index, interleaved step by step, plan exactly as each one does alone."""
    method, params, arrays = built(name)
    spec = lm.spec
    alone_a = _replay(method, params, arrays, cap, spec)
    alone_b = _replay(method, params, arrays, cap, spec, q_noise=0.3, seed=2)
    ctx = DecodeContext(N_CTX, spec, sum(STEPS) + 4)
    pa, pb = method.open(_reader(arrays), params, ctx), method.open(_reader(arrays), params, ctx)
    steps_b = list(_steps(cap, spec, q_noise=0.3, seed=2))
    for j, (i, layer, q, kv, kn, vn) in enumerate(_steps(cap, spec)):
        plan_a = pa.plan(layer, q, kv)
        _, layer_b, q_b, kv_b, kn_b, vn_b = steps_b[j]
        plan_b = pb.plan(layer_b, q_b, kv_b)
        pa.update(layer, kn, vn, kv.q_pos)
        pb.update(layer_b, kn_b, vn_b, kv_b.q_pos)
        for plan, alone in ((plan_a, alone_a[j][4]), (plan_b, alone_b[j][4])):
            assert (plan.positions is None) == (alone.positions is None)
            if plan.positions is not None:
                assert torch.equal(plan.positions, alone.positions), f"layer {layer}: another request changed the plan"
            for f in ("bypass", "rest_logit"):
                x, y = getattr(plan, f), getattr(alone, f)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y))


@pytest.mark.parametrize("name", method_names())
def test_torch_ref_over_the_plan_is_masked_dense_attention(name, built, cap, lm):
    method, params, arrays = built(name)
    spec = lm.spec
    sink, window = params.frame(N_CTX)
    backend = get_backend("torch_ref")
    for i, layer, q, kv, plan in _replay(method, params, arrays, cap, spec):
        out = backend.run(q, kv, plan, sink, window, q.shape[-1] ** -0.5)
        mask = frame_mask(plan, kv, sink, window, spec.group_size)
        k = torch.cat([kv.ctx_k, kv.loc_k], 1).double()
        v = torch.cat([kv.ctx_v, kv.loc_v], 1).double()
        s = (torch.einsum("hgtd,hnd->hgtn", q.double(), k) * q.shape[-1] ** -0.5).masked_fill(~mask, float("-inf"))
        if plan.rest_logit is not None:
            s = torch.cat([s, plan.rest_logit.double()[..., None]], -1)
        p = torch.softmax(s, -1)
        ref = torch.einsum("hgtn,hnd->hgtd", p[..., : k.shape[1]], v)
        if plan.rest_logit is not None:
            ref = ref + p[..., -1:] * plan.rest_value.double()[:, None, None, :]
        err = (out.double() - ref).norm() / ref.norm()
        assert err < 1e-5, f"layer {layer} step {i}: {err:.2e}"


def _attended(plans) -> int:
    """Context positions the plans attend, summed over steps, layers, heads and tokens."""
    return sum(int((p.positions >= 0).sum()) for *_, p in plans if p.positions is not None)


@pytest.mark.parametrize("name", method_names())
def test_widened_params_plan_more_from_the_same_index(name, built, cap, lm):
    """`MethodParams.widened` (the runner's plan_ahead budget, `plan_ahead_widen`): the same index
    serves it (no build field changes), and its plans attend more of the context; a method without a
    search budget (full, streaming) is unchanged. Factor 1 is the params themselves."""
    method, params, arrays = built(name)
    if name == "ctkvr":  # its default k (512) covers this 480-token context already
        params = params.with_overrides({"k": 24})
    assert params.widened(1.0) is params
    wide = params.widened(1.5)
    assert wide.build_params() == params.build_params() and wide.frame(N_CTX) == params.frame(N_CTX)
    narrow, widened = (_attended(_replay(method, p, arrays, cap, lm.spec)) for p in (params, wide))
    if wide == params:
        assert name in ("full", "streaming"), f"{name}: widening changed nothing"
        return
    assert widened > narrow, f"{name}: {widened} positions attended widened against {narrow}"


def test_widened_budgets():
    """What widening scales, per kind of budget: k, else the ratio (capped at 1, CSAttn's `rho`), else
    CTkvr's default k; SAAP's probed buckets; PSA's left-out mass 1 - eps and its block cap."""
    p = get_method("topk").Params
    assert p().widened(1.5).ratio == pytest.approx(0.075) and p(k=100).widened(1.5).k == 150
    assert p(ratio=0.8).widened(1.5).ratio == 1.0 and p(k=(1 << 22) - 1).widened(2).k == 1 << 22  # bounded
    assert get_method("ctkvr").Params().widened(1.5).k == 768  # neither set: 1.5 x its default 512
    cs = get_method("csattn").Params
    assert cs().widened(2).rho == pytest.approx(0.1) and cs(schedule="0.15-step-4").widened(2).keep_ratio == pytest.approx(0.3)
    assert cs(schedule="0.15-step-4").widened(2).search_period == 4  # the search period is not a budget
    assert get_method("saap").Params(nprobe=3).widened(1.5).nprobe == 5
    psa = get_method("psa").Params(eps=0.94, max_ratio=0.05).widened(2)
    assert psa.eps == pytest.approx(0.97) and psa.max_ratio == pytest.approx(0.1)
    assert get_method("kivf").Params(ratio=0.05).widened(1.5).budget(1000) == 75
