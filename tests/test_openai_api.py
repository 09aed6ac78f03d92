"""The OpenAI-compatible routes (issue 15, item 1) with the real `openai` client against a live
uvicorn server, the real default model, a decode worker and a real Redis: answers equal the native
route's at temperature 0 (JSON and streamed), multi-turn rendering, usage with the cached tokens,
stop strings, the naming of the context, errors in OpenAI's shape."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import redis

from conftest import PASSKEY_QUESTION, REDIS_URL, passkey_document
from service.api.openai_schemas import ChatMessage
from service.api.routes.openai import chat_question_ids
from service.app import create_app
from test_api import _settings
from test_cancellation import live_server, register

pytestmark = pytest.mark.slow

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory, lm):
    """One server and one short context for the module: a prefill costs seconds. Keys isolated as
    `redis_prefix` does, for the module."""
    prefix = f"ctxtest:{uuid.uuid4().hex[:10]}:"
    app = create_app(_settings(tmp_path_factory.mktemp("openai"), prefix), lm=lm)
    try:
        with live_server(app) as (base, _):
            cid = register(base, passkey_document(4242, n_rep=5))
            n_ctx = httpx.get(f"{base}/v1/contexts/{cid}").json()["n_tokens"]
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
            yield base, cid, n_ctx, client
    finally:
        r = redis.Redis.from_url(REDIS_URL)
        for key in r.scan_iter(match=prefix + "*", count=1000):
            r.delete(key)


def native(base: str, cid: str, question: str = PASSKEY_QUESTION, max_tokens: int = MAX_TOKENS) -> dict:
    r = httpx.post(f"{base}/v1/contexts/{cid}/completions",
                   json={"question": question, "max_tokens": max_tokens, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_equals_native_json_and_stream(served, lm):
    base, cid, n_ctx, client = served
    ref = native(base, cid)
    assert ref["text"]
    msgs = [{"role": "user", "content": PASSKEY_QUESTION}]
    out = client.chat.completions.create(model=lm.spec.name, messages=msgs, temperature=0, max_tokens=MAX_TOKENS,
                                         extra_body={"context_id": cid})
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert choice.finish_reason == ref["finish_reason"]
    assert out.usage.prompt_tokens_details.cached_tokens == n_ctx == ref["usage"]["cached_tokens"]
    assert out.usage.prompt_tokens == n_ctx + ref["usage"]["prompt_tokens"]
    assert out.usage.completion_tokens == ref["usage"]["completion_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.object == "chat.completion" and out.model == lm.spec.name

    # streamed, the context named by `model = <model>@<id>`, usage in the last chunk
    chunks = list(client.chat.completions.create(model=f"{lm.spec.name}@{cid}", messages=msgs, temperature=0,
                                                 max_completion_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref["finish_reason"]]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n_ctx
    assert chunks[-1].usage.completion_tokens == ref["usage"]["completion_tokens"]


def test_text_completion_continues_the_context(served, lm):
    """`/v1/completions` appends the prompt's tokens as they are: the native question's rendering as
    the prompt gives the native answer."""
    base, cid, n_ctx, client = served
    ref = native(base, cid)
    prompt = "\n\n" + PASSKEY_QUESTION + lm.prompt_format.suffix
    assert lm.tokenizer(prompt, add_special_tokens=False)["input_ids"] == lm.question_ids(PASSKEY_QUESTION)
    out = client.completions.create(model=lm.spec.name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                    extra_body={"context_id": cid})
    assert out.choices[0].text == ref["text"]
    assert out.usage.prompt_tokens == n_ctx + ref["usage"]["prompt_tokens"]


def test_multi_turn_rendering(served, lm):
    """System + multi-turn messages follow the cached context as the chat template renders them."""
    base, cid, n_ctx, client = served
    convo = [ChatMessage(role="user", content="q1"), ChatMessage(role="assistant", content="a1"),
             ChatMessage(role="user", content="q2")]
    ids = chat_question_ids(lm, convo, "chat")
    assert lm.tokenizer.decode(ids) == ("\n\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
                                        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n")
    with_system = [ChatMessage(role="system", content="Answer briefly."), *convo]
    sys_ids = chat_question_ids(lm, with_system, "chat")
    assert lm.tokenizer.decode(sys_ids) == ("<|im_end|>\n<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                            "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
                                            "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n")
    # the server renders the same tokens: its usage counts them
    out = client.chat.completions.create(model=lm.spec.name, messages=[m.model_dump(exclude_none=True) for m in with_system],
                                         temperature=0, max_tokens=2, extra_body={"context_id": cid})
    assert out.usage.prompt_tokens == n_ctx + len(sys_ids)
    assert out.usage.prompt_tokens_details.cached_tokens == n_ctx


def test_stop_strings_cut_the_answer(served, lm):
    base, cid, n_ctx, client = served
    ref = native(base, cid, max_tokens=16)["text"]
    assert len(ref) >= 8, ref
    stop = ref[4:7]  # its first occurrence may be earlier than index 4
    want = ref[:ref.index(stop)]
    kw = dict(model=lm.spec.name, messages=[{"role": "user", "content": PASSKEY_QUESTION}], temperature=0, max_tokens=16,
              extra_body={"context_id": cid})
    out = client.chat.completions.create(stop=[stop, "never appears \u2063"], **kw)
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 16
    chunks = list(client.chat.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_errors_in_openai_shape(served, lm):
    base, cid, n_ctx, client = served
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=lm.spec.name, messages=msgs, extra_body={"context_id": "ab" * 32})
    assert e.value.code == "not_found" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=f"gpt-4o@{cid}", messages=msgs)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=lm.spec.name, messages=msgs, n=2, extra_body={"context_id": cid})
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=lm.spec.name, messages=msgs, top_p=0.5, extra_body={"context_id": cid})
    assert e.value.param == "top_p" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=lm.spec.name, messages=msgs)
    assert e.value.code == "missing_context"
    with pytest.raises(openai.BadRequestError) as e:  # the native route's 422 (method params) answers 400 here
        client.chat.completions.create(model=lm.spec.name, messages=msgs,
                                       extra_body={"context_id": cid, "method": "topk", "method_params": {"k": -1}})
    assert e.value.code == "invalid_parameter"
    raw = httpx.post(f"{base}/v1/chat/completions", json={"model": lm.spec.name, "messages": []}, timeout=30)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_models(served, lm):
    base, cid, n_ctx, client = served
    assert [m.id for m in client.models.list()] == [lm.spec.name]
    assert client.models.retrieve(lm.spec.name).id == lm.spec.name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
