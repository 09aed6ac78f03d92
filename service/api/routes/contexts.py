"""`/v1/contexts`: register, list, inspect, patch, delete contexts; ask questions over them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import aclosing

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse

from decoder.backends import backend_names
from indexer.base import get_method, method_names
from service.api.decode_client import ERROR_STATUS, DecodeClient, DecodeClientDep, Submission
from service.api.deps import ContextId, RuntimeDep
from service import limits, metrics
from service.contexts import delete_context, register_context
from service.errors import BODY_ERRORS, ApiError, error_responses
from service.schemas import (
    CompletionRequest,
    CompletionResponse,
    ContextCreate,
    ContextCreated,
    ContextList,
    ContextPatch,
    ContextPublic,
)
from storage.artifacts import ArtifactCorrupt, ArtifactMissing
from storage.keys import PromptHash

router = APIRouter(prefix="/v1/contexts", tags=["contexts"])


def _public(rec: dict, cls=ContextPublic, **extra) -> ContextPublic:
    err = {"code": rec["error_code"], "message": rec.get("error_message", "")} if rec.get("error_code") else None
    free = [m for m in method_names() if not get_method(m).has_index]
    methods = {k: v for k, v in (rec.get("methods") or {}).items() if v.get("index_id")}
    return cls(
        id=rec["id"], status=rec["status"], progress=rec.get("progress") or 0.0, model=rec.get("model", ""),
        n_tokens=rec.get("n_tokens"), format=rec.get("prompt_format", "chat"), kv_dtype=rec.get("kv_dtype") or "float32",
        methods=methods,
        index_free_methods=free, bytes=rec.get("bytes"), timings=rec.get("timings") or {},
        display_name=rec.get("display_name") or None, created_at=rec.get("created_at") or 0.0,
        updated_at=rec.get("updated_at"), expires_at=rec.get("expires_at"), error=err, **extra,
    )


def _validate_params(method, params: dict, where: str):
    try:
        return method.Params.model_validate(params)
    except ValidationError as e:
        details = [{"loc": [where, *map(str, err["loc"])], "msg": err["msg"], "type": err["type"]} for err in e.errors()]
        raise ApiError(422, "invalid_parameter", f"invalid parameters for method {method.name!r}", details) from None


def _within_limits(rt, method, params, given: dict, n_ctx: int, where: str, question: tuple[int, int] | None = None):
    """The cost limits (service/limits.py), before any work starts: parameters the request gave
    (`given`) bounded by the context's n_ctx tokens (422 `invalid_parameter`), then the estimated
    cost of the index build, or of the completion when `question` = (question tokens, max_tokens)
    is given, within the settings' budget (422 `over_budget`)."""
    limits.context_bounds(params, given, n_ctx, where)
    spec, budget = rt.lm.spec, rt.settings
    cost = (limits.decode_cost(spec, method, params, n_ctx, *question) if question is not None
            else limits.build_cost(spec, method, params, n_ctx))
    limits.check(cost, budget.budget_seconds, budget.budget_bytes)


def _method(name: str):
    try:
        return get_method(name)
    except KeyError:
        raise ApiError(422, "unknown_method", f"unknown method {name!r}; known: {', '.join(method_names())}") from None


@router.post("", status_code=202, response_model=ContextCreated, summary="register a context (idempotent)",
             responses={200: {"model": ContextCreated, "description": "the content is known (ready): nothing queued"},
                        **error_responses(*BODY_ERRORS)})
def create_context(body: ContextCreate, rt: RuntimeDep, response: Response):
    lm, spec = rt.lm, rt.lm.spec
    if body.model not in (None, spec.name, spec.fingerprint):
        raise ApiError(422, "unknown_model", f"this service serves model {spec.name!r}, not {body.model!r}")
    if body.text is not None:
        if not body.text.strip():
            raise ApiError(422, "empty_text", "`text` is empty or whitespace only")
        max_bytes = limits.max_text_bytes(lm, rt.max_context_tokens)
        n_bytes = len(body.text.encode("utf-8"))
        if n_bytes > max_bytes:  # tokenizing megabytes takes seconds: refuse what cannot fit first
            raise ApiError(422, "context_too_long",
                           f"text is {n_bytes} bytes; no text over {max_bytes} bytes fits in {rt.max_context_tokens} "
                           f"tokens (the longest token is {max_bytes // rt.max_context_tokens} bytes)",
                           {"bytes": n_bytes, "max_bytes": max_bytes, "limit": rt.max_context_tokens})
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
        _within_limits(rt, method, params, body.params.get(name, {}), len(ids), f"params.{name}")
        reasons = method.validate_configuration(spec, params, rt.method_env)
        if reasons:
            raise ApiError(422, "unsupported_configuration", f"{name}: " + "; ".join(reasons))
        index_id = method.index_id(params, spec, rt.method_env) if method.has_index else None
        wanted[name] = {"params": params.model_dump(), "index_id": index_id}
    kv_dtype = rt.kv_dtype  # part of the identity: the same text in another KV dtype is another context
    cid = PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, ids, kv_dtype)
    record = {"model": spec.name, "slug": spec.slug, "n_tokens": len(ids), "kv_dtype": kv_dtype,
              "prompt_format": body.format if body.text is not None else "raw",
              "display_name": body.display_name or ""}
    reg = register_context(rt, cid, record, ids, wanted, body.ttl_seconds)
    metrics.registered(reg.created)
    rec = rt.catalog.get(cid) or reg.record
    if rec.get("status") == "ready":
        response.status_code = 200
    return _public(rec, ContextCreated, created=reg.created)


@router.get("", response_model=ContextList, summary="list contexts, newest first", responses=error_responses(422))
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


def _get(rt, cid: PromptHash) -> dict:
    rec = rt.catalog.get(cid)
    if rec is None:
        raise ApiError(404, "not_found", f"no context {cid}")
    return rec


@router.get("/{cid}", response_model=ContextPublic, summary="status, progress, size and timings of a context",
            responses=error_responses(404))
def get_context(cid: ContextId, rt: RuntimeDep):
    return _public(_get(rt, cid))


@router.patch("/{cid}", response_model=ContextPublic, summary="change ttl or display name",
              responses=error_responses(404, *BODY_ERRORS))
def patch_context(cid: ContextId, body: ContextPatch, rt: RuntimeDep):
    """The change goes into the stored manifest first (storage is the source of truth: a catalog rebuilt
    from it keeps the change), then into the catalog. Storage that cannot be written: 503
    `storage_unavailable`, nothing changed."""
    rec = _get(rt, cid)
    fields: dict = {}
    if body.ttl_seconds is not None:
        if body.ttl_seconds > rt.settings.max_ttl_seconds:
            raise ApiError(422, "invalid_parameter", f"ttl_seconds must be <= {rt.settings.max_ttl_seconds}")
        fields["expires_at"] = time.time() + body.ttl_seconds if body.ttl_seconds else None
    if body.display_name is not None:
        fields["display_name"] = body.display_name
    if not fields:
        return _public(rec)
    was_published = _write_manifest_metadata(rt, cid, rec, fields)
    if "expires_at" in fields:
        rt.catalog.set_expiry(cid, fields["expires_at"])
    if "display_name" in fields:
        rt.catalog.update(cid, display_name=fields["display_name"])
    if not was_published:  # published meanwhile, possibly from the record as it was before this PATCH
        _write_manifest_metadata(rt, cid, rec, fields)
    return _public(_get(rt, cid))


def _write_manifest_metadata(rt, cid: PromptHash, rec: dict, fields: dict) -> bool:
    """Write `fields` into the context's manifest; False when it is not published yet (the prefill
    worker copies the record's values into the manifest when it publishes)."""
    try:
        rt.store.update_metadata(rec.get("slug") or rt.lm.spec.slug, cid, **fields)
    except ArtifactMissing:
        return False
    except ArtifactCorrupt:
        return True  # an unreadable manifest: the catalog still takes the change; fsck reports the context
    except OSError as e:
        raise ApiError(503, "storage_unavailable",
                       f"the context's manifest could not be written ({e.strerror or type(e).__name__}); nothing changed") from None
    return True


@router.delete("/{cid}", status_code=204, summary="remove a context and its artifacts", responses=error_responses(404))
def delete(cid: ContextId, rt: RuntimeDep, request: Request):
    _get(rt, cid)
    delete_context(rt, cid)
    for hook in getattr(request.app.state, "on_delete", []):
        hook(cid)
    return Response(status_code=204)


@router.post(
    "/{cid}/completions",
    response_model=CompletionResponse,
    summary="answer a question over the context",
    responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream=true"},
               **error_responses(404, 409, 504, *BODY_ERRORS)},
)
async def complete(cid: ContextId, body: CompletionRequest, rt: RuntimeDep, request: Request, dc: DecodeClientDep):
    """The checks and the question's tokenizing run in a worker thread (briefly); the wait for the
    answer holds no thread (service/api/decode_client.py). A client that disconnects, JSON or SSE,
    cancels its generation."""
    rec, job = await run_in_threadpool(_completion_job, rt, cid, body)
    sub = await dc.submit(job)
    deadline = time.monotonic() + rt.settings.decode_timeout_seconds
    method = job["method"]
    if body.stream:
        return EventSourceResponse(_sse(dc, sub, request, rec["id"], method, deadline))
    async with aclosing(dc.events(sub, request, deadline, tokens=False)) as events:
        async for event, data in events:
            if event == "done":
                metrics.completion_ended(method, "ok", data["stats"])
                return CompletionResponse(id=sub.rid, context_id=rec["id"], **data)
            metrics.completion_ended(method, data["code"])
            raise ApiError(ERROR_STATUS.get(data["code"], 500), data["code"], data["message"])
    metrics.completion_ended(method, "disconnected")
    return Response(status_code=499)  # the client is gone (nginx's "client closed request"): nobody reads this


def _completion_job(rt, cid: PromptHash, body: CompletionRequest,
                    question_ids: Callable[[dict], list[int]] | None = None) -> tuple[dict, dict]:
    """Check a completion request against its context; returns the context's record and the decode
    job to queue (blocking: catalog reads and the question's tokenizing). `question_ids(record)`:
    the tokens to append after the context (default: `body.question` in the context's prompt
    format; the OpenAI-compatible routes render their messages or prompt instead)."""
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
    q_ids = (question_ids(rec) if question_ids is not None
             else rt.lm.question_ids(body.question, rec.get("prompt_format", "chat")))
    total = rec["n_tokens"] + len(q_ids) + body.max_tokens
    if total > rt.lm.spec.max_positions:
        raise ApiError(422, "too_long", f"context + question + max_tokens = {total} > {rt.lm.spec.max_positions} positions")
    if body.backend is not None and body.backend not in backend_names():
        raise ApiError(422, "unsupported_configuration", f"attention backend {body.backend!r} is not installed here; "
                                                         f"available: {', '.join(backend_names())}")
    _within_limits(rt, method, params, body.params, rec["n_tokens"], "params", (len(q_ids), body.max_tokens))
    return rec, {
        "id": cid, "question_ids": q_ids, "max_tokens": body.max_tokens, "temperature": body.temperature,
        "seed": body.seed, "method": method.name, "params": params.model_dump(), "index_id": index_id,
        "backend": body.backend,
    }


async def _sse(dc: DecodeClient, sub: Submission, request: Request, cid: str, method: str, deadline: float):
    """The request's events as SSE events; a disconnect cancels it (`DecodeClient.events`)."""
    async with aclosing(dc.events(sub, request, deadline)) as events:
        async for event, data in events:
            if event == "token":
                yield {"event": "token", "data": json.dumps(data)}
            elif event == "done":
                metrics.completion_ended(method, "ok", data["stats"])
                yield {"event": "done", "data": json.dumps({"id": sub.rid, "context_id": cid, **data})}
            else:
                metrics.completion_ended(method, data["code"])
                yield {"event": "error", "data": json.dumps({"error": data})}
