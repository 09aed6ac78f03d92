"""OpenAI-compatible routes over registered contexts: `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /v1/models`.

A request names its context by the extension field `context_id` (what the OpenAI SDK sends through
`extra_body`) or by `model = "<served model>@<context id>"`; both given must agree. The cached
context comes first, then:

* chat: the messages rendered with the model's chat template *after* the context. A context
  registered in the `chat` format is the start of a user turn (the template's default system
  prompt is already cached before it): the first user message continues that turn after a blank
  line (exactly the native route's question), and the rest of the conversation follows as the
  template renders it. Leading system (or developer) messages cannot precede the cached tokens: they
  are rendered as a system turn right after the document's user turn. A `raw` context is followed
  by the whole conversation as the template renders it.
* completions: the prompt's tokens, appended as they are (no template).

Everything else (the context's state, the sparse method and its params, limits, the decode wait,
cancellation on disconnect) is the native completion route's (`contexts._completion_job`,
`service/api/decode_client.py`). Sampling is greedy or temperature (`top_p` only 1); `stop`
strings are matched on the streamed text, which is cut before the first match and the generation
stopped. Errors have OpenAI's shape (`service/api/openai_errors.py`); the request and response
models are in `service/api/openai_schemas.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from decoder.model import QUESTION_SEPARATOR, _SENTINEL
from service import metrics
from service.api.decode_client import ERROR_STATUS, DecodeClient, DecodeClientDep, Submission
from service.api.deps import RuntimeDep, context_id
from service.api.openai_errors import OpenAIError, OpenAIRoute, openai_error_body
from service.api.openai_schemas import (
    ChatCompletionCreate,
    ChatMessage,
    CompletionCreate,
    CompletionFields,
    ModelCard,
    ModelList,
    documented_errors,
)
from service.api.routes.contexts import _completion_job
from service.errors import ApiError
from service.schemas import CompletionRequest

STARTED = int(time.time())  # `created` of the model card

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute)


# ---- naming the context, rendering the request -----------------------------------------------


def _context_of(rt, body: CompletionFields) -> str:
    """The context id the request names (`context_id`, or `model = <served model>@<id>`)."""
    spec = rt.lm.spec
    name, at, from_model = body.model.partition("@")
    if name not in (spec.name, spec.fingerprint):
        raise OpenAIError(404, "model_not_found", f"this service serves model {spec.name!r}, not {name!r}", "model")
    if at and body.context_id and from_model != body.context_id:
        raise OpenAIError(400, "invalid_parameter", "`model` and `context_id` name different contexts", "context_id")
    cid = body.context_id or from_model
    if not cid:
        raise OpenAIError(400, "missing_context", "name the context: `context_id` in the body (extra_body with the "
                                                  f"OpenAI SDK) or model='{spec.name}@<context id>'", "context_id")
    return cid


def chat_question_ids(lm, messages: list[ChatMessage], fmt: str) -> list[int]:
    """The token ids of `messages` rendered by the model's chat template after a context of format
    `fmt` (see the module docstring)."""
    tok = lm.tokenizer
    if not getattr(tok, "chat_template", None):
        raise OpenAIError(400, "unsupported_configuration", "the served model has no chat template; use /v1/completions")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
    n_lead = next((i for i, t in enumerate(turns) if t["role"] != "system"), len(turns))
    if n_lead == len(turns) or turns[n_lead]["role"] != "user":
        raise OpenAIError(400, "invalid_parameter", "after the system messages, the conversation must start with a "
                                                    "user message", "messages")
    if fmt != "chat":
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]
    lead, rest = turns[:n_lead], turns[n_lead:]
    if lead:
        turns = [{"role": "user", "content": _SENTINEL}, *lead, *rest]
    else:
        turns = [{"role": "user", "content": _SENTINEL + QUESTION_SEPARATOR + rest[0]["content"]}, *rest[1:]]
    try:
        rendered = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError: a template that refuses this conversation
        raise OpenAIError(400, "invalid_parameter", f"the chat template refuses these messages: {e}", "messages") from None
    head, found, tail = rendered.partition(_SENTINEL)
    if not found or head != lm.prompt_format.prefix:
        raise OpenAIError(400, "unsupported_configuration", "the model's chat template does not render these messages "
                                                            "after the cached context", "messages")
    return tok(tail, add_special_tokens=False)["input_ids"]


def _native(body: CompletionFields, question: str) -> CompletionRequest:
    """The native request that `_completion_job` checks (its question is replaced by the rendered ids)."""
    body.check_supported()
    return CompletionRequest(question=question or " ", max_tokens=body.new_tokens(),
                             temperature=1.0 if body.temperature is None else body.temperature, seed=body.seed,
                             method=body.method, params=body.method_params, backend=body.backend)

# ---- answering --------------------------------------------------------------------------------


class StopScanner:
    """Finds the first occurrence of any stop string in streamed text. Text that could still be the
    start of a stop string is held back until the next delta decides."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max(map(len, stops), default=1) - 1
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text safe to emit, and whether a stop string was found (then nothing follows)."""
        self.buf += delta
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class _End:
    finish_reason: str = "stop"
    completion_tokens: int = 0
    error: dict | None = None  # {"code", "message"}
    stats: dict = field(default_factory=dict)


async def _answer(dc: DecodeClient, sub: Submission, request: Request, deadline: float, stops: list[str],
                  method: str) -> AsyncIterator[str | _End]:
    """The answer's text deltas, then one `_End`. With stop strings the tokens are read as they come
    and the generation is cancelled at the first match (leaving `events` cancels it); without, a
    JSON-like wait (`tokens=False`) that may restart on another worker is used by the caller."""
    scanner, n = StopScanner(stops), 0
    async with aclosing(dc.events(sub, request, deadline, tokens=True)) as events:
        async for kind, data in events:
            if kind == "token":
                n += 1
                text, hit = scanner.feed(data["text"])
                if text:
                    yield text
                if hit:
                    metrics.completion_ended(method, "ok")
                    yield _End("stop", n)
                    return
            elif kind == "done":
                metrics.completion_ended(method, "ok", data["stats"])
                if rest := scanner.flush():
                    yield rest
                yield _End(_finish(data["finish_reason"]), data["usage"]["completion_tokens"], stats=data["stats"])
                return
            else:
                metrics.completion_ended(method, data["code"])
                yield _End(error=data)
                return
    metrics.completion_ended(method, "disconnected")


async def _whole(dc: DecodeClient, sub: Submission, request: Request, deadline: float, stops: list[str],
                 method: str) -> tuple[str, _End] | None:
    """The whole answer (None: the client went away). Without stop strings no token events are
    read, so a request whose worker died restarts on another one (`DecodeClient.events`)."""
    if stops:
        parts: list[str] = []
        async with aclosing(_answer(dc, sub, request, deadline, stops, method)) as answer:
            async for item in answer:
                if isinstance(item, _End):
                    return "".join(parts), item
                parts.append(item)
        return None
    async with aclosing(dc.events(sub, request, deadline, tokens=False)) as events:
        async for kind, data in events:
            if kind == "done":
                metrics.completion_ended(method, "ok", data["stats"])
                return data["text"], _End(_finish(data["finish_reason"]), data["usage"]["completion_tokens"],
                                          stats=data["stats"])
            metrics.completion_ended(method, data["code"])
            return "", _End(error=data)
    metrics.completion_ended(method, "disconnected")
    return None


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"  # "cancelled" reaches no listening client


def _usage(n_ctx: int, n_question: int, n_out: int) -> dict:
    prompt = n_ctx + n_question
    return {"prompt_tokens": prompt, "completion_tokens": n_out, "total_tokens": prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": n_ctx}}


def _raise(err: dict) -> None:
    raise ApiError(ERROR_STATUS.get(err["code"], 500), err["code"], err["message"])


async def _start(rt, dc: DecodeClient, body: CompletionFields, question: str,
                 question_ids: Callable[[dict], list[int]]) -> tuple[dict, dict, Submission, float]:
    named = _context_of(rt, body)
    native = _native(body, question)  # unsupported parameters answer before an unknown context
    rec, job = await run_in_threadpool(_completion_job, rt, context_id(named), native, question_ids)
    sub = await dc.submit(job)
    return rec, job, sub, time.monotonic() + rt.settings.decode_timeout_seconds


@router.post("/chat/completions", summary="OpenAI-compatible chat completion over a registered context",
             responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks when stream=true"},
                        **documented_errors(400, 404, 409, 504)})
async def chat_completions(body: ChatCompletionCreate, rt: RuntimeDep, request: Request, dc: DecodeClientDep):
    last_user = next((m.text for m in reversed(body.messages) if m.role == "user"), "")
    rec, job, sub, deadline = await _start(
        rt, dc, body, last_user, lambda r: chat_question_ids(rt.lm, body.messages, r.get("prompt_format", "chat")))
    meta = {"id": f"chatcmpl-{sub.rid}", "created": int(time.time()), "model": body.model,
            "system_fingerprint": rt.lm.spec.fingerprint[:16]}

    def choice(text: str, finish: str | None) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def delta(text: str | None, finish: str | None) -> dict:
        return {"index": 0, "delta": {} if text is None else {"content": text}, "logprobs": None,
                "finish_reason": finish}

    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return await _respond(dc, sub, request, deadline, body, rec, job, meta, ("chat.completion", choice),
                          ("chat.completion.chunk", delta, opening))


@router.post("/completions", summary="OpenAI-compatible text completion: the prompt continues the context",
             responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks when stream=true"},
                        **documented_errors(400, 404, 409, 504)})
async def completions(body: CompletionCreate, rt: RuntimeDep, request: Request, dc: DecodeClientDep):
    prompt = body.text
    rec, job, sub, deadline = await _start(
        rt, dc, body, prompt, lambda r: rt.lm.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    meta = {"id": f"cmpl-{sub.rid}", "created": int(time.time()), "model": body.model}

    def choice(text: str | None, finish: str | None) -> dict:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    return await _respond(dc, sub, request, deadline, body, rec, job, meta, ("text_completion", choice),
                          ("text_completion", choice, None))


async def _respond(dc, sub, request, deadline, body, rec: dict, job: dict, meta: dict, whole: tuple, stream: tuple):
    """The answer of a submitted completion in OpenAI's shape: one JSON object (`whole` = (object,
    choice(text, finish_reason))), or SSE chunks (`stream` = (object, choice(delta or None,
    finish_reason), the opening choice or None)) ending with `[DONE]`."""
    n_ctx, n_q = rec["n_tokens"], len(job["question_ids"])
    if body.stream:
        usage_of = (n_ctx, n_q) if body.stream_options and body.stream_options.include_usage else None
        return EventSourceResponse(_stream(dc, sub, request, deadline, body.stops, job["method"], meta, *stream,
                                           usage_of))
    got = await _whole(dc, sub, request, deadline, body.stops, job["method"])
    if got is None:
        return JSONResponse({}, status_code=499)  # the client is gone: nobody reads this
    text, end = got
    if end.error:
        _raise(end.error)
    obj, choice = whole
    return {**meta, "object": obj, "choices": [choice(text, end.finish_reason)],
            "usage": _usage(n_ctx, n_q, end.completion_tokens)}


async def _stream(dc, sub, request, deadline, stops, method, meta, obj: str, choice, opening: dict | None,
                  usage_of: tuple[int, int] | None):
    def chunk(c: dict) -> dict:
        return {"data": json.dumps({**meta, "object": obj, "choices": [c]})}

    if opening is not None:
        yield chunk(opening)
    async with aclosing(_answer(dc, sub, request, deadline, stops, method)) as answer:
        async for item in answer:
            if not isinstance(item, _End):
                yield chunk(choice(item, None))
                continue
            if item.error:
                err = item.error
                yield {"data": json.dumps(openai_error_body(ERROR_STATUS.get(err["code"], 500), err["code"], err["message"]))}
            else:
                yield chunk(choice(None, item.finish_reason))
                if usage_of is not None:
                    yield {"data": json.dumps({**meta, "object": obj, "choices": [],
                                               "usage": _usage(*usage_of, item.completion_tokens)})}
            yield {"data": "[DONE]"}
            return


@router.get("/models", response_model=ModelList, summary="the served model", responses=documented_errors())
def list_models(rt: RuntimeDep):
    return ModelList(data=[ModelCard(id=rt.lm.spec.name, created=STARTED)])


@router.get("/models/{model_id:path}", response_model=ModelCard, summary="the served model, by name",
            responses=documented_errors(404))
def get_model(model_id: str, rt: RuntimeDep):
    if model_id.partition("@")[0] not in (rt.lm.spec.name, rt.lm.spec.fingerprint):
        raise OpenAIError(404, "model_not_found", f"this service serves model {rt.lm.spec.name!r}, not {model_id!r}", "model")
    return ModelCard(id=rt.lm.spec.name, created=STARTED)
