"""Every fused plan is a function of its inputs, not of the order a GPU runs its programs in.

The kernels coordinate programs through atomics (CTkvr's dedup map, csattn's integer accumulator,
the radix select's histograms and published counts, LFPS's fixed-point sums) and tickets (SAAP's
last program of a row, the radix select's shares). On CPU CI the interpreter runs a grid in index
order, so one outcome of each race is all the other kernel tests ever see. Here each planner plans
the same decode steps (a question chunk, then a one-token step, with their updates) with every
launch's programs run forward, reversed and shuffled (`schedules.program_order`), with launch knobs
small enough that every kernel has many programs per row. Every plan row must be the same, order
included: the bf16 attention over the same positions in another order rounds otherwise, so a row
order that followed the race made a GPU's decode steps differ from run to run (benchmarks/
RESULTS.md, "Reproducible plans": CTkvr's dedup kept whichever duplicate slot came first, csattn's,
LFPS's and topk's select wrote at a per-row atomic counter).
"""

from __future__ import annotations

import pytest
import torch

from indexer.base import DecodeContext, IndexReader
from synthetic import decode_steps

pytest.importorskip("triton", reason="triton is not installed")
from schedules import program_order  # noqa: E402

# the interpreter only (conftest.py skips these on a CUDA machine, where the order is the hardware's)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.interpreter]

KVH, G, D, N = 2, 4, 32, 320
STEPS = [3, 1]
ORDERS = ["forward", "reverse", "shuffle"]


def _tiny_config(name: str):
    """(kernel module, launch knobs with many programs per row) for a method's fused plan."""
    from indexer.kernels import csattn, ivf, lfps, psa

    return {
        "ctkvr": (ivf, ivf.IvfConfig(block_c=16, block_u=32, chunks_per_prog=1, select_block=32, select_warps=4)),
        "kivf": (ivf, ivf.IvfConfig(block_c=16, block_u=32, chunks_per_prog=1, select_block=32, select_warps=4,
                                    wide_select_block=32, wide_select_warps=4)),
        "psa": (psa, psa.PsaConfig(block_b=16, tile_tokens=16, pos_block=64)),
        "csattn": (csattn, csattn.CsattnConfig(block=32, block_n=64)),
        "lfps": (lfps, lfps.LfpsConfig(block=32, block_score=16, block_moments=64, block_k=32, block_decay=128)),
    }.get(name, (None, None))


PARAMS = {
    "ctkvr": dict(n_centroids=24, list_size=40, probe=4, k=30, fifo=2),
    "kivf": dict(n_clusters=12, nprobe=4, k=40),
    "psa": dict(block_size=8, eps=0.9, max_ratio=0.5, microbatch=2),
    "csattn": dict(m=4, n_centroids=8, list_len=96, rho=0.1, sink=4, window=8),
    "lfps": dict(dense_prompt=False),
    "topk": dict(ratio=0.1),
}
ENTRY = {  # the kernel module and the entry point each fused planner calls (counted: the kernels ran)
    "csattn": ("csattn", "search"), "ctkvr": ("ivf", "ctkvr_plan"), "kivf": ("ivf", "kivf_plan"),
    "psa": ("psa", "progressive_plan"), "lfps": ("lfps", "search"), "topk": ("select", "topk_unordered"),
    "saap": ("saap", "saap_plan"),
}


def _count_calls(name: str, monkeypatch) -> list:
    import importlib

    module = importlib.import_module(f"indexer.kernels.{ENTRY[name][0]}")
    entry = getattr(module, ENTRY[name][1])
    calls: list = []
    monkeypatch.setattr(module, ENTRY[name][1], lambda *a, **k: calls.append(1) or entry(*a, **k))
    return calls


def _capture(seed: int):
    from types import SimpleNamespace

    from indexer.base import PrefillCapture

    gen = torch.Generator().manual_seed(seed)
    # a few repeated keys: exact ties among scores, where a race between programs could pick either
    k = torch.randn(1, KVH, N, D, generator=gen)
    k[:, :, 100:110] = k[:, :, 200:210]
    spec = SimpleNamespace(num_layers=1, num_heads=KVH * G, num_kv_heads=KVH, head_dim=D, group_size=G)
    return PrefillCapture(q=torch.randn(1, KVH * G, N, D, generator=gen) * 1.5, k=k,
                          v=torch.randn(1, KVH, N, D, generator=gen), positions=torch.arange(N), spec=spec)


def _plans(method, params, index, cap, order: str) -> list[torch.Tensor]:
    planner = method.open(index, params, DecodeContext(N, cap.spec, 16))
    planner.fused = True
    out = []
    for i, (q, kv) in enumerate(decode_steps(11, KVH, G, D, N, STEPS, (cap.k[0], cap.v[0]), "cpu")):
        with program_order(order, seed=100 + i):
            plan = planner.plan(0, q, kv)
            planner.update(0, kv.loc_k[:, -1:], kv.loc_v[:, -1:], kv.q_pos)
        out.append(plan.positions.clone())
    return out


@pytest.mark.parametrize("name", ["ctkvr", "kivf", "psa", "csattn", "lfps", "topk"])
def test_fused_plans_do_not_depend_on_the_program_order(name, monkeypatch):
    from indexer.base import get_method

    if name == "kivf":
        pytest.importorskip("faiss")
    module, cfg = _tiny_config(name)
    if module is not None:
        monkeypatch.setattr(module, "DEFAULT_CONFIG", cfg)
    monkeypatch.setenv("CTXCACHE_TRITON_SELECT", "1")  # the radix select's kernels, not torch.topk
    calls = _count_calls(name, monkeypatch)
    method = get_method(name)
    params = method.Params(**PARAMS[name])
    cap = _capture(5)
    arrays = method.build(cap, params)
    index = IndexReader(lambda nm, layer: arrays[nm][layer], sorted(arrays)) if method.has_index else None
    runs = {order: _plans(method, params, index, cap, order) for order in ORDERS}
    for order in ORDERS[1:]:
        for step, (want, got) in enumerate(zip(runs["forward"], runs[order])):
            assert torch.equal(want.sort(-1).values, got.sort(-1).values), f"{name} {order} step {step}: another set"
            assert torch.equal(want, got), f"{name} {order} step {step}: another order"
    assert calls and any((p >= 0).any() for p in runs["forward"]), f"{name}: the kernels planned nothing"


def test_saap_plan_does_not_depend_on_the_program_order(tmp_path, monkeypatch):
    """SAAP's rank kernel finishes a row in whichever program takes the row's ticket last: the same
    plan, slot for slot, whatever order its programs run in."""
    from indexer.base import KVView, PrefillCapture, get_method
    from synthetic import Mixture, model_spec, structured_capture, write_saap_model

    spec = model_spec(2, 6, 2, 32, 10000.0, "schedules-saap")
    mix = Mixture(spec, "cpu", seed=0, comps=64)
    model_dir = write_saap_model(tmp_path, spec, mix, layers=[1], clusters=48, hidden=40, sample=2048)
    n = 600
    cap = structured_capture(spec, n + 8, "cpu", mixture=mix)
    method = get_method("saap")
    params = method.Params(model_dir=str(model_dir), nprobe=5, recent=24)
    sub = PrefillCapture(q=cap.q[:, :, :n], k=cap.k[:, :, :n], v=cap.v[:, :, :n], positions=cap.positions[:n], spec=spec)
    arrays = method.build(sub, params)
    index = IndexReader(lambda nm, layer: arrays[nm][layer], sorted(arrays))
    calls = _count_calls("saap", monkeypatch)
    runs = {}
    for order in ORDERS:
        planner = method.open(index, params, DecodeContext(n, spec, 16))
        planner.use_kernels = True
        plans = []
        for i, (s, t) in enumerate([(0, 3), (3, 1)]):
            p = n + s
            kv = KVView(cap.k[1, :, :n], cap.v[1, :, :n], cap.k[1, :, n:p + t], cap.v[1, :, n:p + t],
                        torch.arange(p, p + t))
            with program_order(order, seed=200 + i):
                plans.append(planner.plan(1, cap.q[1, :, p:p + t].reshape(2, 3, t, 32), kv).positions.clone())
        runs[order] = plans
    assert calls and any((p >= 0).any() for p in runs["forward"]), "saap: the kernels planned nothing"
    for order in ORDERS[1:]:
        for step, (want, got) in enumerate(zip(runs["forward"], runs[order])):
            assert torch.equal(want, got), f"saap {order} step {step}"
