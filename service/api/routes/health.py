"""Liveness, readiness, metrics, method discovery."""

from __future__ import annotations

import os
import tempfile

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from indexer.base import get_method, method_names
from service.api.deps import RuntimeDep
from service.metrics import api_collectors
from service.schemas import MethodDescription, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="liveness: the process answers")
def healthz():
    return {"status": "ok"}


@router.get("/readyz", summary="readiness: catalog (Redis), storage and model are usable",
            responses={200: {"model": Readiness}, 503: {"model": Readiness, "description": "a check failed"}})
def readyz(rt: RuntimeDep):
    checks: dict[str, dict] = {}
    try:
        rt.catalog.ping()
        checks["redis"] = {"ok": True, "embedded": rt.settings.embedded}
    except Exception as e:  # noqa: BLE001
        checks["redis"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    probe = getattr(rt.store, "storage_check", None)  # object storage probes the bucket (storage/objstore.py)
    checks["storage"] = probe() if probe else _storage_check(rt.store.root)
    checks["model"] = {"ok": rt.lm is not None, "name": rt.lm.spec.name, "fingerprint": rt.lm.spec.fingerprint[:16]}
    if checks["redis"]["ok"]:
        workers = {k: rt.heartbeats.live(k) for k in ("prefill", "decode")}
        # a train worker is optional (only training jobs need one): reported, not required
        checks["workers"] = {"ok": all(workers.values()), **workers, "train": rt.heartbeats.live("train")}
    ok = all(c["ok"] for c in checks.values())
    return JSONResponse({"status": "ready" if ok else "not_ready", "checks": checks}, status_code=200 if ok else 503)


def _storage_check(root) -> dict:
    """Write, sync and remove a small file in the storage root: permission bits alone miss a full
    disk, a read-only mount or a file-size limit, all of which fail a build. The path is reported
    relative to the data dir (no absolute server paths)."""
    out = {"ok": True, "path": f"<data_dir>/{root.name}"}
    try:
        with tempfile.NamedTemporaryFile(dir=root, prefix=".readyz-") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        out.update(ok=False, error=f"storage cannot be written: {e.strerror or type(e).__name__}")
    return out


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
def metrics(rt: RuntimeDep):
    """This process's counters (and, in embedded mode, its worker threads'), the queue depths and
    every live decode worker's tiers; names in service/metrics.py and docs/operations.md ("Metrics")."""
    return Response(generate_latest() + generate_latest(api_collectors(rt)), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/methods", response_model=list[MethodDescription], tags=["methods"], summary="sparse methods and their parameters")
def list_methods():
    out = []
    for name in method_names():
        m = get_method(name)
        out.append(MethodDescription(name=name, has_index=m.has_index, params_schema=m.Params.model_json_schema(),
                                     build_fields=sorted(m.Params.build_fields)))
    return out
