"""The runner's fused layer ops (`decoder/kernels/layer.py`) against the torch functions they replace
(`decoder.layers.rms_norm`, `apply_rope`, SiLU·up), and the runner with them against the runner
without them. On a machine without CUDA the kernels run through Triton's interpreter (CPU tensors,
tests/conftest.py); the GPU run of tests/test_runner.py covers them compiled (the runner uses them
by default on CUDA) against transformers.

What must be exact: the residual add and RoPE (the kernels round where torch's ops round). What may
differ: RMSNorm's sum of squares (reduction order) and SiLU's exp (the kernel's exp), by at most one
rounding of the output dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

layer = pytest.importorskip("decoder.kernels.layer", reason="triton is not installed")
from decoder.layers import apply_rope, rms_norm, rope_cos_sin  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _within_one_rounding(got: torch.Tensor, want: torch.Tensor, fp32_ulps: float = 4.0) -> None:
    """Every element equal or one rounding of the output dtype apart (fp32: a few units in the last
    place, from the sum's order, 1/sqrt against rsqrt and exp), relative to its size; and for fp16 /
    bf16 most elements equal (a wrong formula would move nearly all of them)."""
    g, w = got.double().cpu(), want.double().cpu()
    tol = ULP[want.dtype] * w.abs().clamp_min(1e-3) * (fp32_ulps + 0.01 if want.dtype == torch.float32 else 1.01)
    assert ((g - w).abs() <= tol).all(), float(((g - w).abs() / tol).max())
    if want.dtype != torch.float32:  # fp32 keeps the reduction order's last-bit differences
        assert (g == w).double().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c", [48, 64, 300])
def test_rms_norm_with_and_without_the_residual_add(dtype, c):
    gen = torch.Generator().manual_seed(c)
    x, res = (torch.randn(5, c, generator=gen) * 3).to(dtype), torch.randn(5, c, generator=gen).to(dtype)
    w = (torch.rand(c, generator=gen) + 0.5).to(dtype)
    got = layer.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    _within_one_rounding(got, rms_norm(x, w, 1e-5))
    normed, summed = layer.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5, res.to(DEVICE))
    assert torch.equal(summed.cpu(), res + x)  # the residual stream: exact
    _within_one_rounding(normed, rms_norm(res + x, w, 1e-5))
    rows = torch.randn(4, 3 * c, generator=gen).to(dtype)[:, :c]  # strided rows (a view of wider rows)
    _within_one_rounding(layer.rms_norm(rows.to(DEVICE), w.to(DEVICE), 1e-6), rms_norm(rows, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h,kvh,d", [(4, 2, 32), (9, 3, 64), (2, 1, 128)])
def test_rope_of_q_and_k_is_exact(dtype, h, kvh, d):
    gen = torch.Generator().manual_seed(h * d)
    s = 3
    qkv = torch.randn(s, (h + 2 * kvh) * d, generator=gen).to(dtype)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    cos, sin = rope_cos_sin(torch.tensor([7, 300, 4096]), inv_freq, 1.0, dtype)
    q, k = layer.rope_qk(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), h, kvh, d)
    want_q = apply_rope(qkv[:, :h * d].view(s, h, d), cos, sin)
    want_k = apply_rope(qkv[:, h * d:(h + kvh) * d].view(s, kvh, d), cos, sin)
    assert torch.equal(q.cpu(), want_q) and torch.equal(k.cpu(), want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_writes_each_rows_key_and_value_into_its_slot(dtype):
    """`slots`: the RoPE launch also stores row s's rotated key and its value into its request's
    layer buffers ([KVH, M, D], M per request) at its slot, exactly, and nothing else there."""
    h, kvh, d, n_layers = 4, 2, 32, 3
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, (h + 2 * kvh) * d, generator=gen).to(dtype).to(DEVICE)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    cos, sin = (x.to(DEVICE) for x in rope_cos_sin(torch.tensor([7, 300, 4096]), inv_freq, 1.0, dtype))
    # rows 0 and 1: one request (M = 6, slots 2 and 3); row 2: another (M = 9, slot 8)
    bufs = [torch.full((2, n_layers, kvh, m, d), -7.0, dtype=dtype, device=DEVICE) for m in (6, 9)]
    base = torch.tensor([[[b[i].data_ptr() + lyr * b[i].stride(0) * b.element_size() for lyr in range(n_layers)]
                          for i in range(2)] for b in (bufs[0], bufs[0], bufs[1])], dtype=torch.int64, device=DEVICE)
    slot = torch.tensor([2, 3, 8], device=DEVICE)
    rows = layer.SlotRows(base, slot * d, torch.tensor([6 * d, 6 * d, 9 * d], device=DEVICE))
    before = [b.clone() for b in bufs]
    q, k = layer.rope_qk(qkv, cos, sin, h, kvh, d, rows, layer=1)
    q0, k0 = layer.rope_qk(qkv, cos, sin, h, kvh, d)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    v = qkv[:, (h + kvh) * d:].view(3, kvh, d)
    for row, (b, sl) in enumerate(((0, 2), (0, 3), (1, 8))):
        before[b][0, 1, :, sl] = k[row]
        before[b][1, 1, :, sl] = v[row]
    assert torch.equal(bufs[0], before[0]) and torch.equal(bufs[1], before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_times_up(dtype):
    gen = torch.Generator().manual_seed(2)
    gu = (torch.randn(3, 2 * 1500, generator=gen) * 4).to(dtype)  # I = 1500: two blocks, a ragged one
    gate, up = gu.chunk(2, dim=-1)
    # fp32: the GPU's exp is an approximate instruction (a few ulps from libm's)
    _within_one_rounding(layer.silu_mul(gu.to(DEVICE)), F.silu(gate) * up, fp32_ulps=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_runner_with_fused_layer_ops_equals_the_torch_functions(dtype, monkeypatch):
    """A random tiny Llama (3 layers, GQA, head_dim 32): the runner with the fused ops (the RoPE
    launch also writing the step's K/V slots) decodes the same greedy tokens as without them, for two
    requests with buffers of different lengths in one batch, and its logits agree to the ops' rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention
    from decoder.backends import get_backend
    from decoder.generate import ContextKV
    from decoder.model import LoadedModel
    from decoder.prefill import prefill
    from decoder.runner import Runner
    from indexer.base import DecodeContext, get_method
    from synthetic import model_spec

    register_attention()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, rope_theta=10000.0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype).eval().to(DEVICE)
    lm = LoadedModel(spec=model_spec(3, 4, 2, 32, 10000.0, f"tiny-fused-{dtype}"), tokenizer=None, model=model)
    g = torch.Generator().manual_seed(1)
    cap = prefill(lm, torch.randint(0, 512, (200,), generator=g).tolist())
    k_ctx, v_ctx = cap.k.to(DEVICE), cap.v.to(DEVICE)
    ctx = ContextKV(200, lambda nm, layer_i: (k_ctx if nm == "kv/k" else v_ctx)[layer_i])
    question = torch.randint(0, 512, (6,), generator=g).tolist()
    full = get_method("full")
    params = full.Params()
    calls = []
    for name in ("rms_norm", "rope_qk", "silu_mul"):
        fn = getattr(layer, name)
        monkeypatch.setattr(layer, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
    other = torch.randint(0, 512, (4,), generator=g).tolist()
    out = {}
    for fused in (False, True):
        runner = Runner(lm, get_backend("torch_ref"), fused_layer=fused, graphs=False)
        assert (runner.layer_kernels is not None) == fused
        slots = [runner.add(ctx, full.open(None, params, DecodeContext(200, lm.spec, len(qq) + n)), params, qq, n)
                 for qq, n in ((question, 6), (other, 9))]
        logits = {s: [] for s in slots}
        steps = 0
        while runner.active():
            for s, _ in runner.step():
                logits[s].append(runner.requests[s].logits.clone())
            steps += 1
        out[fused] = [(runner.requests[s].tokens, torch.stack(logits[s])) for s in slots]
    for (tok_f, lg_f), (tok_t, lg_t), n in zip(out[True], out[False], (6, 9)):
        assert tok_f == tok_t and len(tok_f) == n
        # fp32: the ops' fp32 rounding; bf16: a bf16 rounding in a norm moves a logit by ~1e-2 at most here
        atol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(lg_f, lg_t, atol=atol, rtol=0)
    # the fused path ran: per layer two norms, one RoPE, one SiLU·up, and the final norm, per forward
    # (the two questions run one at a time, then one-token steps of both together)
    forwards = steps + 1
    assert calls.count("rope_qk") == 3 * forwards and calls.count("rms_norm") == (2 * 3 + 1) * forwards
