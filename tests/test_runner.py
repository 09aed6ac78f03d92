"""decoder/runner.py: the batched decode runner computes what the transformers path computes.

The reference is `decoder.generate` (the model's own modules + the ctxcache attention hook, the
same planner and backend): its greedy tokens, and its logits teacher-forced with the runner's
tokens (`hf_logits`, the same loop as `generate` with the logits kept). CPU tests run the default
model in fp32 with `torch_ref`; the `gpu` tests run random weights of SmolLM2's shape in bf16 with
the `triton` backend, eager vs CUDA-graph replay vs transformers, and check that no step syncs.

Measured (2-core CPU, fp32, SmolLM2-135M, 2026-11-23): runner vs transformers logits max abs
difference 3.4e-5 (logits up to ~37; fused q/k/v and gate/up GEMMs and batched rows sum in another
order), greedy tokens identical; in bf16 on the CPU the two are bitwise equal. Tolerance: 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from conftest import PASSKEY_QUESTION, passkey_document
from decoder.backends import get_backend
from decoder.backends.offload import OffloadValues
from decoder.backends.triton import TritonAttention
from decoder.generate import ContextKV, DecodeStep, generate
from decoder.runner import Runner, graph_safe
from decoder.sampling import gumbel_noise, sample_tokens
from indexer.base import DecodeContext, IndexReader, Planner, PrefillCapture, get_method

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL_FP32 = 1e-4
N_NEW = 10  # "The pass key is 31337": digits are one token each


def capture_ctx(cap: PrefillCapture, n: int | None = None) -> tuple[ContextKV, PrefillCapture]:
    """A ContextKV over the first n tokens of a capture (a causal prefix is a context of its own)."""
    n = n or cap.n_tokens
    sub = PrefillCapture(None if cap.q is None else cap.q[:, :, :n], cap.k[:, :, :n], cap.v[:, :, :n],
                         cap.positions[:n], cap.spec)
    return ContextKV(n, lambda name, layer: (sub.k if name == "kv/k" else sub.v)[layer]), sub


def open_planner(name: str, sub: PrefillCapture, spec, max_local: int, device="cpu", **params):
    method = get_method(name)
    p = method.Params(**params)
    reader = None
    if method.has_index:
        arrays = {k: v.to(device) for k, v in method.build(sub, p).items()}
        reader = IndexReader(lambda nm, layer: arrays[nm][layer], sorted(arrays))
    return (lambda: method.open(reader, p, DecodeContext(sub.n_tokens, spec, max_local))), p


@torch.inference_mode()
def hf_logits(lm, ctx, planner, params, question, tokens, backend) -> torch.Tensor:
    """[len(tokens), V] fp32: `generate`'s forward passes (question, then tokens[:-1] one by one)."""
    from transformers import DynamicCache

    model = lm.model
    dev = next(model.parameters()).device
    step = DecodeStep(lm.spec, ctx, planner, params, backend, dev)
    cache = DynamicCache(config=model.config)
    inp, pos, out = torch.tensor([question], device=dev), ctx.n_tokens, []
    for tok in [None] + list(tokens[:-1]):
        if tok is not None:
            inp = torch.tensor([[tok]], device=dev)
        t = inp.shape[1]
        step.q_pos = torch.arange(pos, pos + t, device=dev)
        o = model(input_ids=inp, position_ids=step.q_pos[None], past_key_values=cache, use_cache=True,
                  logits_to_keep=1, ctx_step=step)
        out.append(o.logits[0, -1].float())
        pos += t
    planner.close()
    return torch.stack(out)


def run_all(runner: Runner, slots: list[int], join: dict[int, tuple] | None = None) -> dict[int, torch.Tensor]:
    """Step until every request finished; {slot: [steps, V] logits}. `join`: step index -> add()
    arguments of a request that joins before that step."""
    logits: dict[int, list] = {s: [] for s in slots}
    i = 0
    while runner.active() or (join and i in join):
        if join and i in join:
            s = runner.add(*join[i])
            logits[s] = []
        for s, _ in runner.step():
            logits[s].append(runner.requests[s].logits.clone())
        i += 1
    return {s: torch.stack(v) for s, v in logits.items()}


def answer(runner: Runner, slot: int, eos) -> list[int]:
    toks = runner.requests[slot].tokens
    return toks[:-1] if toks and toks[-1] in eos else toks


@pytest.fixture(scope="module")
def passkey_cap(lm):
    from decoder.prefill import prefill

    return prefill(lm, lm.context_ids(passkey_document(31337)))


# ---------------------------------------------------------------------------------------------
# CPU: the default model, fp32


@pytest.mark.parametrize("name", ["full", "topk"])
def test_one_request_equals_transformers(lm, passkey_cap, name):
    ctx, sub = capture_ctx(passkey_cap)
    q = lm.question_ids(PASSKEY_QUESTION)
    be = get_backend("torch_ref")
    planner, params = open_planner(name, sub, lm.spec, len(q) + N_NEW)
    want = generate(lm, ctx, planner(), params, q, backend=be, max_tokens=N_NEW)
    runner = Runner(lm, be)
    slot = runner.add(ctx, planner(), params, q, N_NEW)
    got = run_all(runner, [slot])[slot]
    toks = runner.requests[slot].tokens
    assert answer(runner, slot, lm.eos_token_ids) == want.token_ids
    assert "31337" in lm.tokenizer.decode(toks)
    ref = hf_logits(lm, ctx, planner(), params, q, toks, be)
    torch.testing.assert_close(got, ref, atol=ATOL_FP32, rtol=0)
    assert runner.requests[slot].finish_reason in ("stop", "length")
    runner.remove(slot)
    assert runner.requests == {} and runner.step() == []


def test_three_concurrent_requests_equal_their_serial_answers(lm, captured_2k, passkey_cap):
    """Different contexts and methods in one batch, one of them joining a step later: each
    request's tokens are its serial `generate` answer and its logits the transformers path's."""
    n_new = 6
    be = get_backend("torch_ref")
    q_doc = lm.question_ids("What does the scheduler do?")
    q_key = lm.question_ids(PASSKEY_QUESTION)
    cases = []  # (ctx, planner factory, params, question)
    for cap, n, name, q, kw in ((captured_2k, None, "full", q_doc, {}), (passkey_cap, None, "topk", q_key, {}),
                                (captured_2k, 1024, "ctkvr", q_doc, {"k": 128, "list_size": 256})):
        ctx, sub = capture_ctx(cap, n)
        planner, params = open_planner(name, sub, lm.spec, len(q) + n_new, **kw)
        cases.append((ctx, planner, params, q))
    runner = Runner(lm, be, track_fraction=True)
    slots = [runner.add(ctx, planner(), params, q, n_new) for ctx, planner, params, q in cases[:2]]
    ctx, planner, params, q = cases[2]
    logits = run_all(runner, slots, join={1: (ctx, planner(), params, q, n_new)})
    slots = sorted(logits)
    assert len(slots) == 3
    for slot, (ctx, planner, params, q) in zip(slots, cases):
        want = generate(lm, ctx, planner(), params, q, backend=be, max_tokens=n_new)
        assert answer(runner, slot, lm.eos_token_ids) == want.token_ids, slot
        ref = hf_logits(lm, ctx, planner(), params, q, runner.requests[slot].tokens, be)
        torch.testing.assert_close(logits[slot], ref, atol=ATOL_FP32, rtol=0)
        frac = runner.kv_fraction(slot)
        assert (frac == pytest.approx(1.0)) if slot == slots[0] else (0.0 < frac < 0.5), (slot, frac)


@pytest.mark.parametrize("arch", ["llama3_rope_untied_bias", "qwen2"])
def test_other_llama_family_shapes_equal_transformers(arch):
    """Random tiny models: llama3 rope scaling (the rotary module's inv_freq, not the plain
    theta formula), an untied lm_head and attention biases; Qwen2's q/k/v biases, tied head."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention
    from decoder.model import LoadedModel
    from decoder.prefill import prefill
    from synthetic import model_spec

    register_attention()
    torch.manual_seed(0)
    dims = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    if arch == "qwen2":
        model = Qwen2ForCausalLM._from_config(Qwen2Config(**dims, tie_word_embeddings=True),
                                              attn_implementation=ATTN_IMPLEMENTATION)
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    else:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        model = LlamaForCausalLM._from_config(
            LlamaConfig(**dims, rope_theta=500000.0, rope_scaling=rope, attention_bias=True, tie_word_embeddings=False),
            attn_implementation=ATTN_IMPLEMENTATION)
        default = 1.0 / 500000.0 ** (torch.arange(0, 32, 2).float() / 32)
        assert not torch.allclose(model.model.rotary_emb.inv_freq, default)  # the scaling matters here
    for p in model.parameters():  # HF zero-inits biases: make them count
        if p.dim() == 1 and not torch.all(p == 1):
            p.data.normal_(0, 0.5)
    model.eval()
    lm = LoadedModel(spec=model_spec(3, 4, 2, 32, 500000.0, f"tiny-{arch}"), tokenizer=None, model=model)
    g = torch.Generator().manual_seed(1)
    cap = prefill(lm, torch.randint(0, 512, (300,), generator=g).tolist())
    ctx, sub = capture_ctx(cap)
    q = torch.randint(0, 512, (5,), generator=g).tolist()
    be = get_backend("torch_ref")
    for name in ("full", "topk"):
        planner, params = open_planner(name, sub, lm.spec, len(q) + N_NEW)
        want = generate(lm, ctx, planner(), params, q, backend=be, max_tokens=N_NEW)
        runner = Runner(lm, be)
        slot = runner.add(ctx, planner(), params, q, N_NEW)
        got = run_all(runner, [slot])[slot]
        assert runner.requests[slot].tokens == want.token_ids
        ref = hf_logits(lm, ctx, planner(), params, q, want.token_ids, be)
        torch.testing.assert_close(got, ref, atol=ATOL_FP32, rtol=0)


def test_sampling_draws_softmax_reproducibly():
    """Gumbel-max with hashed noise: frequencies follow softmax(logits / T); a row is a function of
    (seed, position) only; temperature-0 rows stay greedy in a sampling batch."""
    torch.manual_seed(0)
    v = 8
    logits = torch.randn(v) * 1.5
    n = 40000
    rows = logits.expand(n, v)
    temp = torch.full((n,), 0.7)
    toks = sample_tokens(rows, temp, torch.full((n,), 123, dtype=torch.long), torch.arange(n), hot=True)
    freq = torch.bincount(toks, minlength=v).float() / n
    want = torch.softmax(logits / 0.7, -1)
    assert (freq - want).abs().max() < 0.01  # 40K draws: standard error <= 0.0025
    a = gumbel_noise(torch.tensor([5, 5, 6]), torch.tensor([100, 101, 100]), 64)
    b = gumbel_noise(torch.tensor([5]), torch.tensor([100]), 64)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    mixed = sample_tokens(logits.expand(2, v), torch.tensor([0.0, 5.0]), torch.tensor([1, 1]), torch.tensor([7, 7]),
                          True)
    assert int(mixed[0]) == int(logits.argmax())


def test_sampled_request_is_the_same_alone_and_in_a_batch(lm, passkey_cap):
    ctx, sub = capture_ctx(passkey_cap)
    q = lm.question_ids(PASSKEY_QUESTION)
    be = get_backend("torch_ref")
    planner, params = open_planner("full", sub, lm.spec, len(q) + 6)
    alone = Runner(lm, be)
    s = alone.add(ctx, planner(), params, q, 6, temperature=1.5, seed=7)
    run_all(alone, [s])
    batch = Runner(lm, be)
    other = batch.add(ctx, planner(), params, lm.question_ids("Say hello."), 6)
    s2 = batch.add(ctx, planner(), params, q, 6, temperature=1.5, seed=7)
    run_all(batch, [other, s2])
    assert batch.requests[s2].tokens == alone.requests[s].tokens
    greedy = Runner(lm, be)
    s3 = greedy.add(ctx, planner(), params, q, 6)
    run_all(greedy, [s3])
    assert greedy.requests[s3].tokens != alone.requests[s].tokens  # T = 1.5 does sample


def test_graph_safety_and_finishing(lm, passkey_cap):
    class Flagged(Planner):
        graph_safe = False

        def plan(self, layer, q, kv):
            return get_method("full").open(None, None, None).plan(layer, q, kv)

    ctx, sub = capture_ctx(passkey_cap)
    cs = get_method("csattn")
    assert not graph_safe(Flagged())
    assert graph_safe(get_method("full").open(None, None, None))
    no_index = IndexReader(lambda name, layer: None, [])  # the planner reads it only when planning
    assert graph_safe(cs.open(no_index, cs.Params(period=1), DecodeContext(sub.n_tokens, lm.spec, 8))) is True
    assert graph_safe(cs.open(no_index, cs.Params(period=4), DecodeContext(sub.n_tokens, lm.spec, 8))) is False
    runner = Runner(lm, get_backend("torch_ref"))
    slot = runner.add(ctx, Flagged(), get_method("full").Params(), lm.question_ids(PASSKEY_QUESTION), 2)
    assert runner.requests[slot].safe is False
    assert len(runner.step()) == 1 and len(runner.step()) == 1 and runner.step() == []
    assert runner.requests[slot].finish_reason == "length" and runner.graph_status == "eager: graphs off"
    with pytest.raises(ValueError):
        runner.add(ctx, Flagged(), get_method("full").Params(), [], 2)


def test_plan_ahead_equals_its_transformers_reference(lm, captured_2k, passkey_cap, saap_small_model):
    """plan_ahead: layers >= 1 of one-token steps are planned from the residual entering the layer
    before, with the predicted own key in the step's slot (decoder/plan_ahead.py's PredictedQueries
    is the same on the transformers path). A batch of five (full is not planned ahead; topk, ctkvr,
    psa and saap, whose classifier de-RoPEs the predicted query at the step's position, are): each
    request's logits equal its reference's, teacher-forced with the runner's tokens, and the sparse
    ones differ from planning with the true query (the test tells the two apart: measured
    2026-11-28, fp32 CPU, max abs logit difference topk 1.6, ctkvr 0.9, psa 1.1, saap 2.3)."""
    from decoder.plan_ahead import PredictedQueries

    n_new = 6
    be = get_backend("torch_ref")
    q_doc = lm.question_ids("What does the scheduler do?")
    q_key = lm.question_ids(PASSKEY_QUESTION)
    cases = []
    for cap, n, name, q, kw in ((captured_2k, None, "full", q_doc, {}),
                                (passkey_cap, None, "topk", q_key, {"ratio": 0.02}),
                                (captured_2k, 1024, "ctkvr", q_doc, {"k": 64, "list_size": 256}),
                                (passkey_cap, None, "psa", q_key, {}),
                                (captured_2k, None, "saap", q_doc, {"model_dir": str(saap_small_model), "nprobe": 2})):
        ctx, sub = capture_ctx(cap, n)
        planner, params = open_planner(name, sub, lm.spec, len(q) + n_new, **kw)
        cases.append((name, ctx, planner, params, q))
    runner = Runner(lm, be, plan_ahead=True)
    slots = [runner.add(ctx, planner(), params, q, n_new) for _, ctx, planner, params, q in cases]
    logits = run_all(runner, slots)
    for slot, (name, ctx, planner, params, q) in zip(slots, cases):
        toks = runner.requests[slot].tokens
        plain = hf_logits(lm, ctx, planner(), params, q, toks, be)
        if name == "full":
            torch.testing.assert_close(logits[slot], plain, atol=ATOL_FP32, rtol=0)
            continue
        ahead = hf_logits(lm, ctx, PredictedQueries(planner(), lm.model, lm.spec, lag=1, own_key="predicted"),
                          params, q, toks, be)
        torch.testing.assert_close(logits[slot], ahead, atol=ATOL_FP32, rtol=0)
        diff = float((logits[slot][1:] - plain[1:]).abs().max())
        print(f"{name}: plan ahead vs true-query plans, max abs logit difference {diff:.3f}")
        assert diff > 0.05, name
    assert all(not h for h in [lay._forward_pre_hooks for lay in lm.model.model.layers])  # closed


def test_plan_ahead_attention_uses_the_true_query_and_key(lm, passkey_cap):
    """A planner that reads the query but plans dense attention: planning ahead then changes
    nothing (the predicted key written into the step's slot for the planner is replaced by the true
    one before the attention reads it; the attention uses the true query), while the queries the
    planner saw for layers >= 1 were the predicted ones (not the true ones) and layer 0's the true."""
    seen: dict[bool, dict[int, list]] = {True: {}, False: {}}

    class Recording(Planner):
        def __init__(self, key):
            self.key = key

        def plan(self, layer, q, kv):
            if q.shape[2] == 1:
                seen[self.key].setdefault(layer, []).append(q.clone())
            return get_method("full").open(None, None, None).plan(layer, q, kv)

    ctx, sub = capture_ctx(passkey_cap)
    q = lm.question_ids(PASSKEY_QUESTION)
    out = {}
    for ahead in (False, True):
        runner = Runner(lm, get_backend("torch_ref"), plan_ahead=ahead)
        slot = runner.add(ctx, Recording(ahead), get_method("full").Params(), q, 4)
        out[ahead] = run_all(runner, [slot])[slot]
    torch.testing.assert_close(out[True], out[False], atol=ATOL_FP32, rtol=0)
    n_layers = len(lm.model.model.layers)
    assert sorted(seen[True]) == list(range(n_layers))
    torch.testing.assert_close(torch.stack(seen[True][0]), torch.stack(seen[False][0]), atol=1e-6, rtol=0)
    for layer in range(1, n_layers):
        assert not torch.allclose(torch.stack(seen[True][layer]), torch.stack(seen[False][layer]), atol=1e-3), layer


def test_plan_ahead_per_request(lm, passkey_cap):
    """`add(plan_ahead=)` overrides the runner's setting for one request (the service plans ahead per
    method): in one batch, a request planned ahead and one not each get the logits of a runner that
    does the same for all its requests, and the two differ (so neither setting leaked into the other)."""
    ctx, sub = capture_ctx(passkey_cap)
    q = lm.question_ids(PASSKEY_QUESTION)
    be = get_backend("torch_ref")
    planner, params = open_planner("topk", sub, lm.spec, len(q) + 4, ratio=0.02)
    alone = {}
    for ahead in (False, True):
        runner = Runner(lm, be, plan_ahead=ahead)
        slot = runner.add(ctx, planner(), params, q, 4)
        alone[ahead] = run_all(runner, [slot])[slot]
    for default in (False, True):
        runner = Runner(lm, be, plan_ahead=default)
        slots = {ahead: runner.add(ctx, planner(), params, q, 4, plan_ahead=ahead) for ahead in (not default, default)}
        got = run_all(runner, list(slots.values()))
        assert runner.requests[slots[True]].ahead and not runner.requests[slots[False]].ahead
        for ahead, slot in slots.items():
            torch.testing.assert_close(got[slot], alone[ahead], atol=ATOL_FP32, rtol=0)
    assert float((alone[True][1:] - alone[False][1:]).abs().max()) > 0.05


@pytest.mark.parametrize("point", ["attention", "delta"])
def test_predicted_queries_points(lm, passkey_cap, point):
    """`PredictedQueries`' other points (benchmarks/bench_early_plans.py's `--points`): layer L's
    one-token plan sees layer L's input RMSNorm, q projection and RoPE applied to, at "attention",
    the residual after layer L - 1's attention (its input plus its self_attn output), at "delta", the
    residual entering layer L - 1 plus the change layer L - 1 made to the step before's last token;
    both recorded here by hooks of the test's own. Neither is the "input" point's prediction (the
    runner's: the residual entering layer L - 1 alone)."""
    from decoder.plan_ahead import PredictedQueries
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    seen: dict[int, list] = {}

    class Recording(Planner):
        def plan(self, layer, q, kv):
            if q.shape[2] == 1:
                seen.setdefault(layer, []).append(q.clone())
            return get_method("full").open(None, None, None).plan(layer, q, kv)

    layers = lm.model.model.layers
    spec = lm.spec
    inputs: dict[int, list] = {}  # layer -> its input's last row, every forward (the question chunk first)
    attn: dict[int, list] = {}  # layer -> its self_attn output, one-token forwards
    rope: dict[int, list] = {}

    def pre(i):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            inputs.setdefault(i, []).append(h[:, -1:])
            if h.shape[1] == 1:
                rope.setdefault(i, []).append(kwargs["position_embeddings"])
        return hook

    def post(i):
        def hook(module, args, output):
            if output[0].shape[1] == 1:
                attn.setdefault(i, []).append(output[0])
        return hook

    hooks = [lay.register_forward_pre_hook(pre(i), with_kwargs=True) for i, lay in enumerate(layers)]
    hooks += [lay.self_attn.register_forward_hook(post(i)) for i, lay in enumerate(layers)]
    ctx, _ = capture_ctx(passkey_cap)
    params = get_method("full").Params()
    try:
        hf_logits(lm, ctx, PredictedQueries(Recording(), lm.model, spec, lag=1, point=point), params,
                  lm.question_ids(PASSKEY_QUESTION), [1, 2, 3], get_backend("torch_ref"))
    finally:
        for h in hooks:
            h.remove()

    def predicted(layer: int, x: torch.Tensor, cos_sin) -> torch.Tensor:
        lay = layers[layer]
        hn = lay.input_layernorm(x)
        d = spec.head_dim
        q = lay.self_attn.q_proj(hn).view(1, 1, -1, d).transpose(1, 2)
        k = lay.self_attn.k_proj(hn).view(1, 1, -1, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, k, *cos_sin)
        return q[0].reshape(spec.num_kv_heads, spec.group_size, 1, d)

    with torch.no_grad():
        for layer in (1, len(layers) // 2, len(layers) - 1):
            assert len(seen[layer]) == 2, layer  # the two one-token steps after the question
            for step, got in enumerate(seen[layer]):
                entering = inputs[layer - 1][step + 1]  # [0]: the question chunk's last token
                if point == "attention":
                    src = entering + attn[layer - 1][step]
                else:
                    src = entering + inputs[layer][step] - inputs[layer - 1][step]
                want = predicted(layer, src, rope[layer][step])
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
                assert (got - predicted(layer, entering, rope[layer][step])).abs().max() > 1e-2, layer


def _scripted(runner: Runner, cases: list, script: dict) -> list[list[tuple[int, int, torch.Tensor]]]:
    """Per step() call, what it returned: (case index, token, logits). `script`: call index ->
    ("add", case index) or ("remove", case index), done before that call."""
    slot_of: dict[int, int] = {}
    log, i = [], 0
    while runner.active() or i in script:
        for what, c in script.get(i, ()):
            if what == "add":
                ctx, planner, params, q, n_new = cases[c]
                slot_of[c] = runner.add(ctx, planner(), params, q, n_new)
            else:
                runner.remove(slot_of[c])
        case = {s: c for c, s in slot_of.items()}
        log.append([(case[s], t, runner.requests[s].logits.clone()) for s, t in runner.step()])
        i += 1
    for s in list(runner.requests):
        runner.remove(s)
    return log


def test_pipelined_steps_equal_plain_steps(lm, captured_2k, passkey_cap):
    """`pipelined`: each step() issues the next one-token step before reading its own tokens. Every
    call returns the same tokens (and logits) as the plain runner through: a request that stops on
    EOS while the step after it is already issued (that step is wasted), one that ends by length,
    one that joins while a step is in flight, and one removed (cancelled) while it is in flight."""
    be = get_backend("torch_ref")
    q_doc = lm.question_ids("What does the scheduler do?")
    q_key = lm.question_ids(PASSKEY_QUESTION)
    cases = []
    for cap, n, name, q, n_new, kw in ((passkey_cap, None, "topk", q_key, 8, {}),
                                       (captured_2k, 1024, "full", q_doc, 3, {}),
                                       (captured_2k, 1024, "ctkvr", q_doc, 5, {"k": 128, "list_size": 256}),
                                       (captured_2k, 1024, "full", q_doc, 9, {})):
        ctx, sub = capture_ctx(cap, n)
        planner, params = open_planner(name, sub, lm.spec, len(q) + n_new, **kw)
        cases.append((ctx, planner, params, q, n_new))
    script = {0: [("add", 0), ("add", 1), ("add", 3)], 2: [("add", 2)], 5: [("remove", 3)]}
    plain = Runner(lm, be, pipelined=False)
    free = _scripted(plain, cases, script)
    eos = {t for c, t, _ in free[3] if c == 0}  # case 0's fourth token: it stops there, mid-batch
    assert len(eos) == 1
    logs = {}
    issued_with_stop = []
    for pipelined in (False, True):
        runner = Runner(lm, be, pipelined=pipelined)
        runner.eos = frozenset(eos)
        if pipelined:  # record the step issued ahead when case 0 stops
            step = runner.step

            def watched():
                got = step()
                if any(runner.requests[s].finish_reason == "stop" for s, _ in got):
                    issued_with_stop.append(runner._issued is not None and len(runner._issued.reqs))
                return got

            runner.step = watched
        logs[pipelined] = _scripted(runner, cases, script)
        assert runner._issued is None and not runner.requests
    plain_log, piped = logs[False], logs[True]
    assert [[(c, t) for c, t, _ in call] for call in piped] == [[(c, t) for c, t, _ in call] for call in plain_log]
    for a, b in zip(piped, plain_log):
        for (_, _, la), (_, _, lb) in zip(a, b):
            torch.testing.assert_close(la, lb, atol=ATOL_FP32, rtol=0)
    tokens = {c: [t for call in plain_log for cc, t, _ in call if cc == c] for c in range(4)}
    assert tokens[0][-1] in eos and len(tokens[0]) == 4  # stopped by EOS
    assert len(tokens[1]) == 3 and len(tokens[2]) == 5  # by length; 2 joined at call 2
    assert len(tokens[3]) == 5  # removed before call 5: tokens of calls 0-4
    assert issued_with_stop and issued_with_stop[0] >= 2  # a step was in flight, the stopped request in it


class InterpretedOffloadV(OffloadValues):
    """`offload_v` whose attention is the triton kernel on any device (on a CPU through Triton's
    interpreter, which tests/conftest.py turns on), so the runner's row cache runs on CPU CI."""

    def run(self, q, kv, plan, sink, window, scale):
        return TritonAttention().run(q, kv, plan, sink, window, scale)


@pytest.mark.parametrize("ahead", [False, True], ids=["attention-fills", "staged"])
def test_row_cache_equals_reading_host_memory(lm, captured_2k, ahead):
    """`cache_rows` under `offload_v`: a one-token step reads the plan rows one of the layer's last
    plans read from the request's row cache in HBM, the rest from the context's values (host memory
    on a GPU). Without plan_ahead the attention kernel fills the cache itself; with plan_ahead and
    `stage_values` the planning step stages each plan's rows into it and the attention only reads
    it. The logits equal the uncached runner's (torch attention: within the fp32 tolerance; a kernel
    serving the neighbouring slot moved them by 1.70), and the caches did serve rows. (The triton
    kernels run through Triton's interpreter here, ~30 s per request of 3 tokens; the GPU test runs
    more variants.)"""
    q = lm.question_ids("What does the scheduler do?")
    out = {}
    for be, cache in ((get_backend("offload_v"), False), (InterpretedOffloadV(), True)):
        runner = Runner(lm, be, plan_ahead=ahead, stage_values=cache and ahead, cache_rows=cache)
        assert runner.cache_rows is cache and runner.stage_values is (cache and ahead)
        ctx, sub = capture_ctx(captured_2k, 1024)
        planner, params = open_planner("ctkvr", sub, lm.spec, len(q) + 3, k=128, list_size=256)
        slot = runner.add(ctx, planner(), params, q, 3)
        out[cache] = run_all(runner, [slot])[slot]
        hits, rows = runner.requests[slot].cache_counts()
        # the second one-token step reads rows the first one's plan had
        assert (0 < hits < rows) if cache else (hits, rows) == (0, 0), (hits, rows)
    torch.testing.assert_close(out[True], out[False], atol=ATOL_FP32, rtol=0)


# ---------------------------------------------------------------------------------------------
# GPU: random weights of SmolLM2's shape, triton backend

# Tolerances of runner vs transformers on the GPU (teacher-forced, per step, ||got - ref|| / ||ref||):
# * fp32 (no TF32): full 1e-4 (only the fused GEMMs' summation order differs); sparse methods 5e-3:
#   a ~1e-7 difference in a score can swap a near-tie of the selection, which moves the output by
#   the (small, nearly equal) masses of the swapped keys (CPU dry run of this test: full 6e-7, topk
#   6e-7, ctkvr 8e-5). Argmax equal wherever the reference's top-2 margin exceeds 1e-2.
# * bf16: the fused GEMMs may pick other cuBLAS kernels than the separate q/k/v/gate/up
#   projections, so an output element can round to the neighbouring bf16 value. Measured on the
#   CPU with every GEMM output of the runner perturbed by up to one bf16 ulp (a pessimistic
#   stand-in): dense 1.8e-2, topk 0.10 (a perturbed query can swap a near-tie in the selection);
#   unperturbed CPU dry run of this test: full 0, topk 1.7e-2, ctkvr 0.
#   Bounds: full 3e-2 with argmax equal where the margin exceeds 0.05 (logits ~2 are quantized to
#   1/64); sparse methods 0.15.
# Graph replay vs eager (same kernels, same inputs): expected equal; allowed 1e-3 (bf16).
TOL = {torch.float32: {"full": 1e-4, "sparse": 5e-3, "margin": 1e-2},
       torch.bfloat16: {"full": 3e-2, "sparse": 0.15, "margin": 0.05}}
REL_GRAPH = 1e-3


def _rel(a, b):
    return ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-12))


def _same_decode(got: torch.Tensor, ref: torch.Tensor, rel: float, margin: float) -> int:
    """Compare step by step until the first token that differs (allowed only where the reference's
    top-2 margin is below `margin`); returns the steps compared."""
    for i in range(min(len(got), len(ref))):
        assert _rel(got[i], ref[i]) <= rel, (i, float(_rel(got[i], ref[i])))
        if got[i].argmax() != ref[i].argmax():
            top = ref[i].topk(2).values
            assert float(top[0] - top[1]) < margin, (i, float(top[0] - top[1]))
            return i + 1
    return min(len(got), len(ref))


_GPU: dict = {}


def _drain(runner, slots) -> tuple[list[torch.Tensor], list[list[int]], list[str]]:
    """Step the runner until no request is active: per slot its logits [steps, V] and tokens, and
    how each step ran (`graph_status`)."""
    logits = {s: [] for s in slots}
    status = []
    while runner.active():
        for s, _ in runner.step():
            logits[s].append(runner.requests[s].logits.clone())
        status.append(runner.graph_status)
    return [torch.stack(logits[s]) for s in slots], [runner.requests[s].tokens for s in slots], status


def _replayed(runner, reqs, n_new: int, label) -> tuple[list, list, list[int]]:
    """Add `reqs` (as `_gpu_requests` lists them) to the runner, run the question and the eager
    warm-up step, then drain with the sync check on: (logits, tokens, slots). The first one-token
    step after the warm-up is captured and every later one replayed."""
    slots = [runner.add(c, planner(), params, q, n_new) for _, c, planner, params, q in reqs]
    runner.step()
    runner.step()
    runner.sync_check = True
    got_logits, got_tokens, status = _drain(runner, slots)
    assert status[0] == "captured" and set(status[1:]) == {"replayed"}, (label, status)
    return got_logits, got_tokens, slots


def _same_runs(want: tuple, got: tuple) -> None:
    """Two runs' (logits, tokens) per request: equal tokens, logits within the graph tolerance."""
    for want_l, toks_w, got_l, toks_g in zip(*want, *got):
        assert toks_w == toks_g
        assert float(_rel(got_l, want_l).max()) <= REL_GRAPH


def gpu_setup(dtype):
    """(LoadedModel, (ContextKV, capture)) of a random SmolLM2-shaped model in `dtype` on CUDA and a
    1,024-token context prefilled by it (built once per dtype)."""
    if dtype in _GPU:
        return _GPU[dtype]
    import dataclasses

    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention
    from decoder.model import LoadedModel
    from decoder.prefill import prefill
    from synthetic import smollm2_spec

    register_attention()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, max_position_embeddings=8192)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype)
    lm = LoadedModel(spec=dataclasses.replace(smollm2_spec(30), dtype=str(dtype).removeprefix("torch.")),
                     tokenizer=None, model=model.eval(), eos_token_ids=())
    g = torch.Generator().manual_seed(1)
    cap = prefill(lm, torch.randint(0, 49152, (1024,), generator=g).tolist())
    cap = PrefillCapture(cap.q.cuda(), cap.k.cuda(), cap.v.cuda(), cap.positions.cuda(), cap.spec)
    _GPU[dtype] = (lm, capture_ctx(cap))
    return _GPU[dtype]


def _gpu_requests(lm, gpu_ctx, n_new, names=("full", "topk", "ctkvr")):
    ctx, sub = gpu_ctx
    g = torch.Generator().manual_seed(2)
    out = []
    for name in names:
        q = torch.randint(0, 49152, (12,), generator=g).tolist()
        planner, params = open_planner(name, sub, lm.spec, len(q) + n_new, device="cuda")
        out.append((name, ctx, planner, params, q))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_graph_replay_equals_eager_equals_transformers(dtype):
    """Three requests (full, topk, ctkvr) in one batch: the CUDA-graph runner, the eager runner and
    the transformers path agree (tolerances above); the graph is captured once and replayed; the
    requests' attention on parallel side streams (the default) equals it on one stream."""
    lm, gpu_ctx = gpu_setup(dtype)
    n_new = 10
    be = get_backend("triton")
    reqs = _gpu_requests(lm, gpu_ctx, n_new)
    runs = {}
    for graphs, parallel in ((True, True), (False, True), (True, False)):
        runner = Runner(lm, be, graphs=graphs, parallel=parallel)
        slots = [runner.add(ctx, planner(), params, q, n_new) for _, ctx, planner, params, q in reqs]
        got_logits, got_tokens, status = _drain(runner, slots)
        runs[graphs, parallel] = (got_logits, got_tokens)
        if graphs:  # question chunks, one eager warm-up step, a capture, then replays
            assert status[:3] == ["", "eager: warming up", "captured"] and set(status[3:]) == {"replayed"}, status
            assert runner.captures == 1
            runner.remove(slots[-1])  # a request of the captured batch ends: the graph goes with it
            assert runner._graph is None and slots[-1] not in runner.requests
            for s in slots[:-1]:
                runner.remove(s)
            assert not runner.requests
        del runner
    (g_logits, g_toks), (e_logits, _) = runs[True, True], runs[False, True]
    # the requests' attention on parallel side streams computes what it computes on one stream
    for (name, *_), par, ser in zip(reqs, g_logits, runs[True, False][0]):
        n_cmp = _same_decode(par, ser, REL_GRAPH, 1e-2)
        assert n_cmp >= 1, name
        print(f"{dtype} {name}: parallel vs serial streams max rel {float(_rel(par[:n_cmp], ser[:n_cmp]).max()):.2e}")
    tol = TOL[dtype]
    for (name, ctx, planner, params, q), got, eager, toks in zip(reqs, g_logits, e_logits, g_toks):
        # (CTkvr in bf16 failed this until its plan rows got a canonical order: its question chunk's
        # logits were 1.27e-2 apart between two identical eager runs; benchmarks/RESULTS.md,
        # "Reproducible plans")
        n_cmp = _same_decode(got, eager, REL_GRAPH, 1e-2)
        assert n_cmp >= 1, name
        print(f"{dtype} {name}: graph vs eager max rel {float(_rel(got[:n_cmp], eager[:n_cmp]).max()):.2e} "
              f"over {n_cmp} steps")
        ref = hf_logits(lm, ctx, planner(), params, q, toks, be)  # teacher-forced with the graph run's tokens
        rel = _rel(got, ref)
        print(f"{dtype} {name}: runner vs transformers max rel {float(rel.max()):.2e}, "
              f"max abs {float((got - ref).abs().max()):.3e}")
        assert (rel <= tol["full" if name == "full" else "sparse"]).all(), (name, rel)
        if name == "full" or dtype == torch.float32:
            top = ref.topk(2, dim=-1).values
            sure = (top[:, 0] - top[:, 1]) > tol["margin"]
            assert torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure]), name


@pytest.mark.gpu
def test_gpu_plan_ahead_on_side_streams_equals_its_reference():
    """plan_ahead on CUDA (fp32): the prediction and plan(L) run on a side stream during layer L - 1.
    Four requests (full, topk, ctkvr, psa): the CUDA-graph runner with parallel attention, the eager
    runner and the graph runner on one attention stream agree, replays make no host sync, and each
    sparse request's logits equal the transformers path with `PredictedQueries` (the same plans
    made there in order, on one stream) within the sparse tolerance above; full's equal its plain
    reference (it is not planned ahead)."""
    from decoder.plan_ahead import PredictedQueries

    lm, gpu_ctx = gpu_setup(torch.float32)
    n_new = 8
    be = get_backend("triton")
    reqs = _gpu_requests(lm, gpu_ctx, n_new, names=("full", "topk", "ctkvr", "psa"))
    runs = {}
    for graphs, parallel in ((True, True), (False, True), (True, False)):
        runner = Runner(lm, be, graphs=graphs, parallel=parallel, plan_ahead=True)
        slots = [runner.add(ctx, planner(), params, q, n_new) for _, ctx, planner, params, q in reqs]
        runner.step()
        runner.step()
        runner.sync_check = True
        got_logits, got_tokens, status = _drain(runner, slots)
        if graphs:
            assert status[0] == "captured" and set(status[1:]) == {"replayed"}, status
        runs[graphs, parallel] = (got_logits, got_tokens)
        for s in slots:
            runner.remove(s)
    g_logits, g_toks = runs[True, True]
    for other in ((False, True), (True, False)):
        for (name, *_), got, ref in zip(reqs, g_logits, runs[other][0]):
            assert _same_decode(got, ref, REL_GRAPH, 1e-2) >= 1, (name, other)
    for (name, ctx, planner, params, q), got, toks in zip(reqs, g_logits, g_toks):
        p = planner() if name == "full" else PredictedQueries(planner(), lm.model, lm.spec, lag=1, own_key="predicted")
        ref = hf_logits(lm, ctx, p, params, q, toks, be)[2:]  # the steps _drain saw
        rel = _rel(got, ref)
        print(f"plan ahead {name}: runner vs transformers max rel {float(rel.max()):.2e}")
        assert (rel <= TOL[torch.float32]["full" if name == "full" else "sparse"]).all(), (name, rel)


@pytest.mark.gpu
def test_gpu_solo_psa_request_takes_its_planners_attention(monkeypatch):
    """A psa request alone in its steps (fp32, CUDA graphs): its planner attends the plan it makes
    (`KVView.attend_scale`, psa's fused plan: `Plan.attended`) and the triton backend returns that; the
    logits equal those of the backend running every plan itself (`take_attended=False`) within the
    graph tolerance, and the same tokens. Beside another request, nothing is attended by a planner."""
    import indexer.kernels.psa as kp
    from decoder.kernels.attention import KernelConfig

    lm, gpu_ctx = gpu_setup(torch.float32)
    n_new = 6
    reqs = _gpu_requests(lm, gpu_ctx, n_new, names=("psa", "full"))
    attended = []
    plan = kp.progressive_plan

    def counting(q, *a, **k):  # (query tokens, whether the plan attended) per plan made in Python
        res = plan(q, *a, **k)
        attended.append((q.shape[2], res.out is not None))
        return res

    monkeypatch.setattr(kp, "progressive_plan", counting)
    runs = {}
    for take in (True, False):
        runner = Runner(lm, TritonAttention(KernelConfig(take_attended=take)))
        _, ctx, planner, params, q = reqs[0]
        slot = runner.add(ctx, planner(), params, q, n_new)
        attended.clear()
        runs[take] = _drain(runner, [slot])
        decode = [a for t, a in attended if t == 1]  # the question's chunk (T = 12) is never attended
        assert decode and all(a == take for a in decode) and not any(a for t, a in attended if t > 1), (take, attended)
    (got,), (toks,), status = runs[True]
    (ref,), (ref_toks,), _ = runs[False]
    assert "captured" in status and "replayed" in status, status
    assert _same_decode(got, ref, REL_GRAPH, 1e-2) == len(ref) and toks == ref_toks
    runner = Runner(lm, TritonAttention())
    slots = [runner.add(ctx, planner(), params, q, n_new) for _, ctx, planner, params, q in reqs]
    attended.clear()
    _drain(runner, slots)
    assert attended and not any(a for _, a in attended)


@pytest.mark.gpu
def test_gpu_pipelined_replays_equal_plain_ones():
    """On CUDA the runner issues each one-token step before it reads the tokens of the step before
    (`pipelined`, the default there). Three requests (full, topk, ctkvr), fp32: the same tokens and
    logits as the plain runner, replays without a host sync, a step in flight after each call, and a
    request removed while its step is in flight leaves the others' answers as they were."""
    lm, gpu_ctx = gpu_setup(torch.float32)
    be = get_backend("triton")
    n_new = 10
    reqs = _gpu_requests(lm, gpu_ctx, n_new)
    runs = {}
    for pipelined in (False, True):
        runner = Runner(lm, be, pipelined=pipelined)
        runner.eos = frozenset()  # every request runs to its length: the batches match call for call
        slots = [runner.add(ctx, planner(), params, q, n_new) for _, ctx, planner, params, q in reqs]
        runner.step()
        runner.step()
        runner.sync_check = True
        logits: dict[int, list] = {s: [] for s in slots}
        status, in_flight, i = [], [], 0
        while runner.active():
            if i == 3:
                runner.remove(slots[1])
            for s, _ in runner.step():
                logits[s].append(runner.requests[s].logits.clone())
            status.append(runner.graph_status)
            in_flight.append(runner._issued is not None)
            i += 1
        runs[pipelined] = ({s: torch.stack(v) for s, v in logits.items()},
                           {s: runner.requests[s].tokens for s in (slots[0], slots[2])})
        assert status[0] == "captured" and "eager: warming up" in status and status[-1] == "replayed", status
        assert all(in_flight[:-1]) == pipelined and not in_flight[-1]
        for s in (slots[0], slots[2]):
            runner.remove(s)
        assert runner._issued is None and runner._graph is None
    (plain_logits, plain_toks), (piped_logits, piped_toks) = runs[False], runs[True]
    assert piped_toks == plain_toks
    for s in plain_logits:
        assert len(piped_logits[s]) == len(plain_logits[s])
        assert _same_decode(piped_logits[s], plain_logits[s], REL_GRAPH, 1e-2) == len(plain_logits[s]), s


@pytest.mark.gpu
def test_gpu_steps_make_no_host_sync():
    """After the first two steps (question chunks, then the eager warm-up that may allocate lazily),
    eager steps and graph replays run under set_sync_debug_mode("error"); the capture itself fails on
    any sync (the runner would then say `eager: capture failed`)."""
    lm, gpu_ctx = gpu_setup(torch.bfloat16)
    be = get_backend("triton")
    for graphs in (True, False):
        runner = Runner(lm, be, graphs=graphs, track_fraction=True)
        for _, ctx, planner, params, q in _gpu_requests(lm, gpu_ctx, 8):
            runner.add(ctx, planner(), params, q, 8)
        runner.step()
        runner.step()
        runner.sync_check = True
        statuses = []
        while runner.active():
            runner.step()
            statuses.append(runner.graph_status)
        if graphs:
            assert statuses[0] == "captured" and set(statuses[1:]) == {"replayed"}, statuses
        else:
            assert set(statuses) == {"eager: graphs off"}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["offload", "offload_v"])
def test_gpu_offload_reads_host_memory_in_place_and_equals_triton(backend):
    """The offload backends: the context's K/V (offload_v: V) pinned in host memory and read in place
    by the kernels through mapped views (decoder/backends/offload.py), index arrays on the GPU, the
    runner's row cache on (its default there). The batch (full, topk, ctkvr) is captured and
    replayed like one over a GPU-resident context, no step syncs, and its tokens and logits equal the triton backend's over the same context on the GPU
    (the same kernels read the same bytes; fp32, where the fused plans are reproducible run to run)."""
    from decoder.backends.offload import mapped

    lm, (ctx, sub) = gpu_setup(torch.float32)
    host = get_backend(backend).host_arrays
    arrays = {}
    for name, t in (("kv/k", sub.k), ("kv/v", sub.v)):
        pinned = t.cpu().pin_memory()
        arrays[name] = mapped(pinned) if name in host else t
        assert arrays[name].is_cuda and (name not in host or arrays[name].data_ptr() == pinned.data_ptr())
    host_ctx = ContextKV(sub.n_tokens, lambda name, layer: arrays[name][layer])
    n_new = 8
    runs = {}
    for name, c in (("triton", ctx), (backend, host_ctx)):
        runner = Runner(lm, get_backend(name))
        got_logits, got_tokens, slots = _replayed(runner, _gpu_requests(lm, (c, sub), n_new), n_new, name)
        runs[name] = (got_logits, got_tokens)
        for s in slots:
            runner.remove(s)
    _same_runs(runs["triton"], runs[backend])


@pytest.mark.gpu
def test_gpu_row_cache_equals_host_reads():
    """The row cache on CUDA under offload_v (`cache_rows`, the default there): without plan_ahead
    (the default) the attention reads the rows the layer's last plans read from the cache and fills
    it; with plan_ahead the planning side stream stages each plan's rows into it (`stage_values`, the
    default then) and the attention only reads it, or, not staging, fills it itself. Tokens and
    logits equal the same runner reading host memory in place (fp32: the same kernels over the same
    bytes), steps replay without a host sync, and the caches served rows in the replayed steps."""
    from decoder.backends.offload import mapped

    lm, (ctx, sub) = gpu_setup(torch.float32)
    arrays = {"kv/k": sub.k, "kv/v": mapped(sub.v.cpu().pin_memory())}
    host_ctx = ContextKV(sub.n_tokens, lambda name, layer: arrays[name][layer])
    n_new = 8
    be = get_backend("offload_v")
    runs = {}
    variants = [(True, None, False), (True, None, None), (True, False, None),
                (False, None, False), (False, None, None)]  # (plan_ahead, stage_values, cache_rows)
    for ahead, stage, cache in variants:
        runner = Runner(lm, be, plan_ahead=ahead, stage_values=stage, cache_rows=cache)
        assert runner.cache_rows is (cache is None) and runner.stage_values is (cache is None and stage is None)  # if ahead
        reqs = _gpu_requests(lm, (host_ctx, sub), n_new, names=("topk", "ctkvr", "psa"))
        got_logits, got_tokens, slots = _replayed(runner, reqs, n_new, (ahead, stage, cache))
        runs[ahead, stage, cache] = (got_logits, got_tokens)
        counts = torch.tensor([runner.requests[s].cache_counts() for s in slots]).sum(0).tolist()
        assert (0 < counts[0] < counts[1]) if runner.cache_rows else counts == [0, 0], counts
        for s in slots:
            runner.remove(s)
    for variant in variants[1:3]:
        _same_runs(runs[variants[0]], runs[variant])
    _same_runs(runs[variants[3]], runs[variants[4]])
