"""The GPU half of the method contract (tests/test_methods_contract.py), for every method, on a
CUDA device: decode steps (plan + run + update) make no host sync — they run under
`torch.cuda.set_sync_debug_mode("error")` — and one step (plan + run) captures in a CUDA graph whose
replay equals the same step run eagerly by a twin planner with the same history. Backends are checked
the same way. Skipped on CPU CI (tests/conftest.py); run on the device tool (see benchmarks/RESULTS.md).

Structured random tensors of SmolLM2's shape stand in for a capture, and SAAP gets a synthetic
trained model (tests/synthetic.py): only shapes, devices and syncs matter here, quality is checked on
real tensors elsewhere — and the model's weights do not travel to the GPU machine."""

from __future__ import annotations

import pytest
import torch

from decoder.backends import backend_names, get_backend
from indexer.base import DecodeContext, IndexReader, KVView, PrefillCapture, get_method, method_names
from synthetic import Mixture, smollm2_spec, structured_capture, write_saap_model

pytestmark = pytest.mark.gpu

N_CTX, STEPS, LAYERS = 1024, 4, (0, 1, 5)
SPEC = smollm2_spec(layers=6)


def _setup(name, tmp_path, device="cuda"):
    spec = SPEC
    mix = Mixture(spec, device)
    method = get_method(name)
    if name == "saap":
        model_dir = write_saap_model(tmp_path / "saap", spec, mix, layers=[1, 5], clusters=32)
        params = method.Params(model_dir=str(model_dir), nprobe=4)
    else:
        params = method.Params()
    cap = structured_capture(spec, N_CTX + STEPS + 1, device, mixture=mix)
    ctx_cap = PrefillCapture(cap.q[:, :, :N_CTX], cap.k[:, :, :N_CTX], cap.v[:, :, :N_CTX], cap.positions[:N_CTX], spec)
    arrays = {k: v.to(device) for k, v in method.build(ctx_cap, params).items()} if method.has_index else None
    reader = None if arrays is None else IndexReader(lambda nm, layer: arrays[nm][layer], sorted(arrays))
    return method, params, cap, reader


def _views(cap, spec, step, m_cap=16):  # noqa: D103 - (layer, q, KVView) of one step, static buffers
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    pos = N_CTX + step
    for layer in LAYERS:
        loc_k = torch.zeros(kvh, m_cap, d, device="cuda")
        loc_v = torch.zeros_like(loc_k)
        loc_k[:, :step + 1] = cap.k[layer, :, N_CTX:pos + 1]
        loc_v[:, :step + 1] = cap.v[layer, :, N_CTX:pos + 1]
        q = cap.q[layer, :, pos:pos + 1].reshape(kvh, g, 1, d).contiguous()
        kv = KVView(cap.k[layer, :, :N_CTX], cap.v[layer, :, :N_CTX], loc_k, loc_v, torch.tensor([pos], device="cuda"))
        yield layer, q, kv


@pytest.mark.parametrize("name", method_names())
def test_decode_steps_make_no_host_sync_and_capture_in_a_graph(name, tmp_path):
    spec = SPEC
    method, params, cap, reader = _setup(name, tmp_path)
    sink, window = params.frame(N_CTX)
    backend = get_backend("torch_ref")
    ctx = DecodeContext(N_CTX, spec, 16)
    a, b = method.open(reader, params, ctx), method.open(reader, params, ctx)
    scale = spec.head_dim ** -0.5

    def step(planner, s, check_sync):
        for layer, q, kv in _views(cap, spec, s):
            torch.cuda.set_sync_debug_mode("error" if check_sync else "default")
            try:
                plan = planner.plan(layer, q, kv)
                backend.run(q, kv, plan, sink, window, scale)
                planner.update(layer, kv.loc_k[:, s:s + 1], kv.loc_v[:, s:s + 1], kv.q_pos)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    for s in range(STEPS - 1):
        step(a, s, check_sync=s > 0)  # the first step may allocate lazily; later ones run under "error"
        step(b, s, check_sync=False)
    torch.cuda.synchronize()
    # capture the last step's plan + run for one layer in a graph; b runs it eagerly
    layer, q, kv = next(iter(_views(cap, spec, STEPS - 1)))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(g):
            out_graph = backend.run(q, kv, a.plan(layer, q, kv), sink, window, scale)
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    want = backend.run(q, kv, b.plan(layer, q, kv), sink, window, scale)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_graph, want, atol=1e-5, rtol=1e-5)


def _host_mapped(kv: KVView, host_arrays=frozenset({"kv/k", "kv/v"})) -> KVView:
    """The same view with the context arrays in `host_arrays` pinned in host memory and read in
    place (the offload backends)."""
    from decoder.backends.offload import mapped

    def place(name, t):
        return mapped(t.cpu().pin_memory()) if name in host_arrays else t

    return KVView(place("kv/k", kv.ctx_k), place("kv/v", kv.ctx_v), kv.loc_k, kv.loc_v, kv.q_pos)


@pytest.mark.parametrize("name", backend_names())
def test_backends_run_without_sync_on_gpu(name):
    """Every backend runs a sparse and a dense plan without a host sync and matches torch_ref
    (offload over the context in mapped host memory)."""
    from indexer.base import Plan

    spec = SPEC
    cap = structured_capture(spec, N_CTX + 2, "cuda", seed=3)
    layer, q, kv = next(iter(_views(cap, spec, 0)))
    pos = torch.randperm(N_CTX, device="cuda")[:64].view(1, 1, 64).expand(spec.num_kv_heads, 1, 64).to(torch.int32)
    ref = get_backend("torch_ref")
    be = get_backend(name)
    kv_be = _host_mapped(kv, be.host_arrays)
    for plan in (Plan(pos.contiguous()), Plan.dense()):
        be.run(q, kv_be, plan, 4, 32, 0.125)  # warm-up (compilation)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = be.run(q, kv_be, plan, 4, 32, 0.125)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(out, ref.run(q, kv, plan, 4, 32, 0.125), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", method_names())
def test_offload_plans_on_the_device_over_mapped_host_memory(name, tmp_path):
    """Offload mode (decoder/backends/offload.py): the context's K/V in pinned host memory, read in
    place by the planner and the kernels; index arrays, query and request rows on the GPU. Over a
    few steps every method plans without a host sync and makes the same plans and outputs as a twin
    planner over the same context resident on the GPU (the same kernels read the same bytes)."""
    spec = SPEC
    method, params, cap, reader = _setup(name, tmp_path)
    sink, window = params.frame(N_CTX)
    ctx = DecodeContext(N_CTX, spec, 16)
    host, resident = method.open(reader, params, ctx), method.open(reader, params, ctx)
    offload = get_backend("offload")
    scale = spec.head_dim ** -0.5
    mapped_layers = {layer: _host_mapped(kv) for layer, _, kv in _views(cap, spec, 0)}
    for s in range(STEPS - 1):
        for layer, q, kv in _views(cap, spec, s):
            hv = mapped_layers[layer]
            hv = KVView(hv.ctx_k, hv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos)
            if s > 0:  # the first step of each layer may allocate lazily
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                plan = host.plan(layer, q, hv)
                out = offload.run(q, hv, plan, sink, window, scale)
                host.update(layer, kv.loc_k[:, s:s + 1], kv.loc_v[:, s:s + 1], kv.q_pos)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want_plan = resident.plan(layer, q, kv)
            want = offload.run(q, kv, want_plan, sink, window, scale)  # GPU-resident: runs as triton
            resident.update(layer, kv.loc_k[:, s:s + 1], kv.loc_v[:, s:s + 1], kv.q_pos)
            # the same sets (ctkvr's fused plan lists its positions in an order its atomics decide)
            for a, b in ((plan.positions, want_plan.positions), (plan.bypass, want_plan.bypass)):
                assert (a is None) == (b is None), (name, layer, s)
                if a is not None and a.dtype != torch.bool:
                    a, b = a.sort(-1).values, b.sort(-1).values
                assert a is None or torch.equal(a, b), (name, layer, s)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


N_REPRO = 16384  # many programs per row in every fused planner (the radix select: 16 shares of a row)


@pytest.mark.parametrize("t", [1, 8], ids=["step", "question-chunk"])
@pytest.mark.parametrize("name", [m for m in method_names() if m != "saap"])
def test_plans_and_bf16_outputs_are_bitwise_reproducible(name, t):
    """The same step planned and attended ten times (triton backend, bf16): the same plan rows, order
    included, and the same output bits. A row order that follows a race between programs keeps the
    row's set but changes its order from run to run, and the bf16 attention over the same positions
    in another order rounds otherwise (2.7-3.3e-3 relative, benchmarks/RESULTS.md): CTkvr's dedup,
    csattn's, LFPS's and topk's selects did, on an H200 every repeat of a 32K or 128K step gave
    other rows and other output bits (same results file, "Reproducible plans"). SAAP is checked the
    same way by tests/test_kernel_schedules.py (its model comes from a trained fixture)."""
    spec = smollm2_spec(layers=2)
    kvh, g, d = spec.num_kv_heads, spec.group_size, spec.head_dim
    method = get_method(name)
    params = method.Params()
    cap = structured_capture(spec, N_REPRO + t, "cuda", mixture=Mixture(spec, "cuda"), dtype=torch.bfloat16)
    n = N_REPRO
    ctx = PrefillCapture(cap.q[:, :, :n], cap.k[:, :, :n], cap.v[:, :, :n], cap.positions[:n], spec)
    arrays = {k: v.to("cuda") for k, v in method.build(ctx, params).items()} if method.has_index else None
    reader = None if arrays is None else IndexReader(lambda nm, layer: arrays[nm][layer], sorted(arrays))
    planner = method.open(reader, params, DecodeContext(n, spec, 16))
    loc_k = torch.zeros(kvh, 16, d, device="cuda", dtype=torch.bfloat16)
    loc_v = torch.zeros_like(loc_k)
    loc_k[:, :t], loc_v[:, :t] = cap.k[1, :, n:], cap.v[1, :, n:]
    kv = KVView(cap.k[1, :, :n], cap.v[1, :, :n], loc_k, loc_v, torch.arange(n, n + t, device="cuda"))
    q = cap.q[1, :, n:].reshape(kvh, g, t, d).contiguous()
    backend = get_backend("triton")
    sink, window = params.frame(n)
    first = None
    for i in range(10):
        plan = planner.plan(1, q, kv)
        out = backend.run(q, kv, plan, sink, window, d ** -0.5)
        if first is None:
            first = (None if plan.positions is None else plan.positions.clone(), out.clone())
            # (streaming plans the frame only; LFPS attends a question chunk densely: no positions)
            assert name == "streaming" or first[0] is None or (first[0] >= 0).any(), f"{name}: an empty plan"
            continue
        if first[0] is not None:
            same_set = torch.equal(plan.positions.sort(-1).values, first[0].sort(-1).values)
            assert torch.equal(plan.positions, first[0]), f"{name} repeat {i}: other rows (same set: {same_set})"
        assert torch.equal(out, first[1]), f"{name} repeat {i}: other output bits"
