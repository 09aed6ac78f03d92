"""Rate limits per API key (per client address when the service has no keys), shared through Redis
by every API process.

Two limits, each in the `limits` library's notation ("120/minute", "10 per hour"), unset = off:

* `rate_limit`: the routes that start work — registering a context and every completion route
  (ours and the OpenAI-compatible ones);
* `rate_limit_expensive`: the routes that start a lot of it — training (`POST /v1/methods/{name}/train`)
  and the admin routes (fsck, catalog rebuild).

Reads (status, listings, health) are not limited. A request over its limit answers 429
`rate_limited` with `Retry-After` (seconds until a slot frees) before its body is read, so it
changes nothing; a request the limiter refuses does not count.

The window is a moving one (`limits`' MovingWindowRateLimiter over its Redis storage): at most N
requests in any window-long span, no double burst at a window's edge as a fixed window allows.
An ASGI middleware, like the API-key guard, so the limited routes are one table here
(`LIMITED`), matched against the request's path before routing.

Who is counted: with `api_keys` set, the key (by a sha256 prefix of it: keys never reach Redis or
the logs); without keys, the client address as the server sees it (behind a reverse proxy, run
uvicorn with `--forwarded-allow-ips` so that it is the real client's, else every client shares
the proxy's budget). Redis unreachable → 503 `dependency_unavailable`, as on every route.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time

import redis
from limits import RateLimitItem, parse
from limits.aio.storage import RedisStorage
from limits.aio.strategies import MovingWindowRateLimiter
from starlette.routing import compile_path

from service.api.openai_errors import is_openai_path, openai_error_body
from service.auth import key_id
from service.errors import error_body

log = logging.getLogger("ctxcache")

RATE_LIMITED = "rate_limited"

# (method, route template) -> which limit applies: "standard" (`rate_limit`) or "expensive"
LIMITED: dict[tuple[str, str], str] = {
    ("POST", "/v1/contexts"): "standard",
    ("POST", "/v1/contexts/{cid}/completions"): "standard",
    ("POST", "/v1/chat/completions"): "standard",
    ("POST", "/v1/completions"): "standard",
    ("POST", "/v1/methods/{name}/train"): "expensive",
    ("POST", "/v1/admin/fsck"): "expensive",
    ("POST", "/v1/admin/rebuild-catalog"): "expensive",
}
_PATTERNS: list[tuple[str, re.Pattern, str, str]] = [
    (method, compile_path(template)[0], template, kind) for (method, template), kind in LIMITED.items()]


def limited_route(method: str, path: str) -> tuple[str, str] | None:
    """(route template, limit kind) of a limited route, or None."""
    for m, pattern, template, kind in _PATTERNS:
        if m == method and pattern.match(path):
            return template, kind
    return None


class RateLimits:
    """The limits in force and the Redis-backed limiter that counts them."""

    def __init__(self, standard: str | None, expensive: str | None, connection_pool, key_prefix: str):
        self.items: dict[str, RateLimitItem] = {
            kind: parse(spec) for kind, spec in (("standard", standard), ("expensive", expensive)) if spec}
        # the API's own asyncio connection pool (the decode client's): one Redis for everything, the
        # embedded one included (a unix socket)
        storage = RedisStorage("async+redis://", implementation="redispy", key_prefix=f"{key_prefix}ratelimit",
                               connection_pool=connection_pool)
        self.limiter = MovingWindowRateLimiter(storage)

    async def check(self, kind: str, template: str, who: str) -> int | None:
        """Count a request of `who` on a route; None when allowed, else the seconds until a slot
        frees (Retry-After). Each route has its own budget."""
        item = self.items.get(kind)
        if item is None:
            return None
        if await self.limiter.hit(item, who, template):
            return None
        reset, _ = await self.limiter.get_window_stats(item, who, template)
        return max(1, math.ceil(reset - time.time()))


class RateLimitGuard:
    """429 `rate_limited` with `Retry-After` for a request over its key's limit on a limited route
    (OpenAI's error shape on the OpenAI-compatible routes, ours elsewhere). The limiter is the
    app's `state.rate_limits`, created at startup (it needs the runtime's Redis)."""

    def __init__(self, app, by_key: bool):
        self.app, self.by_key = app, by_key

    async def __call__(self, scope, receive, send):
        route = limited_route(scope.get("method", ""), scope["path"]) if scope["type"] == "http" else None
        if route is None:
            return await self.app(scope, receive, send)
        template, kind = route
        who = self._who(scope)
        try:
            retry_after = await scope["app"].state.rate_limits.check(kind, template, who)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            log.warning("redis unavailable (rate limits): %s", e)
            return await _answer(send, 503, error_body("dependency_unavailable",
                                                       "the catalog (Redis) is unreachable; retry shortly"))
        if retry_after is None:
            return await self.app(scope, receive, send)
        log.info("rate limited: %s on %s %s (retry after %d s)", who, scope["method"], template, retry_after)
        message = f"rate limit exceeded on {scope['method']} {template}; retry after {retry_after} s"
        body = (openai_error_body(429, RATE_LIMITED, message) if is_openai_path(scope["path"])
                else error_body(RATE_LIMITED, message, {"retry_after_seconds": retry_after}))
        await _answer(send, 429, body, [(b"retry-after", str(retry_after).encode())])

    def _who(self, scope) -> str:
        """`key:<sha256 prefix>` (keys on: the guard outside this one let only valid keys through),
        else `ip:<client address>`."""
        if self.by_key and (kid := key_id(scope)) is not None:
            return f"key:{kid}"
        client = scope.get("client")
        return f"ip:{client[0] if client else 'unknown'}"


async def _answer(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})


def document_rate_limits(app, kinds: set[str]) -> None:
    """The OpenAPI document lists 429 (with its `Retry-After` header) on the operations whose
    limit is on."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()
        for path, item in schema.get("paths", {}).items():
            for verb, op in item.items():
                if not isinstance(op, dict):
                    continue
                route = limited_route(verb.upper(), path)
                if route is None or route[1] not in kinds:
                    continue
                shape = "OpenAIErrorResponse" if is_openai_path(path) else "ErrorResponse"
                op.setdefault("responses", {}).setdefault("429", {
                    "description": "rate_limited: over this API key's (or client address's) rate limit",
                    "headers": {"Retry-After": {"description": "seconds until a request is allowed again",
                                                "schema": {"type": "integer"}}},
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}})
        return schema

    app.openapi = openapi
