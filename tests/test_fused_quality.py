"""Quality of the fused GPU searches on real captured tensors: each method's fused plan (its Triton
kernels, run here through Triton's interpreter on CPU tensors; compiled on a GPU) against its torch
plan, on the default model's post-RoPE Q/K/V over the ~2K-token document, for a few layers and decode
steps. The kernel test files check the same on random inputs; this is issue 12's "quality is
unchanged" on the tensors the methods' own quality numbers come from.

Per method: the fraction of each plan row the two paths share (positions as sets) and the recall of
the exact top-5% attention mass (group-pooled, over the context positions) by frame ∪ plan. The
fused paths select the same sets: measured agreement 1.0 for csattn, ctkvr, kivf, psa and lfps, and
the same recall (0.569, 1.0, 0.927, 0.928, 0.827; psa's fixed budget at rho 5%, `rule="budget"`: agreement 1.0,
recall 0.568, its 4 blocks against the progressive rule's uncapped set); saap's kernels read the classifier in bf16 (its
torch path in fp32), which can move a bucket at the edge of the top-ℓ: agreement 0.9999 (min 0.998
per row), recall 0.829 on both paths.
"""

from __future__ import annotations

import pytest
import torch

from evaluation.fidelity import build_index, truncate_capture
from indexer.base import DecodeContext, KVView, frame_bounds, get_method

pytest.importorskip("triton", reason="triton is not installed")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = (1, 14, 27)  # SmolLM2 has 30; layer 0 is SAAP's dense layer
STEPS = 3
M_LOCAL = 8


def _fused_switch(planner, on: bool) -> None:
    for attr in ("fused", "use_kernels"):
        if hasattr(planner, attr):
            setattr(planner, attr, on)


def _rows(pos: torch.Tensor) -> list[set[int]]:
    flat = pos.reshape(-1, pos.shape[-1])
    return [set(r[r >= 0].tolist()) for r in flat]


def _recall(q, kv, plan_pos, sink, window) -> float:
    """Mean over KV heads of |top-5% ∩ (frame ∪ plan)| / |top-5%|, exact group attention mass over the
    context positions."""
    kvh, g, t, d = q.shape
    n = kv.ctx_k.shape[1]
    s = torch.einsum("hgd,hnd->hgn", q[:, :, 0].float(), kv.ctx_k.float()) * d ** -0.5
    mass = torch.softmax(s, -1).sum(1)  # [KVH, N]
    k = max(1, round(0.05 * n))
    top = mass.topk(k, -1).indices
    s_end, w_lo = frame_bounds(kv.q_pos, n, sink, window)
    frame = set(range(int(s_end))) | set(range(int(w_lo[0]), n))
    rows = _rows(plan_pos[:, :1]) if plan_pos is not None else [set(range(n))] * kvh
    return sum(len(set(top[h].tolist()) & (rows[h] | frame)) / k for h in range(kvh)) / kvh


def _params(name, saap_model):
    if name == "psa-budget":  # psa's fixed budget at rho 5% (its select writes the plan)
        m = get_method("psa")
        return m, m.Params(rule="budget", max_ratio=0.05)
    m = get_method(name)
    if name == "saap":
        return m, m.Params(model_dir=str(saap_model), nprobe=8)
    return m, m.Params()


ENTRY = {  # the kernel module and the entry point each fused planner calls (counted: the fused path ran)
    "csattn": ("csattn", "search"), "ctkvr": ("ivf", "ctkvr_plan"), "kivf": ("ivf", "kivf_plan"),
    "psa": ("psa", "progressive_plan"), "lfps": ("lfps", "search"), "saap": ("saap", "saap_plan"),
}


@pytest.mark.parametrize("name", ["csattn", "ctkvr", "kivf", "psa", "psa-budget", "lfps", "saap"])
def test_fused_plans_equal_torch_plans_on_captured_tensors(name, captured_2k, request, monkeypatch):
    import importlib

    saap_model = request.getfixturevalue("saap_small_model") if name == "saap" else None
    module_name, entry_name = ENTRY[name.split("-")[0]]
    module = importlib.import_module(f"indexer.kernels.{module_name}")
    entry = getattr(module, entry_name)
    calls = []
    monkeypatch.setattr(module, entry_name, lambda *a, **k: calls.append(1) or entry(*a, **k))
    cap = captured_2k
    n = cap.n_tokens - STEPS
    method, params = _params(name, saap_model)
    index = build_index(method, params, truncate_capture(cap, n))
    ctx = DecodeContext(n, cap.spec, M_LOCAL)
    ref, fused = method.open(index, params, ctx), method.open(index, params, ctx)
    _fused_switch(ref, False)
    _fused_switch(fused, True)
    sink, window = params.frame(n)
    kvh, g, d = cap.spec.num_kv_heads, cap.spec.group_size, cap.spec.head_dim
    agree, rec_ref, rec_fused = [], [], []
    for step in range(STEPS):
        pos = n + step
        for layer in LAYERS:
            q = cap.q[layer, :, pos:pos + 1].reshape(kvh, g, 1, d)
            loc_k = torch.zeros(kvh, M_LOCAL, d)
            loc_v = torch.zeros(kvh, M_LOCAL, d)
            loc_k[:, :step + 1] = cap.k[layer, :, n:pos + 1]
            loc_v[:, :step + 1] = cap.v[layer, :, n:pos + 1]
            kv = KVView(cap.k[layer, :, :n], cap.v[layer, :, :n], loc_k, loc_v, torch.tensor([pos]))
            a, b = ref.plan(layer, q, kv), fused.plan(layer, q, kv)
            if a.positions is None or b.positions is None:  # a dense plan (saap's untrained layers)
                assert a.positions is None and b.positions is None
                continue
            for ra, rb in zip(_rows(a.positions), _rows(b.positions)):
                agree.append(1.0 if not ra and not rb else len(ra & rb) / max(len(ra), 1))
            rec_ref.append(_recall(q, kv, a.positions, sink, window))
            rec_fused.append(_recall(q, kv, b.positions, sink, window))
            for planner in (ref, fused):
                planner.update(layer, loc_k[:, step:step + 1], loc_v[:, step:step + 1], kv.q_pos)
    assert agree, "no sparse plan was compared"
    assert calls, "the fused path did not run"
    mean_agree = sum(agree) / len(agree)
    r_ref, r_fused = sum(rec_ref) / len(rec_ref), sum(rec_fused) / len(rec_fused)
    print(f"{name}: plan agreement {mean_agree:.4f} (min {min(agree):.3f}), recall torch {r_ref:.4f} fused {r_fused:.4f}")
    if name == "saap":
        assert mean_agree >= 0.95 and abs(r_ref - r_fused) <= 0.02
    else:
        assert mean_agree >= 0.999 and abs(r_ref - r_fused) <= 0.005
