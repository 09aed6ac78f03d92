"""The decode worker's batched path (`decode_runner="batched"`, decoder/runner.py): concurrent
completions on different contexts with different methods are stepped together and answer exactly
what each would alone (greedy), over REST with the real default model and a real Redis."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import PASSKEY_QUESTION, natural_document, passkey_document
from service.app import create_app
from test_api import _settings, wait_ready

pytestmark = pytest.mark.slow


def _serial(lm, text: str, method: str, params: dict, question: str, max_tokens: int) -> list[int]:
    """The same completion on the library path, one request alone (decoder.generate)."""
    from decoder.generate import ContextKV, generate
    from decoder.prefill import prefill
    from indexer.base import DecodeContext, get_method

    ids = lm.context_ids(text)
    cap = prefill(lm, ids)
    m = get_method(method)
    p = m.Params(**params)
    q = lm.question_ids(question)
    planner = m.open(None, p, DecodeContext(len(ids), lm.spec, len(q) + max_tokens))
    ctx = ContextKV(len(ids), lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    return generate(lm, ctx, planner, p, q, max_tokens=max_tokens).token_ids


def test_concurrent_requests_are_batched_and_answer_like_serial_ones(tmp_path, redis_prefix, lm):
    docs = {"pass": passkey_document(27182, depth=0.6), "prose": natural_document(400)}
    asks = [("pass", "full", {}, PASSKEY_QUESTION), ("prose", "topk", {"k": 48}, "Who inspects the cache?"),
            ("pass", "streaming", {"window": 64}, PASSKEY_QUESTION), ("prose", "full", {}, "What runs under heavy load?")]
    settings = _settings(tmp_path, redis_prefix, decode_runner="batched", decode_batch_size=4)
    with TestClient(create_app(settings, lm=lm)) as c:
        cids = {name: c.post("/v1/contexts", json={"text": text}).json()["id"] for name, text in docs.items()}
        for cid in cids.values():
            assert wait_ready(c, cid)["status"] == "ready"
        out: dict[int, dict] = {}

        def ask(i, doc, method, params, question):
            r = c.post(f"/v1/contexts/{cids[doc]}/completions",
                       json={"question": question, "method": method, "params": params, "max_tokens": 10})
            out[i] = r.json() if r.status_code == 200 else {"error": r.text}

        threads = [threading.Thread(target=ask, args=(i, *a)) for i, a in enumerate(asks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    for i, (doc, method, params, question) in enumerate(asks):
        got = out[i]
        assert "error" not in got, got
        assert got["stats"]["runner"] == "batched" and got["stats"]["method"] == method
        with torch.inference_mode():
            want = _serial(lm, docs[doc], method, params, question, 10)
        assert got["token_ids"] == want, (i, method, got["text"])
    assert max(out[i]["stats"]["batch_max"] for i in out) >= 2  # they really ran together
    assert "27182" in out[0]["text"]


def test_auto_backend_reads_a_context_larger_than_the_gpu_tier_from_host_memory():
    """attention_backend=auto on a GPU worker: a context whose K/V fit the GPU tier is attended by
    the device default (triton where installed); one that does not is read from pinned host memory,
    `offload_v` while its keys fit the tier, `offload` when they do not. A CPU worker and an
    explicit setting are unaffected."""
    from decoder.backends import default_backend_name
    from service.runtime import resolve_backend
    from service.settings import Settings

    auto, fixed = Settings(attention_backend="auto"), Settings(attention_backend="torch_ref")
    gib = 1 << 30
    gpu_default = default_backend_name("cuda")
    assert resolve_backend(auto, "cuda", (4 * gib, 4 * gib), 10 * gib) == gpu_default
    assert resolve_backend(auto, "cuda", (8 * gib, 8 * gib), 10 * gib) == "offload_v"
    assert resolve_backend(auto, "cuda:1", (12 * gib, 12 * gib), 10 * gib) == "offload"
    assert resolve_backend(auto, "cuda", (8 * gib, 8 * gib), None) == gpu_default  # no GPU tier to compare with
    assert resolve_backend(auto, "cpu", (12 * gib, 12 * gib), 0) == "torch_ref"
    assert resolve_backend(fixed, "cuda", (12 * gib, 12 * gib), 10 * gib) == "torch_ref"


def test_plan_ahead_auto_plans_ahead_on_a_gpu_for_the_methods_that_keep_their_fidelity(monkeypatch):
    """plan_ahead "auto" (the default): a GPU worker plans ahead the methods whose widened plans stay
    at least as close to dense and gain on the GPU (`plans_ahead`: csattn, ctkvr, saap), not the others, and not
    under the offload backends (PCIe-bound: the wider plans would read more over it); a CPU worker
    none. true / false (CTXCACHE_PLAN_AHEAD as before) apply to every method and backend."""
    from decoder.backends import get_backend
    from indexer.base import get_method, method_names
    from service.runtime import resolve_plan_ahead
    from service.settings import Settings

    auto = Settings()
    triton, offload_v = get_backend("triton"), get_backend("offload_v")
    assert auto.plan_ahead == "auto"
    ahead = {name for name in method_names() if resolve_plan_ahead(auto, "cuda", get_method(name), triton)}
    assert ahead == {"csattn", "ctkvr", "saap"}
    for device, be in (("cpu", get_backend("torch_ref")), ("cuda", offload_v), ("cuda", get_backend("offload"))):
        assert not any(resolve_plan_ahead(auto, device, get_method(name), be) for name in method_names())
    for env, want in (("true", True), ("false", False), ("auto", "auto")):
        monkeypatch.setenv("CTXCACHE_PLAN_AHEAD", env)
        assert Settings().plan_ahead == want
    monkeypatch.setenv("CTXCACHE_PLAN_AHEAD", "sometimes")
    with pytest.raises(ValueError):
        Settings()
    assert resolve_plan_ahead(Settings(plan_ahead=True), "cuda", get_method("psa"), offload_v) is True
    assert resolve_plan_ahead(Settings(plan_ahead=False), "cuda", get_method("saap"), triton) is False


def _runner_answer(lm, text: str, method: str, params: dict, question: str, max_tokens: int, plan_ahead: bool):
    """The same completion through the library's runner alone (decoder.runner), torch_ref."""
    from decoder.backends import get_backend
    from decoder.generate import ContextKV
    from decoder.prefill import prefill
    from decoder.runner import Runner
    from indexer.base import DecodeContext, get_method

    ids = lm.context_ids(text)
    cap = prefill(lm, ids)
    m = get_method(method)
    p = m.Params(**params)
    q = lm.question_ids(question)
    runner = Runner(lm, get_backend("torch_ref"), plan_ahead=plan_ahead)
    ctx = ContextKV(len(ids), lambda name, layer: (cap.k if name == "kv/k" else cap.v)[layer])
    slot = runner.add(ctx, m.open(None, p, DecodeContext(len(ids), lm.spec, len(q) + max_tokens)), p, q, max_tokens)
    while runner.active():
        runner.step()
    toks = runner.requests[slot].tokens
    return toks[:-1] if toks and toks[-1] in lm.eos_token_ids else toks


def test_plan_ahead_setting_reaches_the_runner(tmp_path, redis_prefix, lm):
    """CTXCACHE_PLAN_AHEAD: the batched worker plans ahead, with each request's budget widened by
    CTXCACHE_PLAN_AHEAD_WIDEN (default 1.5: topk k 8 -> 12), and says so in `stats.params`. The
    completion equals the library runner's with plan_ahead over the widened params; this question
    was chosen where the answer tells all three apart (checked below): a worker that ignored the
    setting (no plan ahead, k 8) or the widening (plan ahead, k 8) would fail."""
    text, question, params = natural_document(400), "What runs under heavy load?", {"k": 8}
    settings = _settings(tmp_path, redis_prefix, decode_runner="batched", plan_ahead=True)
    assert settings.plan_ahead_widen == 1.5
    with TestClient(create_app(settings, lm=lm)) as c:
        cid = c.post("/v1/contexts", json={"text": text}).json()["id"]
        assert wait_ready(c, cid)["status"] == "ready"
        r = c.post(f"/v1/contexts/{cid}/completions",
                   json={"question": question, "method": "topk", "params": params, "max_tokens": 10})
    assert r.status_code == 200, r.text
    got = r.json()
    with torch.inference_mode():
        ahead = _runner_answer(lm, text, "topk", {"k": 12}, question, 10, plan_ahead=True)
        narrow = _runner_answer(lm, text, "topk", params, question, 10, plan_ahead=True)
        plain = _runner_answer(lm, text, "topk", params, question, 10, plan_ahead=False)
    assert ahead != plain and ahead != narrow  # the precondition that makes this test able to fail
    assert got["stats"]["runner"] == "batched" and got["stats"]["params"]["k"] == 12
    assert got["token_ids"] == ahead, got["text"]


def test_pipelined_and_row_cache_settings_reach_the_runner(tmp_path, redis_prefix, lm, monkeypatch):
    """CTXCACHE_DECODE_PIPELINED and CTXCACHE_OFFLOAD_ROW_CACHE: the batched worker builds its runner
    with `pipelined=None` and `cache_rows=None` (the runner's defaults: on CUDA, the row cache under
    the offload backends) when the settings are on and False when they are off. On this CPU both run
    unpipelined and uncached; the GPU tests of the runner compare them with their alternatives."""
    import decoder.runner as runner_module

    seen = []

    class Recording(runner_module.Runner):
        def __init__(self, *args, **kwargs):
            seen.append((kwargs.get("pipelined", "not passed"), kwargs.get("cache_rows", "not passed")))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runner_module, "Runner", Recording)
    for on in (True, False):
        settings = _settings(tmp_path, redis_prefix, decode_runner="batched", decode_pipelined=on,
                             offload_row_cache=on)
        with TestClient(create_app(settings, lm=lm)) as c:
            cid = c.post("/v1/contexts", json={"text": passkey_document(4242, n_rep=4)}).json()["id"]
            assert wait_ready(c, cid)["status"] == "ready"
            r = c.post(f"/v1/contexts/{cid}/completions",
                       json={"question": PASSKEY_QUESTION, "method": "full", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["stats"]["runner"] == "batched"
    assert seen == [(None, None), (False, False)]


def test_offload_row_cache_hit_rate_is_in_the_completion_stats(tmp_path, redis_prefix, lm, monkeypatch):
    """Under `offload_v` the batched runner's row cache (on by default on a GPU; forced on here, with
    the triton kernel through Triton's interpreter in place of the GPU's) serves plan rows the
    request's earlier plans read, and the completion says what share: `row_cache_hit_rate` in
    (0, 1). Its own memory counts against the GPU tier while it runs (a tier given to this CPU
    worker, which has none): its request-local K/V from its admission, its row caches from its first
    one-token step, to the byte, and nothing once it is done. (~25 s: the interpreter runs every
    attention of the completion.)"""
    import decoder.runner as runner_module
    import service.jobs.decode as decode_module
    from decoder.backends.offload import OffloadValues
    from decoder.backends.triton import TritonAttention
    from decoder.kernels.stage import PLANS_KEPT
    from storage.tier import TensorTier

    reservations = []

    class Recording(TensorTier):
        def reserve(self, key, nbytes):
            reservations.append((key, nbytes))
            super().reserve(key, nbytes)

        def release(self, key):
            reservations.append((key, None))
            super().release(key)

    class WithGpuTier(decode_module.ContextTiers):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.gpu = tier = Recording(1 << 30, "gpu")
            tiers.append(tier)

    tiers = []
    monkeypatch.setattr(decode_module, "ContextTiers", WithGpuTier)

    class Cached(runner_module.Runner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "cache_rows": True})

    monkeypatch.setattr(runner_module, "Runner", Cached)
    monkeypatch.setattr(OffloadValues, "run", lambda self, *args: TritonAttention().run(*args))
    settings = _settings(tmp_path, redis_prefix, decode_runner="batched")
    with TestClient(create_app(settings, lm=lm)) as c:
        cid = c.post("/v1/contexts", json={"text": passkey_document(4242, n_rep=4)}).json()["id"]
        assert wait_ready(c, cid)["status"] == "ready"
        r = c.post(f"/v1/contexts/{cid}/completions",
                   json={"question": PASSKEY_QUESTION, "method": "topk", "params": {"k": 16}, "backend": "offload_v",
                         "max_tokens": 3})
    assert r.status_code == 200, r.text
    stats, usage = r.json()["stats"], r.json()["usage"]
    assert stats["backend"] == "offload_v" and stats["runner"] == "batched"
    assert 0 < stats["row_cache_hit_rate"] < 1, stats
    (key,) = {k for k, _ in reservations}
    counted = [b for _, b in reservations]
    n, layers, kvh, d = usage["cached_tokens"], 30, 3, 64  # the default model; fp32 K/V
    local = 2 * layers * kvh * (usage["prompt_tokens"] + 3) * d * 4  # loc_k + loc_v: question + max_tokens
    width = (PLANS_KEPT + 1) * 16  # topk k = 16
    caches = layers * (kvh * width * d * 4 + kvh * width * 4 + kvh * n * 4 + 2 * 8)  # vals, pos_of, slot_of, counts
    assert counted[0] == local and counted[-1] is None and max(b for b in counted if b) == local + caches
    assert tiers[-1].reserved == 0
