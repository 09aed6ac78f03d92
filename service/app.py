"""The FastAPI application. `create_app(settings)` wires the runtime and, in embedded mode (no
Redis URL), runs the prefill, decode and train workers and the janitor as threads of this process."""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

import fastapi_offline
from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.middleware.trustedhost import TrustedHostMiddleware

from service.api.decode_client import DecodeClient
from service.api.routes import admin, contexts, health, openai, training
from service.auth import ApiKeyGuard, document_bearer_auth
from service.errors import error_body, install_error_handlers
from service.maintenance import rebuild_catalog
from service.ratelimit import RateLimitGuard, RateLimits, document_rate_limits
from service.runtime import Runtime
from service.settings import Settings, get_settings

log = logging.getLogger("ctxcache")


class RequestGuard:
    """Checks a request body before any route sees it: 413 over the size limit (declared or
    streamed), 400 `invalid_utf8` for a body that is not UTF-8. The body (bounded by the limit) is
    buffered and replayed to the app."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _reject(send, 413, "payload_too_large", f"request body exceeds {self.max_bytes} bytes")
        parts, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                return await _reject(send, 413, "payload_too_large", f"request body exceeds {self.max_bytes} bytes")
            more = msg.get("more_body", False)
        body = b"".join(parts)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _reject(send, 400, "invalid_utf8", f"request body is not valid UTF-8 (byte {e.start})")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


DOCS_ASSETS = "/docs-assets"  # where the API docs' scripts, styles and icon are served


def docs_asset_paths() -> set[str]:
    """The URL of every file the docs pages load (open without an API key, like the pages)."""
    static = Path(fastapi_offline.__file__).parent / "static"
    return {f"{DOCS_ASSETS}/{f.name}" for f in static.iterdir() if f.is_file()}


async def _reject(send, status: int, code: str, message: str) -> None:
    body = json.dumps(error_body(code, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(settings: Settings | None = None, *, lm=None) -> FastAPI:
    """`lm`: an already loaded decoder.model.LoadedModel to share (tests, embedded serve)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from service.jobs.decode import DecodeWorker
        from service.jobs.janitor import Janitor
        from service.jobs.prefill import PrefillWorker
        from service.jobs.train import TrainWorker

        rt = Runtime.create(settings, lm=lm)
        app.state.runtime = rt
        app.state.on_delete = []
        workers = []
        if settings.workers_in_process:
            decode = DecodeWorker(rt)
            app.state.on_delete.append(decode.forget)
            workers = [PrefillWorker(rt), decode, TrainWorker(rt), Janitor(rt, on_delete=decode.forget)]
        else:
            workers = [Janitor(rt)]
        try:  # storage is the truth: re-add what the catalog lost (FLUSHDB, a fresh Redis)
            rebuild_catalog(rt)
        except OSError as e:  # storage unreachable (a bucket down): start anyway; /readyz says so
            log.error("catalog rebuild from storage failed at start (%s); run POST /v1/admin/rebuild-catalog "
                      "once storage is back", type(e).__name__)
        for w in workers:
            w.start()
        app.state.workers = workers
        app.state.decode = DecodeClient(rt)
        app.state.rate_limits = RateLimits(settings.rate_limit, settings.rate_limit_expensive,
                                           app.state.decode.r.connection_pool, settings.key_prefix)
        try:
            yield
        finally:
            # The server has given in-flight requests `shutdown_grace_seconds` (uvicorn's graceful
            # shutdown) before this runs: the workers now stop at once, joined within a bound (a
            # prefill chunk in flight cannot be interrupted; its job is leased and built again on the
            # next start), then the catalog's connections close and the embedded Redis shuts down.
            end = time.monotonic() + min(5.0, settings.shutdown_grace_seconds)
            for w in workers:
                w.request_stop(0.0)
            for w in workers:
                w.join(end - time.monotonic())
            await app.state.decode.aclose()
            rt.close()

    # Swagger UI (/docs) and ReDoc (/redoc) with their scripts and styles served by this app from the
    # fastapi-offline package (FastAPI's default pages load them from a CDN: blank on an offline machine)
    app = FastAPIOffline(
        static_url=DOCS_ASSETS,
        title="ctxcache",
        version="0.1.0",
        summary="Register a long context once; ask many questions with sparse decode over its stored KV.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(contexts.router)
    app.include_router(training.router)
    app.include_router(admin.router)
    app.include_router(openai.router)
    app.add_middleware(RequestGuard, max_bytes=settings.max_request_bytes)
    if settings.rate_limit or settings.rate_limit_expensive:  # inside the key guard: counts valid keys only
        app.add_middleware(RateLimitGuard, by_key=bool(settings.api_keys))
        document_rate_limits(app, {k for k, v in (("standard", settings.rate_limit),
                                                  ("expensive", settings.rate_limit_expensive)) if v})
    if settings.api_keys:  # outside RequestGuard: a request without a key is refused before its body is read
        open_paths = {"/healthz", "/docs", "/redoc", app.openapi_url, app.swagger_ui_oauth2_redirect_url,
                      *docs_asset_paths()} - {None}
        app.add_middleware(ApiKeyGuard, keys=[k.get_secret_value() for k in settings.api_keys], open_paths=open_paths)
        document_bearer_auth(app, open_paths)
    if settings.allowed_hosts:  # outermost: a request for another Host gets 400 before anything reads it
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.allowed_hosts)
    return app
