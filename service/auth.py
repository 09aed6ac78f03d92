"""API keys: with `api_keys` set, every request needs `Authorization: Bearer <key>` except the
liveness probe (`/healthz`) and the API documentation (`/docs`, `/redoc`, `/openapi.json`: the API's
shape is no secret, and Swagger UI's "Authorize" button needs the page). `/readyz` and `/metrics`
need a key (they name the model, the workers and the load; Prometheus and Kubernetes probes can
send a bearer token).

An ASGI middleware rather than a route dependency, so no route can be left out by forgetting it
(an unknown path answers 401 too, not 404: it does not reveal which paths exist). It runs before
the body is read: a request without a key never has its body buffered.

Keys are compared in constant time (`hmac.compare_digest` over sha256 digests, so not even a key's
length leaks) and never logged (`Settings.api_keys` holds `SecretStr`s).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from service.api.openai_errors import is_openai_path, openai_error_body
from service.errors import error_body

UNAUTHORIZED = "unauthorized"


class ApiKeyGuard:
    """401 `unauthorized` (OpenAI's error shape on the OpenAI-compatible routes, ours elsewhere) for
    a request to a protected path without a valid bearer key."""

    def __init__(self, app, keys: Iterable[str], open_paths: Iterable[str]):
        self.app = app
        self.digests = [_digest(k) for k in keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        message = "missing or invalid API key: send `Authorization: Bearer <key>`"
        body = (openai_error_body(401, UNAUTHORIZED, message) if is_openai_path(scope["path"])
                else error_body(UNAUTHORIZED, message))
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                                (b"www-authenticate", b'Bearer realm="ctxcache"')]})
        await send({"type": "http.response.body", "body": raw})

    def _authorized(self, scope) -> bool:
        token = bearer_token(scope)
        if token is None:
            return False
        given = _digest(token)
        ok = False
        for d in self.digests:  # every key compared: the time does not tell which one matched
            ok |= hmac.compare_digest(given, d)
        return ok


def bearer_token(scope) -> str | None:
    """The key of a request's `Authorization: Bearer <key>` header, or None."""
    header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
    if header is None:
        return None
    scheme, _, token = header.decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_id(scope) -> str | None:
    """Who a request's key is, for counting and logs: a sha256 prefix of the key (never the key)."""
    token = bearer_token(scope)
    return None if token is None else _digest(token).hex()[:16]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def document_bearer_auth(app, open_paths: Iterable[str]) -> None:
    """The OpenAPI document declares the bearer scheme (Swagger UI's "Authorize" button) on every
    operation but the open ones."""
    generate, open_set = app.openapi, frozenset(open_paths)

    def openapi() -> dict:
        schema = generate()
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
            "type": "http", "scheme": "bearer", "description": "one of the service's api_keys"}
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                if not isinstance(op, dict):
                    continue
                op["security"] = [] if path in open_set else [{"apiKey": []}]
                if path not in open_set:
                    op.setdefault("responses", {}).setdefault("401", {
                        "description": "unauthorized: no valid `Authorization: Bearer <key>`",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        return schema

    app.openapi = openapi
