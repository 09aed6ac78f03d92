"""Errors with stable codes. Every error body is `{"error": {"code", "message", "details"?}}`."""

from __future__ import annotations

import logging
from pathlib import Path

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from service.schemas import ErrorResponse

log = logging.getLogger("ctxcache")

# What each error status means, with its codes, for the OpenAPI document (`error_responses`).
STATUS_CODES = {
    400: "malformed_json, invalid_utf8: the body is not JSON / not UTF-8",
    404: "not_found: no such context, job or method",
    409: "the resource's state forbids it (context_not_ready, method_not_built, method_unavailable, "
         "training_in_progress, model_exists, job_finished)",
    413: "payload_too_large: body over max_request_bytes",
    422: "validation_error (schema), invalid_parameter, over_budget (estimated cost over the budget), "
         "context_too_long, too_long, unknown_method, unknown_model, unsupported_configuration, ...",
    429: "rate_limited: over the API key's rate limit (rate_limit, rate_limit_expensive); Retry-After says when to retry",
    500: "internal_error, artifact_corrupt, artifact_missing (details in the server log)",
    503: "dependency_unavailable (Redis), no_decode_worker, decode_worker_lost, storage_unavailable (a manifest "
         "could not be written)",
    504: "decode_timeout: the decode worker did not finish within decode_timeout_seconds",
}


def error_responses(*statuses: int) -> dict:
    """`responses=` for a route: each status it may answer with the error body's schema. Every
    route may also answer 500 (unexpected) and 503 (Redis down): included."""
    return {s: {"model": ErrorResponse, "description": STATUS_CODES[s]} for s in sorted({*statuses, 422, 500, 503})}


def _document_errors(schema: dict) -> dict:
    """The OpenAPI document with the real error shape on every operation: FastAPI's automatic 422
    (`HTTPValidationError`, a shape this service never sends) replaced by `ErrorResponse`, and 500
    (unexpected) and 503 (Redis down), which any route may answer, added where missing."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for item in schema.get("paths", {}).values():
        for op in item.values():
            responses = op.setdefault("responses", {})
            if "422" in responses:
                responses["422"] = {"description": STATUS_CODES[422], "content": ref}
            for status in ("500", "503"):
                responses.setdefault(status, {"description": STATUS_CODES[int(status)], "content": ref})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema


BODY_ERRORS = (400, 413, 422)  # what any route with a JSON body may answer before it runs (RequestGuard, schema)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, details=None):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


INTERNAL_ERROR_MESSAGE = "internal error; see the server log"  # what a client learns of an unexpected failure


def error_body(code: str, message: str, details=None) -> dict:
    err = {"code": code, "message": message}
    if details is not None:
        err["details"] = details
    return {"error": err}


def redact_paths(value, data_dir: Path):
    """A client-facing message (or details) with server paths under the data dir written relative
    to it (`<data_dir>/...`): clients learn where things are in the service's terms, not the host's."""
    if isinstance(value, str):
        for root in sorted({str(data_dir.resolve()), str(data_dir.absolute())}, key=len, reverse=True):
            value = value.replace(root, "<data_dir>")
        return value
    if isinstance(value, dict):
        return {k: redact_paths(v, data_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_paths(v, data_dir) for v in value]
    return value


def _allowed_methods(request: Request) -> str:
    """Every method some route of this path accepts, from the OpenAPI document's paths (Starlette's
    405 names only the methods of the first route that matched the path)."""
    methods: set[str] = set()
    for template, item in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {m.upper() for m in item if m.upper() in _VERBS}
    if "GET" in methods:
        methods.add("HEAD")  # Starlette answers HEAD wherever it answers GET
    return ", ".join(sorted(methods))


_VERBS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})


def _json_safe(errors: list[dict]) -> list[dict]:
    out = []
    for e in errors:
        item = {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type", "")}
        out.append(item)
    return out


def install_error_handlers(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _document_errors(generate())
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        message, details = exc.message, exc.details
        if exc.code == "internal_error":  # a worker's exception text: kept in the server log only
            log.error("internal error on %s %s: %s", request.method, request.url.path, message)
            message, details = INTERNAL_ERROR_MESSAGE, None
        runtime = getattr(request.app.state, "runtime", None)
        if runtime is not None:
            message, details = redact_paths(message, runtime.settings.data_dir), redact_paths(details, runtime.settings.data_dir)
        return JSONResponse(error_body(exc.code, message, details), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            # (a body that is not UTF-8 never gets here: service.app.RequestGuard answers invalid_utf8)
            return JSONResponse(error_body("malformed_json", "request body is not valid JSON", _json_safe(errors)), status_code=400)
        return JSONResponse(error_body("validation_error", "request does not match the schema", _json_safe(errors)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # FastAPI's own errors (unparseable body, unknown route, wrong verb) in our error shape
        codes = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed"}
        code = codes.get(exc.status_code, f"http_{exc.status_code}")
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def _redis_down(request: Request, exc: Exception):
        log.warning("redis unavailable: %s", exc)
        return JSONResponse(
            error_body("dependency_unavailable", "the catalog (Redis) is unreachable; retry shortly"), status_code=503
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", INTERNAL_ERROR_MESSAGE), status_code=500)
