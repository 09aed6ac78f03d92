"""The errors of the OpenAI-compatible routes (`service/api/routes/openai.py`), in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` with our stable codes in `code`; the native
routes' 422s answer 400 here (what OpenAI clients expect). The API key and rate-limit guards answer
these paths in this shape too (`is_openai_path`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import ApiError, redact_paths

log = logging.getLogger("ctxcache")

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


def is_openai_path(path: str) -> bool:
    """Whether `path` is one of these routes (their errors take OpenAI's shape)."""
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def openai_error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    kind = ("authentication_error" if status == 401 else "permission_error" if status == 403
            else "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIError(ApiError):
    """An ApiError that names the request field at fault (OpenAI's `param`)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(status, code, message)
        self.param = param


def error_response(request: Request, status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    if code == "internal_error":  # a worker's exception text: kept in the server log only
        log.error("internal error on %s %s: %s", request.method, request.url.path, message)
        message = "internal error; see the server log"
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is not None:
        message = redact_paths(message, runtime.settings.data_dir)
    status = 400 if status == 422 else status  # OpenAI answers invalid parameters with 400
    return JSONResponse(openai_error_body(status, code, message, param), status_code=status)


class OpenAIRoute(APIRoute):
    """A route whose errors take OpenAI's shape (the app's handlers answer in ours)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except OpenAIError as e:
                return error_response(request, e.status, e.code, e.message, e.param)
            except ApiError as e:
                return error_response(request, e.status, e.code, e.message)
            except RequestValidationError as e:
                errors = e.errors()
                if any(err.get("type") == "json_invalid" for err in errors):
                    return error_response(request, 400, "malformed_json", "request body is not valid JSON")
                first = errors[0] if errors else {}
                loc = [str(x) for x in first.get("loc", ()) if x != "body"]
                return error_response(request, 400, "validation_error",
                                       f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}", ".".join(loc) or None)
            except StarletteHTTPException as e:
                return error_response(request, e.status_code, f"http_{e.status_code}", str(e.detail))
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                log.warning("redis unavailable: %s", e)
                return error_response(request, 503, "dependency_unavailable", "the catalog (Redis) is unreachable; retry shortly")

        return route

