"""Liveness, readiness, metrics, method discovery."""

from __future__ import annotations

import os

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from indexer.base import get_method, method_names
from service.api.deps import RuntimeDep
from service.schemas import MethodDescription

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="liveness: the process answers")
def healthz():
    return {"status": "ok"}


@router.get("/readyz", summary="readiness: catalog (Redis), storage and model are usable")
def readyz(rt: RuntimeDep):
    checks: dict[str, dict] = {}
    try:
        rt.catalog.ping()
        checks["redis"] = {"ok": True, "embedded": rt.settings.embedded}
    except Exception as e:  # noqa: BLE001
        checks["redis"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    root = rt.store.root
    checks["storage"] = {"ok": root.is_dir() and os.access(root, os.W_OK), "path": str(root)}
    checks["model"] = {"ok": rt.lm is not None, "name": rt.lm.spec.name, "fingerprint": rt.lm.spec.fingerprint[:16]}
    if checks["redis"]["ok"]:
        workers = {k: rt.catalog.live_workers(k) for k in ("prefill", "decode")}
        # a train worker is optional (only training jobs need one): reported, not required
        checks["workers"] = {"ok": all(workers.values()), **workers, "train": rt.catalog.live_workers("train")}
    ok = all(c["ok"] for c in checks.values())
    return JSONResponse({"status": "ready" if ok else "not_ready", "checks": checks}, status_code=200 if ok else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
def metrics():
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/methods", response_model=list[MethodDescription], tags=["methods"], summary="sparse methods and their parameters")
def list_methods():
    out = []
    for name in method_names():
        m = get_method(name)
        out.append(MethodDescription(name=name, has_index=m.has_index, params_schema=m.Params.model_json_schema(),
                                     build_fields=sorted(m.Params.build_fields)))
    return out
