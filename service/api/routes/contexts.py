"""`/v1/contexts`: register, list, inspect, patch, delete contexts; ask questions over them."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Query, Request, Response
from prometheus_client import Counter, Histogram
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from decoder.backends import backend_names
from indexer.base import get_method, method_names
from service.api.deps import RuntimeDep
from service.errors import ApiError
from service.schemas import (
    CompletionRequest,
    CompletionResponse,
    ContextCreate,
    ContextCreated,
    ContextList,
    ContextPatch,
    ContextPublic,
)
from service.workers import delete_context
from storage.keys import PromptHash

router = APIRouter(prefix="/v1/contexts", tags=["contexts"])

REGISTRATIONS = Counter("ctxcache_registrations_total", "context registrations", ["created"])
COMPLETIONS = Counter("ctxcache_completions_total", "completions", ["method", "outcome"])
TTFT = Histogram("ctxcache_ttft_seconds", "time to first token", ["cache"])

_ERROR_STATUS = {"not_found": 404, "context_not_ready": 409, "method_unavailable": 409, "method_not_built": 409,
                 "unsupported_configuration": 422, "artifact_corrupt": 500, "artifact_missing": 500, "internal_error": 500}


def _public(rec: dict, cls=ContextPublic, **extra) -> ContextPublic:
    err = {"code": rec["error_code"], "message": rec.get("error_message", "")} if rec.get("error_code") else None
    free = [m for m in method_names() if not get_method(m).has_index]
    methods = {k: v for k, v in (rec.get("methods") or {}).items() if v.get("index_id")}
    return cls(
        id=rec["id"], status=rec["status"], progress=rec.get("progress") or 0.0, model=rec.get("model", ""),
        n_tokens=rec.get("n_tokens"), format=rec.get("prompt_format", "chat"), methods=methods,
        index_free_methods=free, bytes=rec.get("bytes"), timings=rec.get("timings") or {},
        display_name=rec.get("display_name") or None, created_at=rec.get("created_at") or 0.0,
        updated_at=rec.get("updated_at"), expires_at=rec.get("expires_at"), error=err, **extra,
    )


def _context_id(cid: str) -> str:
    try:
        return PromptHash.from_string(cid).hex
    except ValueError:
        raise ApiError(404, "not_found", f"no context {cid!r} (ids are 64 hex digits)") from None


def _validate_params(method, params: dict, where: str):
    try:
        return method.Params.model_validate(params)
    except ValidationError as e:
        details = [{"loc": [where, *map(str, err["loc"])], "msg": err["msg"], "type": err["type"]} for err in e.errors()]
        raise ApiError(422, "invalid_parameter", f"invalid parameters for method {method.name!r}", details) from None


def _method(name: str):
    try:
        return get_method(name)
    except KeyError:
        raise ApiError(422, "unknown_method", f"unknown method {name!r}; known: {', '.join(method_names())}") from None


@router.post("", status_code=202, response_model=ContextCreated, summary="register a context (idempotent)")
def create_context(body: ContextCreate, rt: RuntimeDep, response: Response):
    lm, spec = rt.lm, rt.lm.spec
    if body.model not in (None, spec.name, spec.fingerprint):
        raise ApiError(422, "unknown_model", f"this service serves model {spec.name!r}, not {body.model!r}")
    if body.text is not None:
        if not body.text.strip():
            raise ApiError(422, "empty_text", "`text` is empty or whitespace only")
        ids = lm.context_ids(body.text, body.format)
    else:
        if not body.token_ids:
            raise ApiError(422, "empty_text", "`token_ids` is empty")
        vocab = len(lm.tokenizer)
        bad = [t for t in body.token_ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(422, "invalid_token_ids", f"token ids must be in [0, {vocab}); got {bad[:5]}")
        ids = list(body.token_ids)
    limit = rt.max_context_tokens
    if len(ids) > limit:
        raise ApiError(
            422, "context_too_long",
            f"context is {len(ids)} tokens; this model accepts at most {limit} "
            f"({spec.max_positions} positions minus {rt.settings.reserve_tokens} reserved for question and answer)",
            {"n_tokens": len(ids), "limit": limit},
        )
    if body.ttl_seconds and body.ttl_seconds > rt.settings.max_ttl_seconds:
        raise ApiError(422, "invalid_parameter", f"ttl_seconds must be <= {rt.settings.max_ttl_seconds}")
    for name in body.params:
        if name not in body.methods:
            raise ApiError(422, "invalid_parameter", f"params given for {name!r}, which is not in `methods`")
    wanted: dict[str, dict] = {}
    for name in dict.fromkeys(body.methods):
        method = _method(name)
        params = _validate_params(method, body.params.get(name, {}), f"params.{name}")
        reasons = method.validate_configuration(spec, params, rt.method_env)
        if reasons:
            raise ApiError(422, "unsupported_configuration", f"{name}: " + "; ".join(reasons))
        index_id = method.index_id(params, spec, rt.method_env) if method.has_index else None
        wanted[name] = {"params": params.model_dump(), "index_id": index_id}
    cid = PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, ids).hex
    record = {"model": spec.name, "slug": spec.slug, "n_tokens": len(ids), "prompt_format": body.format if body.text is not None else "raw",
              "display_name": body.display_name or ""}
    reg = rt.catalog.register(cid, record, ids, wanted, body.ttl_seconds)
    REGISTRATIONS.labels(created=str(reg.created).lower()).inc()
    rec = rt.catalog.get(cid) or reg.record
    if rec.get("status") == "ready":
        response.status_code = 200
    return _public(rec, ContextCreated, created=reg.created)


@router.get("", response_model=ContextList, summary="list contexts, newest first")
def list_contexts(
    rt: RuntimeDep,
    offset: int = Query(0, ge=0),
    limit: int = Query(20, ge=1, le=200),
    model: str | None = Query(None),
    status: str | None = Query(None, pattern="^(queued|prefilling|indexing|ready|failed)$"),
):
    recs, total = rt.catalog.list(offset, limit, model, status)
    nxt = offset + limit if offset + limit < total else None
    return ContextList(data=[_public(r) for r in recs], total=total, offset=offset, limit=limit, next_offset=nxt)


def _get(rt, cid: str) -> dict:
    rec = rt.catalog.get(_context_id(cid))
    if rec is None:
        raise ApiError(404, "not_found", f"no context {cid}")
    return rec


@router.get("/{cid}", response_model=ContextPublic, summary="status, progress, size and timings of a context")
def get_context(cid: str, rt: RuntimeDep):
    return _public(_get(rt, cid))


@router.patch("/{cid}", response_model=ContextPublic, summary="change ttl or display name")
def patch_context(cid: str, body: ContextPatch, rt: RuntimeDep):
    rec = _get(rt, cid)
    if body.ttl_seconds is not None:
        if body.ttl_seconds > rt.settings.max_ttl_seconds:
            raise ApiError(422, "invalid_parameter", f"ttl_seconds must be <= {rt.settings.max_ttl_seconds}")
        rt.catalog.set_ttl(rec["id"], body.ttl_seconds or None)
    if body.display_name is not None:
        rt.catalog.update(rec["id"], display_name=body.display_name)
    return _public(_get(rt, cid))


@router.delete("/{cid}", status_code=204, summary="remove a context and its artifacts")
def delete(cid: str, rt: RuntimeDep, request: Request):
    rec = _get(rt, cid)
    delete_context(rt, rec["id"])
    for hook in getattr(request.app.state, "on_delete", []):
        hook(rec["id"])
    return Response(status_code=204)


@router.post(
    "/{cid}/completions",
    response_model=CompletionResponse,
    summary="answer a question over the context",
    responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"}},
)
def complete(cid: str, body: CompletionRequest, rt: RuntimeDep):
    rec = _get(rt, cid)
    if rec["status"] != "ready":
        msg = f"context is {rec['status']} ({round(100 * (rec.get('progress') or 0))}%)"
        if rec["status"] == "failed":
            msg += f": {rec.get('error_code')}: {rec.get('error_message')}"
        raise ApiError(409, "context_not_ready", msg, {"status": rec["status"]})
    method = _method(body.method)
    registered = (rec.get("methods") or {}).get(method.name, {})
    params = _validate_params(method, {**registered.get("params", {}), **body.params}, "params")
    index_id = method.index_id(params, rt.lm.spec, rt.method_env) if method.has_index else None
    if method.has_index and index_id != registered.get("index_id"):
        # an id that depends on more than the params (SAAP's trained model) may differ because that changed
        external = index_id != method.index_id(params)
        raise ApiError(409, "method_not_built",
                       f"no {method.name!r} index with these build parameters "
                       f"({', '.join(sorted(method.Params.build_fields)) or 'none'})"
                       f"{' and the current trained model' if external else ''} for this context; "
                       f"register the context again with methods=[{method.name!r}] to build it")
    if body.max_tokens > rt.settings.max_new_tokens:
        raise ApiError(422, "invalid_parameter", f"max_tokens must be <= {rt.settings.max_new_tokens}")
    q_ids = rt.lm.question_ids(body.question, rec.get("prompt_format", "chat"))
    total = rec["n_tokens"] + len(q_ids) + body.max_tokens
    if total > rt.lm.spec.max_positions:
        raise ApiError(422, "too_long", f"context + question + max_tokens = {total} > {rt.lm.spec.max_positions} positions")
    if body.backend is not None and body.backend not in backend_names():
        raise ApiError(422, "unsupported_configuration", f"attention backend {body.backend!r} is not installed here; "
                                                         f"available: {', '.join(backend_names())}")
    if rt.catalog.live_workers("decode") == 0:
        raise ApiError(503, "no_decode_worker", "no decode worker is running; start `ctxcache worker decode`")
    rid = rt.catalog.submit_decode({
        "id": rec["id"], "question_ids": q_ids, "max_tokens": body.max_tokens, "temperature": body.temperature,
        "seed": body.seed, "method": method.name, "params": params.model_dump(), "index_id": index_id,
        "backend": body.backend,
    })
    deadline = time.monotonic() + rt.settings.decode_timeout_seconds
    if body.stream:
        return EventSourceResponse(_sse(rt, rid, rec["id"], method.name, deadline))
    for event, data in _events(rt, rid, deadline):
        if event == "done":
            COMPLETIONS.labels(method.name, "ok").inc()
            TTFT.labels(data["stats"]["cache"]).observe(data["stats"]["ttft_ms"] / 1000)
            return CompletionResponse(id=rid, context_id=rec["id"], **data)
        if event == "error":
            COMPLETIONS.labels(method.name, data["code"]).inc()
            raise ApiError(_ERROR_STATUS.get(data["code"], 500), data["code"], data["message"])
    COMPLETIONS.labels(method.name, "timeout").inc()
    raise ApiError(504, "decode_timeout", "the decode worker did not finish in time")


def _events(rt, rid: str, deadline: float):
    """Yield (event, data) from the request's stream until done/error or the deadline."""
    last = "0-0"
    try:
        while time.monotonic() < deadline:
            for eid, event, data in rt.catalog.events(rid, last, block_ms=1000):
                last = eid
                yield event, data
                if event in ("done", "error"):
                    return
    finally:
        rt.catalog.cleanup_request(rid)


def _sse(rt, rid: str, cid: str, method: str, deadline: float):
    finished = False
    try:
        for event, data in _events(rt, rid, deadline):
            if event == "done":
                finished = True
                COMPLETIONS.labels(method, "ok").inc()
                TTFT.labels(data["stats"]["cache"]).observe(data["stats"]["ttft_ms"] / 1000)
                yield {"event": "done", "data": json.dumps({"id": rid, "context_id": cid, **data})}
                return
            if event == "error":
                finished = True
                COMPLETIONS.labels(method, data["code"]).inc()
                yield {"event": "error", "data": json.dumps({"error": data})}
                return
            yield {"event": "token", "data": json.dumps(data)}
        finished = True
        yield {"event": "error", "data": json.dumps({"error": {"code": "decode_timeout", "message": "timed out"}})}
    finally:
        if not finished:  # the client went away: stop the worker
            rt.catalog.cancel(rid)
