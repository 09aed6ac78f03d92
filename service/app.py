"""The FastAPI application. `create_app(settings)` wires the runtime and, in embedded mode (no
Redis URL), runs the prefill, decode and train workers and the janitor as threads of this process."""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.routes import contexts, health, training
from service.errors import error_body, install_error_handlers
from service.runtime import Runtime
from service.settings import Settings, get_settings
from storage.keys import PromptHash

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
        from service.workers import DecodeWorker, Janitor, PrefillWorker, TrainWorker

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
        _rebuild_catalog(rt)
        for w in workers:
            w.start()
        app.state.workers = workers
        try:
            yield
        finally:
            for w in workers:
                w.stop()
            rt.close()

    app = FastAPI(
        title="ctxcache",
        version="0.1.0",
        summary="Register a long context once; ask many questions with sparse decode over its stored KV.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(contexts.router)
    app.include_router(training.router)
    app.add_middleware(RequestGuard, max_bytes=settings.max_request_bytes)
    return app


def _rebuild_catalog(rt: Runtime) -> int:
    """Re-add published contexts the catalog does not know (Redis data lost, or a fresh catalog)."""
    from indexer.base import get_method

    n = 0
    for slug, manifest in rt.store.iter_manifests():
        cid = manifest["prompt_hash"]
        if rt.catalog.get(cid) is not None:
            continue
        methods = {}
        for index_id, entry in manifest.get("indexes", {}).items():
            try:
                m = get_method(entry["method"])
                methods[entry["method"]] = {"params": m.Params.model_validate(entry["params"]).model_dump(), "index_id": index_id}
            except Exception:  # noqa: BLE001 - a method this build does not know: skip that index
                continue
        expires_at = manifest.get("expires_at")
        if expires_at and expires_at <= time.time():
            rt.store.delete(slug, PromptHash(cid))  # expired while the catalog was away
            continue
        record = {"model": manifest["model"]["name"], "slug": slug, "n_tokens": manifest["n_tokens"],
                  "prompt_format": manifest.get("prompt_format", "chat"), "display_name": manifest.get("display_name", ""),
                  "expires_at": expires_at or "",
                  "bytes": manifest["bytes"], "timings": json.dumps(manifest.get("timings", {}))}
        rt.catalog.add_ready(cid, record, methods, manifest)
        if expires_at:
            rt.catalog.r.zadd(rt.catalog.k_expiry, {cid: expires_at})
        n += 1
    if n:
        log.info("catalog: re-added %d contexts found on disk", n)
    return n
