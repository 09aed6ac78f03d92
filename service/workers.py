"""Workers: prefill (build + persist), decode (answer questions), train (offline SAAP training jobs),
janitor (expiry, stale jobs).

Each runs as a loop over Redis queues, in its own process (`ctxcache worker prefill|decode|train`) or as
a thread of the API process in embedded mode: the same code either way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

from decoder.backends import get_backend
from decoder.generate import generate
from decoder.pipeline import ContextTiers, build_context, open_context
from indexer.base import MethodUnavailable, get_method
from service import metrics
from service.errors import INTERNAL_ERROR_MESSAGE, redact_paths
from service.maintenance import restore_record
from service.runtime import Runtime, resolve_backend, resolve_device, resolve_gpu_cache_bytes, resolve_runner
from storage.artifacts import ArtifactCorrupt, ArtifactError, ArtifactMissing
from storage.keys import KV_DTYPES, PromptHash

log = logging.getLogger("ctxcache.worker")


class _Loop:
    kind = "worker"

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.wid = uuid.uuid4().hex[:8]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "_Loop":
        self._thread = threading.Thread(target=self.run_forever, name=f"ctxcache-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.request_stop(timeout)
        self.join(timeout)

    def request_stop(self, grace_s: float = 0.0) -> None:
        """Stop taking work; what is in flight may finish for `grace_s` (where the loop can tell)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(max(0.0, timeout))

    @property
    def liveness_ttl_s(self) -> int:
        """How long this worker's heartbeat key lives: a worker silent this long counts as dead."""
        return 15

    def info(self) -> dict:
        """What this worker publishes with its heartbeat (the API's /metrics reads it)."""
        return {}

    def run_forever(self) -> None:
        if self.rt.settings.torch_threads:
            torch.set_num_threads(self.rt.settings.torch_threads)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.rt.catalog.worker_alive(self.kind, self.wid, ttl_s=self.liveness_ttl_s, info=self.info())
                self.tick()
                backoff = 0.5
            except Exception as e:  # noqa: BLE001 - a worker must survive Redis outages and bad jobs
                log.warning("%s %s: %s", self.kind, self.wid, e, exc_info=not _is_redis_down(e))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def tick(self) -> None:
        raise NotImplementedError


def _is_redis_down(e: Exception) -> bool:
    import redis

    return isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))


class _LeasedLoop(_Loop):
    """Claims one leased job at a time and keeps its lease alive while `process` runs (and the
    worker's own heartbeat, so a worker busy with a long job still counts as live). A crash leaves
    the job in the active list; once its lease expires the janitor requeues it."""

    def claim(self) -> dict | None:
        raise NotImplementedError

    def process(self, job: dict) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        job = self.claim()
        if job is None:
            return
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(job, beat_stop), daemon=True)
        beat.start()
        try:
            self.process(job)
        finally:
            beat_stop.set()
            beat.join()
            self.rt.catalog.finish_job(job)

    def _heartbeat(self, job: dict, stop: threading.Event) -> None:
        lease = self.rt.settings.job_lease_seconds
        while not stop.wait(max(1.0, min(lease, self.liveness_ttl_s) / 3)):
            try:
                self.rt.catalog.heartbeat(job, lease)
                self.rt.catalog.keep_alive(self.kind, self.wid, self.liveness_ttl_s)
            except Exception:  # noqa: BLE001
                log.warning("heartbeat failed for job %s", job["id"])


class PrefillWorker(_LeasedLoop):
    """Claims a prefill job, runs the model over the context, builds the requested indexes and
    publishes everything atomically."""

    kind = "prefill"

    def claim(self) -> dict | None:
        return self.rt.catalog.claim_prefill(timeout_s=1.0, lease_s=self.rt.settings.job_lease_seconds)

    def process(self, job: dict) -> None:
        rt, cat, cid = self.rt, self.rt.catalog, job["id"]
        rec = cat.get(cid)
        if rec is None:
            return  # deleted (or expired) before we got to it
        try:
            self._build(cid, rec)
        except Exception as e:  # noqa: BLE001 - any failure becomes the context's status, never a lost job
            log.exception("prefill of %s failed", cid)
            metrics.job_finished(self.kind, "failed")
            code = "artifact_corrupt" if isinstance(e, ArtifactCorrupt) else "build_failed"
            cat.update(cid, status="failed", error_code=code,
                       error_message=redact_paths(f"{type(e).__name__}: {e}"[:2000], self.rt.settings.data_dir))
        else:
            metrics.job_finished(self.kind, "done")

    def _build(self, cid: str, rec: dict) -> None:
        rt, cat = self.rt, self.rt.catalog
        lm = rt.ensure_weights()
        spec = lm.spec
        if rec.get("slug") != spec.slug:
            raise RuntimeError(f"context was registered for model {rec.get('model')} ({rec.get('slug')}); this worker serves {spec.slug}")
        key = PromptHash(cid)
        methods = {m: v for m, v in (rec.get("methods") or {}).items() if v.get("index_id")}  # index-free: nothing to build
        published = rt.store.exists(spec.slug, key) and self._intact(cid, spec.slug, key)
        if published:
            manifest = rt.store.read_manifest(spec.slug, key)
            todo = {m: v for m, v in methods.items() if v["index_id"] not in manifest["indexes"]}
            if not todo:
                self._ready(cid, spec.slug, manifest)
                return
            tokens = rt.store.open(spec.slug, key).read("tokens").tolist()
            kv_dtype = None  # its K/V are stored already; only indexes are added
        else:
            todo = methods
            tokens = cat.tokens(cid)
            if tokens is None:
                raise RuntimeError("token ids of this context are gone from the catalog; register it again")
            kv_dtype = self._kv_dtype(cid, spec, tokens, rec.get("kv_dtype"))
        cat.update(cid, status="prefilling", progress=0.0, error_code="", error_message="")
        last = [0.0]

        def progress(f: float) -> None:
            if f >= 1.0:
                cat.update(cid, status="indexing", progress=0.8)
            elif f - last[0] >= 0.05:
                last[0] = f
                cat.update(cid, progress=round(0.8 * f, 3))

        def on_index(i: int, n: int) -> None:
            cat.update(cid, progress=round(0.8 + 0.15 * i / n, 3))

        todo_built = {}
        for name, entry in todo.items():
            method = get_method(name)
            todo_built[entry["index_id"]] = (method, method.Params.model_validate(entry["params"]))
        res = build_context(lm, rt.store, key, tokens, todo_built, env=rt.method_env,
                            chunk_tokens=rt.settings.prefill_chunk_tokens, progress=progress, on_index=on_index,
                            manifest_extra={"prompt_format": rec.get("prompt_format", "chat"),
                                            "display_name": rec.get("display_name") or "",
                                            "expires_at": rec.get("expires_at")},
                            kv_dtype=kv_dtype)
        manifest = res.manifest
        if not self._ready(cid, spec.slug, manifest):
            if cat.was_deleted(cid):
                rt.store.delete(spec.slug, key)  # deleted while we were building: leave nothing behind
            else:  # the record vanished without a delete (Redis lost its data): storage is the truth
                log.warning("context %s: its record vanished during the build; re-added from the manifest", cid)
                restore_record(rt, spec.slug, manifest)
        cat.drop_tokens(cid)

    @staticmethod
    def _kv_dtype(cid: str, spec, tokens: list[int], recorded: str | None) -> str:
        """The dtype to store the K/V in: the one the context id was computed with (the record's,
        set by the API from `kv_dtype`, tried first). A record without it (registered before the
        setting, or restored from a manifest) still gets the id's dtype; tokens that hash to the id
        under no dtype are refused rather than stored under a wrong id."""
        for dt in dict.fromkeys([d for d in (recorded, *KV_DTYPES) if d in KV_DTYPES]):
            if PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, tokens, dt).hex == cid:
                return dt
        raise RuntimeError("the context's token ids do not hash to its id under any kv dtype; register it again")

    def _intact(self, cid: str, slug: str, key: PromptHash) -> bool:
        """Whether a published context verifies chunk by chunk (`ContextStore.verify`). A context is
        never marked ready from a manifest whose chunks fail: a damaged one is removed here and built
        again (its token ids kept in the catalog first, when the catalog lost them and the stored
        ones verify)."""
        rt, cat = self.rt, self.rt.catalog
        try:
            problems = rt.store.verify(slug, key)
        except ArtifactCorrupt as e:  # the manifest itself is unreadable
            problems = [str(e)]
        if not problems:
            return True
        log.error("context %s: stored artifacts are damaged, rebuilding (%d problems, first: %s)",
                  cid, len(problems), problems[0])
        if cat.tokens(cid) is None and not any(p.startswith("tokens") for p in problems):
            with contextlib.suppress(ArtifactError, ValueError):
                cat.set_tokens(cid, rt.store.open(slug, key).read("tokens").tolist())
        rt.store.delete(slug, key)
        return False

    def _ready(self, cid: str, slug: str, manifest: dict) -> bool:
        """Mark the context ready; then write its current name and expiry into the manifest (a PATCH
        or a re-registration may have changed them since the build started). False: no record."""
        cat = self.rt.catalog
        if not cat.update(cid, status="ready", progress=1.0, n_tokens=manifest["n_tokens"], bytes=manifest["bytes"],
                          timings=manifest.get("timings", {}), error_code="", error_message=""):
            return False
        rec = cat.get(cid)
        if rec is not None:
            try:
                self.rt.store.update_metadata(slug, PromptHash(cid), display_name=rec.get("display_name") or "",
                                              expires_at=rec.get("expires_at"))
            except (ArtifactError, OSError) as e:  # served from the catalog meanwhile; a rebuild would use the older values
                log.warning("context %s: could not write name/expiry into its manifest: %s", cid, e)
        return True


class DecodeWorker(_Loop):
    """Answers completion requests. Keeps a DRAM tier of artifact arrays (LRU by bytes), so only a
    context's first question reads from disk, and on a GPU a GPU tier above it, so a context's K/V
    and index arrays are copied to the device once and stay there across steps and requests.

    Two ways to run a request (`decode_runner`): the transformers path (`decoder.generate`: one
    request at a time through the model's own modules; the CPU default and the reference), or the
    batched runner (`decoder.runner.Runner`, the GPU default): up to `decode_batch_size` requests,
    on the same or different contexts and methods, stepped together one token at a time; a request
    joins at the next step and leaves when it is done (continuous batching). One runner per
    attention backend; each request keeps its own planner.

    Requests are leased (`Catalog.claim_decode`): a heartbeat thread renews the lease of every request
    the worker holds and the worker's liveness every third of `decode_lease_seconds`, also while a
    step or a whole serial generation runs, so a busy worker never looks dead and a dead one is
    noticed within the lease. A request whose client went away (`Catalog.cancel`) stops at its next
    decode step, or is dropped unstarted. On stop the worker takes no new requests, lets the held
    ones finish for the grace it was given and then gives them up (no answer, lease dropped), so the
    API retries them on another worker."""

    kind = "decode"

    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self.device = resolve_device(rt.settings.device)
        self.tiers = ContextTiers(rt.settings.dram_tier_bytes, resolve_gpu_cache_bytes(rt.settings, self.device),
                                  self.device)
        self._handles: OrderedDict[str, object] = OrderedDict()
        self.batched = resolve_runner(rt.settings, self.device)
        self._runners: dict[str, object] = {}  # backend name -> decoder.runner.Runner
        self._live: dict[tuple[str, int], _Live] = {}  # (backend, slot) -> a request in a runner
        self._runner_reasons: list[str] | None = None  # why the runner cannot run this model (None: not checked)
        self._held: dict[str, dict] = {}  # rid -> claimed request: leased until released (heartbeat thread reads it)
        self._held_lock = threading.Lock()
        self._abandon_at = float("inf")  # monotonic time after a stop when held requests are given up
        self._beat_stop = threading.Event()

    @property
    def tier(self):
        """The DRAM tier (kept for callers that only know one tier)."""
        return self.tiers.dram

    def info(self) -> dict:
        return {"device": self.device, "tiers": self.tiers.snapshot()}

    @property
    def liveness_ttl_s(self) -> int:
        return self.rt.settings.decode_lease_seconds

    def request_stop(self, grace_s: float = 0.0) -> None:
        self._abandon_at = time.monotonic() + grace_s
        super().request_stop(grace_s)

    def run_forever(self) -> None:
        beat = threading.Thread(target=self._beat, name="ctxcache-decode-heartbeat", daemon=True)
        beat.start()
        try:
            super().run_forever()  # until a stop is requested
            while self._live and not self._abandoning():  # drain the batch within the grace
                self._step()
        finally:
            with self._held_lock:
                left = list(self._held.values())
            for req in left:  # given up: the API notices the lease gone and retries or answers 503
                log.warning("decode worker %s stopping: gives up request %s", self.wid, req["rid"])
                self._release(req)
            self._beat_stop.set()
            beat.join()

    def _abandoning(self) -> bool:
        return time.monotonic() >= self._abandon_at

    def _beat(self) -> None:
        """The heartbeat thread: the worker's liveness and the leases of the requests it holds."""
        cat, lease = self.rt.catalog, self.rt.settings.decode_lease_seconds
        while not self._beat_stop.wait(lease / 3):
            with self._held_lock:
                rids = list(self._held)
            try:
                cat.keep_alive(self.kind, self.wid, self.liveness_ttl_s)
                cat.heartbeat_decode(rids, lease, self.wid)
            except Exception as e:  # noqa: BLE001 - Redis down: the next beat tries again
                log.warning("decode heartbeat of %s failed: %s", self.wid, e)

    def _claim(self, timeout_s: float) -> dict | None:
        if self._stop.is_set():
            return None
        req = self.rt.catalog.claim_decode(timeout_s, self.rt.settings.decode_lease_seconds, self.wid)
        if req is not None:
            with self._held_lock:
                self._held[req["rid"]] = req
        return req

    def _release(self, req: dict) -> None:
        """Done with a request (answered, failed, cancelled or given up): it leaves the active list."""
        with self._held_lock:
            self._held.pop(req["rid"], None)
        try:
            self.rt.catalog.finish_decode(req)
        except Exception as e:  # noqa: BLE001 - its lease expires on its own
            log.warning("could not release decode request %s: %s", req["rid"], e)

    def _should_stop(self, rid: str) -> bool:
        """Checked once per decode step: the client went away, or a stop's grace ran out."""
        return self._abandoning() or self.rt.catalog.cancelled(rid)

    def tick(self) -> None:
        if not self.batched:
            req = self._claim(timeout_s=1.0)
            if req is not None:
                try:
                    self.process(req)
                finally:
                    self._release(req)
            return
        self._admit()
        if self._live:
            self._step()

    # -- the batched path ------------------------------------------------------------------------

    def _admit(self) -> None:
        """Take queued requests into the batch: wait up to 1 s for one when idle, never when busy."""
        cat = self.rt.catalog
        while len(self._live) < self.rt.settings.decode_batch_size:
            req = self._claim(timeout_s=0.0 if self._live else 1.0)
            if req is None:
                return
            admitted = False
            try:
                with self._errors_reported(req):
                    job = self._prepare(req)
                    if job is None:
                        continue
                    if not self._runner_supported():
                        self._serve_serially(job)
                        continue
                    runner = self._runner(job.opened.backend)
                    slot = runner.add(job.opened.kv, job.opened.planner, job.params, job.q_ids, job.req["max_tokens"],
                                      temperature=job.req["temperature"], seed=job.req.get("seed"))
                    self._live[job.opened.backend.name, slot] = _Live(
                        job, _TokenStream(cat, job.rid, self.rt.lm.tokenizer), time.perf_counter())
                    admitted = True
            finally:
                if not admitted:  # answered, failed or dropped: done with it; a live one is released by _step
                    self._release(req)

    def _runner_supported(self) -> bool:
        """The batched runner runs Llama-family models only; for others the worker serves serially."""
        if self._runner_reasons is None:
            from decoder.runner import unsupported

            self._runner_reasons = unsupported(self.rt.ensure_weights().model)
            if self._runner_reasons:
                log.warning("decode runner unavailable (%s): serving one request at a time through transformers",
                            "; ".join(self._runner_reasons))
        return not self._runner_reasons

    def _runner(self, backend):
        from decoder.runner import Runner

        r = self._runners.get(backend.name)
        if r is None:
            r = self._runners[backend.name] = Runner(self.rt.ensure_weights(), backend, self.device, track_fraction=True)
        return r

    def _step(self) -> None:
        """One token for every live request; finished or cancelled ones leave with a `done` event."""
        cat = self.rt.catalog
        for name, runner in self._runners.items():
            if not any(key[0] == name for key in self._live):
                continue
            try:
                got = runner.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails the requests in it, not the worker
                log.exception("decode step of the %s runner failed", name)
                for key in [k for k in self._live if k[0] == name]:
                    live = self._live.pop(key)
                    metrics.job_finished(self.kind, "failed")
                    cat.emit(live.job.rid, "error", {"code": "internal_error", "message": INTERNAL_ERROR_MESSAGE})
                    runner.remove(key[1])
                    self._release(live.job.req)
                continue
            now = time.perf_counter()
            for slot, tok in got:
                live = self._live[name, slot]
                live.batch_max = max(live.batch_max, len(got))
                req = runner.requests[slot]
                if live.t_first is None:
                    live.t_first = now
                if tok not in self.rt.lm.eos_token_ids:
                    live.stream.push(tok)
                reason = req.finish_reason
                if reason is None and self._should_stop(live.job.rid):
                    reason = "cancelled"
                if reason is None:
                    continue
                if reason == "cancelled" and self._abandoning():  # given up, not answered: the API retries it
                    runner.remove(slot)
                    del self._live[name, slot]
                    self._release(live.job.req)
                    continue
                ids = [t for t in req.tokens if t not in self.rt.lm.eos_token_ids]
                self._done(live.job, ids, reason, ttft_s=live.t_first - live.job.t_start,
                           decode_s=now - live.t_first, stats={
                               "kv_fraction": round(runner.kv_fraction(slot), 5), "steps": req.produced,
                               "runner": "batched", "graph": runner.graph_status, "batch_max": live.batch_max})
                runner.remove(slot)
                del self._live[name, slot]
                self._release(live.job.req)

    def _artifacts(self, cid: str, slug: str):
        """The cached read handle of a context, opened again when its manifest changed on disk (the
        context was rebuilt, got an index, or was deleted): a handle checks chunks against the
        manifest it read, and the tiers may hold arrays of the older build."""
        h = self._handles.get(cid)
        if h is not None and not h.is_current():
            self.forget(cid)
            h = None
        if h is None:
            h = self.rt.store.open(slug, PromptHash(cid))
            self._handles[cid] = h
            while len(self._handles) > 64:
                self._handles.popitem(last=False)
        self._handles.move_to_end(cid)
        return h

    def forget(self, cid: str) -> None:
        self._handles.pop(cid, None)
        self.tiers.drop(cid)

    def process(self, req: dict) -> None:
        """Answer one request, start to finish (the serial path: transformers' modules + the hook)."""
        with self._errors_reported(req):
            job = self._prepare(req)
            if job is not None:
                self._serve_serially(job)

    def _serve_serially(self, job: "_Job") -> None:
        lm, cat = self.rt.lm, self.rt.catalog
        stream = _TokenStream(cat, job.rid, lm.tokenizer)
        t_gen = time.perf_counter()
        res = generate(lm, job.opened.kv, job.opened.planner, job.params, job.q_ids, backend=job.opened.backend,
                       max_tokens=job.req["max_tokens"], temperature=job.req["temperature"],
                       seed=job.req.get("seed"), on_token=stream.push, should_stop=lambda: self._should_stop(job.rid))
        if res.finish_reason == "cancelled" and self._abandoning():
            return  # given up by a stopping worker, not answered: released by the caller, retried by the API
        self._done(job, res.token_ids, res.finish_reason, ttft_s=t_gen - job.t_start + res.ttft_s,
                   decode_s=res.decode_s, stats={
                       "kv_fraction": round(res.stats.kv_fraction, 5),
                       "plan_ms": round(1000 * res.stats.plan_s, 2),
                       "run_ms": round(1000 * res.stats.run_s, 2),
                       "steps": res.stats.steps, "runner": "transformers"})

    @contextlib.contextmanager
    def _errors_reported(self, req: dict, jobs: list | None = None):
        """Turn a failure into the request's error event (and a corrupt context's status)."""
        cat, rid, cid = self.rt.catalog, req["rid"], req["id"]
        try:
            yield
        except ArtifactError as e:
            metrics.job_finished(self.kind, "failed")
            code = "artifact_missing" if isinstance(e, ArtifactMissing) else "artifact_corrupt"
            log.error("context %s: %s", cid, e)
            self.forget(cid)
            cat.update(cid, status="failed", error_code=code, error_message=str(e)[:2000])
            cat.emit(rid, "error", {"code": code, "message": f"stored artifacts of this context are unusable: {e}"})
        except MethodUnavailable as e:
            metrics.job_finished(self.kind, "failed")
            cat.emit(rid, "error", {"code": "method_unavailable", "message": str(e)[:2000]})
        except Exception as e:  # noqa: BLE001
            metrics.job_finished(self.kind, "failed")
            log.exception("completion %s on %s failed", rid, cid)
            cat.emit(rid, "error", {"code": "internal_error", "message": INTERNAL_ERROR_MESSAGE})

    def _prepare(self, req: dict) -> "_Job | None":
        """Everything before the first token: checks (an error event and None when one fails), the
        backend, the index the API resolved, and `open_context` (tiers, planner)."""
        rt, cat, rid, cid = self.rt, self.rt.catalog, req["rid"], req["id"]
        if cat.cancelled(rid):
            return None  # the client went away while the request was queued: nobody to answer
        rec = cat.get(cid)
        if rec is None:
            cat.emit(rid, "error", {"code": "not_found", "message": f"no context {cid}"})
            return None
        if rec["status"] != "ready":
            cat.emit(rid, "error", {"code": "context_not_ready", "message": f"context is {rec['status']}"})
            return None
        t_start = time.perf_counter()
        lm = rt.ensure_weights()
        method = get_method(req["method"])
        params = method.Params.model_validate(req["params"])
        backend = get_backend(req.get("backend") or resolve_backend(rt.settings, self.device))
        reasons = backend.validate_configuration(lm.spec, self.device, lm.model.dtype)
        if reasons:
            cat.emit(rid, "error", {"code": "unsupported_configuration",
                                    "message": f"attention backend {backend.name!r} cannot run here: " + "; ".join(reasons)})
            return None
        art = self._artifacts(cid, rec["slug"])
        index_id = None
        if method.has_index:  # resolved once, by the API (requests queued by an older API carry none)
            index_id = req.get("index_id") or method.index_id(params, lm.spec, rt.method_env)
        if index_id is not None and index_id not in art.manifest["indexes"]:
            # built after this worker opened the context (a registration with new build params, or
            # SAAP's model retrained): the cached handle holds the older manifest
            self._handles.pop(cid, None)
            art = self._artifacts(cid, rec["slug"])
            if index_id not in art.manifest["indexes"]:  # changed since the API checked (a race): not built
                cat.emit(rid, "error", {"code": "method_not_built", "message":
                                        f"no {method.name!r} index {index_id} for this context (its build parameters "
                                        f"or trained model changed while the request waited); register it again"})
                return None
        q_ids = req["question_ids"]
        opened = open_context(art, cid, method, params, index_id, tiers=self.tiers, spec=lm.spec, backend=backend,
                              max_local=len(q_ids) + req["max_tokens"], env=rt.method_env)
        return _Job(req, rid, method, params, opened, q_ids, art.n_tokens, t_start)

    def _done(self, job: "_Job", token_ids: list[int], finish_reason: str, *, ttft_s: float, decode_s: float,
              stats: dict) -> None:
        tok = self.rt.lm.tokenizer
        n, n_out, loads = job.n_ctx, len(token_ids), job.opened.loads
        tps = round(max(n_out - 1, 0) / decode_s, 2) if decode_s > 0 and n_out > 1 else None
        self.rt.catalog.emit(job.rid, "done", {
            "text": tok.decode(token_ids, skip_special_tokens=True),
            "token_ids": token_ids,
            "finish_reason": finish_reason,
            "usage": {"cached_tokens": n, "prompt_tokens": len(job.q_ids), "completion_tokens": n_out,
                      "total_tokens": n + len(job.q_ids) + n_out},
            "stats": {
                "method": job.method.name,
                "params": job.params.model_dump(),
                "backend": job.opened.backend.name,
                "cache": "cold" if loads.misses.get("dram") else "warm",
                "ttft_ms": round(1000 * ttft_s, 2),
                "load_ms": round(1000 * loads.s, 2),
                "tier_hits": sum(loads.hits.values()),
                "tier_misses": sum(loads.misses.values()),
                "tiers": {t: {"hits": loads.hits.get(t, 0), "misses": loads.misses.get(t, 0)}
                          for t in sorted(set(loads.hits) | set(loads.misses))},
                "decode_tokens_per_s": tps,
                **stats,
                "device": self.device,
                "kv_device": str(job.opened.resident),
                "method_stats": job.opened.planner.stats(),
            },
        })
        metrics.job_finished(self.kind, "done")
        metrics.decode_finished(job.method.name, n_out, tps, stats.get("kv_fraction"))
        self.rt.catalog.worker_alive(self.kind, self.wid, ttl_s=self.liveness_ttl_s, info=self.info())  # fresh tier numbers for /metrics


@dataclass
class _Live:
    """A request in a runner: its job, its token stream, when its first token came."""

    job: "_Job"
    stream: "_TokenStream"
    t_added: float
    t_first: float | None = None
    batch_max: int = 0  # most requests stepped together while this one ran


@dataclass
class _Job:
    """A prepared completion: the request, its method and params, the opened context."""

    req: dict
    rid: str
    method: object
    params: object
    opened: object  # decoder.pipeline.OpenedContext
    q_ids: list[int]
    n_ctx: int
    t_start: float


class _TokenStream:
    """Emits a request's tokens as text deltas (a multi-byte character waits for its last token).

    Incremental: `tokenizers`' `DecodeStream` decodes only the tokens since the last emitted text
    (plus the few it needs as a prefix), so a token costs O(1) amortized however long the answer;
    the deltas joined are the whole answer's `decode`."""

    def __init__(self, cat, rid: str, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.cat, self.rid = cat, rid
        self.backend = tokenizer.backend_tokenizer  # the fast tokenizer's `tokenizers.Tokenizer`
        self.decoder = DecodeStream(skip_special_tokens=True)

    def delta(self, t: int) -> str | None:
        """The text token `t` completes (None while a multi-byte character is incomplete)."""
        return self.decoder.step(self.backend, t)

    def push(self, t: int) -> None:
        delta = self.delta(t)
        if delta:
            self.cat.emit(self.rid, "token", {"text": delta, "token_id": t})


class TrainWorker(_LeasedLoop):
    """Runs offline training jobs (`POST /v1/methods/saap/train`): the same `train_saap` as
    `ctxcache train saap`, with the service's model and data dir, reporting progress into the job
    record. Training is resumable (finished layers are checkpointed), so a job requeued after a
    crash continues where it stopped. It trains on the service's `device` (auto: the GPU when
    there is one), with its own copy of the model's weights, loaded per job."""

    kind = "train"

    def claim(self) -> dict | None:
        return self.rt.catalog.claim_train(timeout_s=1.0, lease_s=self.rt.settings.job_lease_seconds)

    def process(self, job: dict) -> None:
        from training.loop import TrainingCancelled, train_saap
        from training.settings import TrainSettings

        cat, jid = self.rt.catalog, job["id"]
        rec = cat.get_train(jid)
        if rec is None or rec["status"] in ("done", "failed", "cancelled"):
            return
        fp = rec["fingerprint"]
        cat.update_train(jid, status="running", phase="starting", attempts=int(rec.get("attempts") or 0) + 1)
        t0 = time.perf_counter()

        def on_progress(ev: dict) -> None:
            done, total = ev["layers_done"], max(1, ev["layers_total"])
            # corpus capture is ~15% of a small run's time; layers share the rest
            cat.update_train(jid, phase=ev["phase"] if ev["phase"] == "capture" else f"layer {ev['layer']}",
                             layers_done=done, layers_total=ev["layers_total"],
                             progress=round(0.15 + 0.85 * done / total, 4))

        try:
            # a private copy of the weights (0.1 s from the converted cache), never the model object the
            # prefill and decode workers share: the corpus capture runs the model truncated to its first
            # layers by changing its config (`training.capture.first_layers`), which would silently cut a
            # concurrent decode short
            from decoder.model import load_model

            lm = load_model(self.rt.settings.model, self.rt.settings.data_dir, with_weights=True,
                            device=resolve_device(self.rt.settings.device))
            if lm.spec.fingerprint != fp:
                raise ValueError(f"job is for model {fp[:16]}, this worker serves {lm.spec.fingerprint[:16]}")
            # train where this service runs its model (its `device` setting, auto by default); the
            # device is not part of the job's identity
            settings = TrainSettings.model_validate({**rec["settings"], "device": self.rt.settings.device})
            corpus = self.rt.settings.data_dir / "corpora" / rec["corpus"] if rec.get("corpus") else None
            out = train_saap(lm, settings, data_dir=self.rt.settings.data_dir, corpus_dir=corpus, progress=False,
                             on_progress=on_progress,
                             should_stop=lambda: bool((cat.get_train(jid) or {}).get("cancel_requested")))
            manifest = json.loads((out / "manifest.json").read_text())
        except TrainingCancelled:
            log.info("training job %s cancelled", jid)
            metrics.job_finished(self.kind, "cancelled")
            cat.end_train(jid, fp, status="cancelled", phase="cancelled")
            return
        except Exception as e:  # noqa: BLE001 - a failed job becomes the job's status, never a lost job
            log.exception("training job %s failed", jid)
            metrics.job_finished(self.kind, "failed")
            cat.end_train(jid, fp, status="failed", phase="failed", error_code="train_failed",
                          error_message=redact_paths(f"{type(e).__name__}: {e}"[:2000], self.rt.settings.data_dir))
            return
        metrics.job_finished(self.kind, "done")
        cat.end_train(jid, fp, status="done", phase="done", progress=1.0, model_dir=str(out),
                      digest=manifest["digest"], layers_done=len(manifest["layers"]),
                      layers_total=len(manifest["layers"]), train_s=round(time.perf_counter() - t0, 2))


class Janitor(_Loop):
    """Removes expired contexts (record + artifacts), requeues jobs of crashed workers and drops
    decode requests that lost both their worker and their client."""

    kind = "janitor"

    def __init__(self, rt: Runtime, on_delete=None):
        super().__init__(rt)
        self.on_delete = on_delete
        self._unleased: dict[str, float] = {}  # active decode request (queued JSON) -> first seen without lease

    def tick(self) -> None:
        self.sweep()
        self._stop.wait(self.rt.settings.janitor_interval_seconds)

    def sweep(self) -> dict:
        cat, store = self.rt.catalog, self.rt.store
        expired = 0
        for cid in cat.due_for_expiry():
            delete_context(self.rt, cid)
            if self.on_delete:
                self.on_delete(cid)
            expired += 1
        requeued = cat.requeue_stale()
        store.gc_temp(older_than_s=max(3600.0, 10 * self.rt.settings.job_lease_seconds))
        return {"expired": expired, "requeued": requeued, "decode_dropped": self._drop_orphaned_decodes()}

    def _drop_orphaned_decodes(self) -> int:
        """Remove active decode requests whose worker died and that no API waits on (the API and the
        worker died together): nothing else would ever remove them.

        Whether a client waits is told by time, not by a marker: an API waiting on a request notices
        a lost lease within two of its checks (under a second, `DecodeClient.check_s`) and removes
        the entry itself when it retries or gives up. An entry still there without a lease for
        twice `decode_lease_seconds` since this janitor first saw it so is one nobody waits on. A
        live request is never touched: it holds a lease (checked again, under WATCH, at removal),
        and one removed while its API was stalled is still retried by that API (its check reads the
        lease and the queue, not the active list)."""
        cat, now = self.rt.catalog, time.monotonic()
        grace = 2 * self.rt.settings.decode_lease_seconds
        self._unleased = {raw: self._unleased.get(raw, now) for raw in cat.unleased_decode()}
        dropped = 0
        for raw, since in list(self._unleased.items()):
            if now - since >= grace and cat.drop_decode(raw):
                del self._unleased[raw]
                dropped += 1
        if dropped:
            log.info("dropped %d decode request(s) whose worker and client are gone", dropped)
        return dropped


def delete_context(rt: Runtime, cid: str) -> bool:
    """Remove a context's record and its artifacts. True if anything existed."""
    raw = rt.catalog.r.hgetall(rt.catalog.k_ctx(cid))
    slug = (raw.get(b"slug") or b"").decode() or rt.lm.spec.slug
    rt.catalog.delete(cid)
    removed = rt.store.delete(slug, PromptHash(cid))
    return bool(raw) or removed
