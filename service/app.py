"""The FastAPI application. `create_app(settings)` wires the runtime and, in embedded mode (no
Redis URL), runs the prefill and decode workers and the janitor as threads of this process."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api.routes import contexts, health
from service.errors import error_body, install_error_handlers
from service.runtime import Runtime
from service.settings import Settings, get_settings

log = logging.getLogger("ctxcache")


class BodyLimit:
    """413 for request bodies over the limit (declared or streamed), before any parsing."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send):
        import json

        body = json.dumps(error_body("payload_too_large", f"request body exceeds {self.max_bytes} bytes")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def create_app(settings: Settings | None = None, *, lm=None) -> FastAPI:
    """`lm`: an already loaded decoder.model.LoadedModel to share (tests, embedded serve)."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from service.workers import DecodeWorker, Janitor, PrefillWorker

        rt = Runtime.create(settings, lm=lm)
        app.state.runtime = rt
        app.state.on_delete = []
        workers = []
        if settings.workers_in_process:
            decode = DecodeWorker(rt)
            app.state.on_delete.append(decode.forget)
            workers = [PrefillWorker(rt), decode, Janitor(rt, on_delete=decode.forget)]
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
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
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
        record = {"model": manifest["model"]["name"], "slug": slug, "n_tokens": manifest["n_tokens"],
                  "prompt_format": manifest.get("prompt_format", "chat"), "display_name": "",
                  "bytes": manifest["bytes"], "timings": json.dumps(manifest.get("timings", {}))}
        rt.catalog.add_ready(cid, record, methods, manifest)
        n += 1
    if n:
        log.info("catalog: re-added %d contexts found on disk", n)
    return n
