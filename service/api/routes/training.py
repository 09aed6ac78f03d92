"""`/v1/methods/{name}/train`: offline training jobs, once per model (today: SAAP).

The same work as `ctxcache train saap`, run by a train worker (a thread of `ctxcache serve` in
embedded mode, `ctxcache worker train` otherwise) with the service's model and data dir, so the
trained model lands where `saap` registrations look for it (`<data_dir>/saap/<fingerprint[:16]>`).

* A job's id is the sha256 of what it trains (model fingerprint, resolved settings, corpus content):
  posting the same request again returns the same job (200) instead of training twice.
* The job trains on the service's `device` setting (auto: cuda when the worker sees a GPU), with
  its own copy of the weights; a request names no device. The device is not part of the job id nor of
  the trained model's settings hash: a GPU run equals a CPU run up to float noise.
* One job per model at a time (409 `training_in_progress`): two jobs would write one directory.
* DELETE cancels: a queued job at once, a running one at its worker's next check (see `cancel_job`).
* A trained model that exists already is not replaced unless `replace` is true (409 `model_exists`):
  contexts whose saap index was built with it answer 409 `method_not_built` once it changes (the
  digest is part of the index id) until they are registered again, which builds a new index.
"""

from __future__ import annotations

import hashlib
import json

from fastapi import APIRouter, Response
from pydantic import ValidationError

from service import limits
from service.api.deps import RuntimeDep
from service.errors import BODY_ERRORS, ApiError, error_responses
from service.runtime import resolve_device
from service.jobs.train_records import TrainConflict
from service.schemas import TrainJob, TrainJobCreated, TrainRequest
from storage.keys import TrainJobId

router = APIRouter(prefix="/v1/methods", tags=["training"])

TRAINABLE = ("saap",)


def _trainable(name: str) -> None:
    from indexer.base import method_names

    if name not in method_names():
        raise ApiError(404, "not_found", f"unknown method {name!r}; known: {', '.join(method_names())}")
    if name not in TRAINABLE:
        raise ApiError(422, "not_trainable", f"method {name!r} needs no offline training (trainable: {', '.join(TRAINABLE)})")


def _public(rec: dict, cls=TrainJob, **extra) -> TrainJob:
    err = {"code": rec["error_code"], "message": rec.get("error_message", "")} if rec.get("error_code") else None
    return cls(
        id=rec["id"], method=rec.get("method", "saap"), model=rec.get("model", ""), status=rec["status"],
        progress=rec.get("progress") or 0.0, phase=rec.get("phase") or rec["status"],
        layers_done=rec.get("layers_done") or 0, layers_total=rec.get("layers_total") or 0,
        settings=rec.get("settings") or {}, corpus=rec.get("corpus") or None, model_dir=rec.get("model_dir") or None,
        digest=rec.get("digest") or None, train_s=rec.get("train_s"), attempts=rec.get("attempts") or 0,
        created_at=rec.get("created_at") or 0.0, updated_at=rec.get("updated_at"), error=err,
        cancel_requested=bool(rec.get("cancel_requested")), **extra,
    )


def _corpus_digest(rt, name: str | None) -> str:
    """sha256 over the corpus directory's .txt files (names and bytes); 'builtin' for the built-in one."""
    if name is None:
        return "builtin"
    root = (rt.settings.data_dir / "corpora").resolve()
    path = (root / name).resolve()
    files = sorted(path.glob("*.txt")) if path.is_dir() and path.parent == root else []
    if not files:
        raise ApiError(422, "unknown_corpus", f"no corpus {name!r}: put .txt files in <data_dir>/corpora/{name} (or omit "
                                              f"`corpus` for the built-in one)")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


@router.post("/{name}/train", status_code=202, response_model=TrainJobCreated,
             responses={200: {"model": TrainJobCreated, "description": "the same job exists (queued, running or done)"},
                        **error_responses(404, 409, *BODY_ERRORS)},
             summary="train a method's per-model component (SAAP), as a job")
def train(name: str, body: TrainRequest, rt: RuntimeDep, response: Response):
    from indexer.saap_model import default_model_dir, read_manifest
    from training.settings import settings_from

    _trainable(name)
    spec = rt.lm.spec
    try:
        settings = settings_from(body.preset, clusters=body.clusters, steps=body.steps, hidden=body.hidden,
                                 n_docs=body.docs, doc_tokens=body.doc_tokens,
                                 layers=tuple(body.layers) if body.layers else None, seed=body.seed)
    except ValidationError as e:
        details = [{"loc": list(map(str, err["loc"])), "msg": err["msg"], "type": err["type"]} for err in e.errors()]
        raise ApiError(422, "invalid_parameter", "invalid training settings", details) from None
    bad = [x for x in settings.layers or () if not 1 <= x < spec.num_layers]
    if bad:
        raise ApiError(422, "invalid_parameter",
                       f"layers must be in [1, {spec.num_layers - 1}] (layer 0 always runs full attention); got {bad}")
    if resolve_device(rt.settings.device) == "cpu":  # on a GPU the full preset takes about an hour
        limits.check(limits.train_cost(spec, settings), rt.settings.train_budget_seconds)
    corpus = _corpus_digest(rt, body.corpus)
    settings_json = settings.model_dump(mode="json")
    what = {"method": name, "fingerprint": spec.fingerprint, "settings": settings_json, "corpus": corpus}
    jid = TrainJobId(hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest())
    out = default_model_dir(spec.fingerprint, rt.settings.data_dir)
    existing = read_manifest(out)
    cur = rt.train_jobs.get(jid)
    if cur is not None and cur["status"] == "done" and existing is not None and existing["digest"] == cur.get("digest"):
        response.status_code = 200
        return _public(cur, TrainJobCreated, created=False)
    if existing is not None and not body.replace and (cur is None or cur["status"] in ("done", "failed")):
        raise ApiError(409, "model_exists",
                       f"a trained SAAP model for {spec.name} exists under {out} (digest {existing['digest'][:16]}); "
                       f"pass replace=true to retrain it (contexts whose saap index was built with it must then be "
                       f"registered again)", {"model_dir": str(out), "digest": existing["digest"]})
    if cur is not None and cur["status"] == "done":
        cur = None  # done, but its model was replaced or removed since: train again
        rt.train_jobs.update(jid, status="failed", error_code="model_replaced",
                             error_message="the model this job trained was replaced or removed")
    record = {"method": name, "model": spec.name, "fingerprint": spec.fingerprint, "settings": settings_json,
              "corpus": body.corpus or "", "layers_total": len(settings.layers or range(1, spec.num_layers))}
    try:
        rec, created = rt.train_jobs.submit(jid, record)
    except TrainConflict as e:
        raise ApiError(409, "training_in_progress", f"{e}; wait for it (GET /v1/methods/{name}/train/{e.other})",
                       {"job_id": e.other}) from None
    if not created:
        response.status_code = 200
    return _public(rec, TrainJobCreated, created=created)


@router.get("/{name}/train", response_model=list[TrainJob], summary="training jobs, newest first",
            responses=error_responses(404, 422))
def list_jobs(name: str, rt: RuntimeDep):
    _trainable(name)
    return [_public(r) for r in rt.train_jobs.list() if r.get("method") == name]


def _job(rt, name: str, job_id: str) -> tuple[TrainJobId, dict]:
    try:
        jid = TrainJobId.from_string(job_id)
    except ValueError:
        rec = None
    else:
        rec = rt.train_jobs.get(jid)
    if rec is None or rec.get("method") != name:
        raise ApiError(404, "not_found", f"no {name} training job {job_id!r}")
    return jid, rec


@router.get("/{name}/train/{job_id}", response_model=TrainJob, summary="a training job's status and progress",
            responses=error_responses(404, 422))
def get_job(name: str, job_id: str, rt: RuntimeDep):
    _trainable(name)
    return _public(_job(rt, name, job_id)[1])


@router.delete("/{name}/train/{job_id}", response_model=TrainJob, summary="cancel a queued or running training job",
               responses={202: {"model": TrainJob, "description": "a running job was asked to stop"},
                          **error_responses(404, 409, 422)})
def cancel_job(name: str, job_id: str, rt: RuntimeDep, response: Response):
    """A queued job is `cancelled` at once (200). A running one is asked to stop (202,
    `cancel_requested`): its worker stops at the next check (between corpus windows and layers, and
    every 256 Adam steps) and the job ends `cancelled`; layers it finished stay checkpointed, so posting
    the same request again resumes from them. Cancelling a cancelled job is a no-op (200); a done or
    failed job answers 409 `job_finished`."""
    _trainable(name)
    jid, _ = _job(rt, name, job_id)
    rec = rt.train_jobs.cancel(jid)
    if rec["status"] in ("done", "failed"):
        raise ApiError(409, "job_finished", f"training job {job_id} is {rec['status']}: nothing to cancel",
                       {"status": rec["status"]})
    if rec["status"] == "running":
        response.status_code = 202
    return _public(rec)
