"""Errors with stable codes. Every error body is `{"error": {"code", "message", "details"?}}`."""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

log = logging.getLogger("ctxcache")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, details=None):
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details


def error_body(code: str, message: str, details=None) -> dict:
    err = {"code": code, "message": message}
    if details is not None:
        err["details"] = details
    return {"error": err}


def _json_safe(errors: list[dict]) -> list[dict]:
    out = []
    for e in errors:
        item = {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": e.get("type", "")}
        out.append(item)
    return out


async def _body_is_utf8(request: Request) -> bool:
    try:
        (await request.body()).decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(error_body(exc.code, exc.message, exc.details), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            if not await _body_is_utf8(request):
                return JSONResponse(error_body("invalid_utf8", "request body is not valid UTF-8"), status_code=400)
            return JSONResponse(error_body("malformed_json", "request body is not valid JSON", _json_safe(errors)), status_code=400)
        return JSONResponse(error_body("validation_error", "request does not match the schema", _json_safe(errors)), status_code=422)

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
        return JSONResponse(error_body("internal_error", "internal error; see the server log"), status_code=500)
