"""The decode worker: answers completion requests over stored contexts, one at a time through
transformers or batched through `decoder.runner`, streaming tokens back to the API
(`service/jobs/streams.py`). Both paths share one request life cycle: claim (leased), prepare,
stream tokens, answer or fail, release."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from decoder.backends import get_backend
from decoder.generate import generate
from decoder.pipeline import ContextTiers, open_context
from indexer.base import MethodUnavailable, get_method
from service import metrics
from service.errors import INTERNAL_ERROR_MESSAGE
from service.jobs.base import Loop
from service.runtime import (Runtime, resolve_backend, resolve_device, resolve_gpu_cache_bytes, resolve_plan_ahead,
                             resolve_runner)
from storage.artifacts import ArtifactError, ArtifactMissing
from storage.keys import PromptHash

log = logging.getLogger("ctxcache.worker")


class DecodeWorker(Loop):
    """Answers completion requests. Keeps a DRAM tier of artifact arrays (LRU by bytes), so only a
    context's first question reads from disk, and on a GPU a GPU tier above it, so a context's K/V
    and index arrays are copied to the device once and stay there across steps and requests.

    Two ways to run a request (`decode_runner`): the transformers path (`decoder.generate`: one
    request at a time through the model's own modules; the CPU default and the reference), or the
    batched runner (`decoder.runner.Runner`, the GPU default): up to `decode_batch_size` requests,
    on the same or different contexts and methods, stepped together one token at a time; a request
    joins at the next step and leaves when it is done (continuous batching). One runner per
    attention backend; each request keeps its own planner.

    Requests are leased (`Runtime.queues.decode`, a `LeasedQueue`): a heartbeat thread renews the
    lease of every request the worker holds and the worker's liveness every third of
    `decode_lease_seconds`, also while a step or a whole serial generation runs, so a busy worker
    never looks dead and a dead one is noticed within the lease. A request whose client went away
    (`DecodeStreams.cancel`) stops at its next decode step, or is dropped unstarted. On stop the
    worker takes no new requests, lets the held ones finish for the grace it was given and then
    gives them up (no answer, lease dropped), so the API retries them on another worker."""

    kind = "decode"

    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self.device = resolve_device(rt.settings.device)
        self.tiers = ContextTiers(rt.settings.dram_tier_bytes, resolve_gpu_cache_bytes(rt.settings, self.device),
                                  self.device)
        self._handles: OrderedDict[PromptHash, object] = OrderedDict()
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
        lease = self.rt.settings.decode_lease_seconds
        while not self._beat_stop.wait(lease / 3):
            with self._held_lock:
                rids = list(self._held)
            try:
                self.rt.heartbeats.keep_alive(self.kind, self.wid, self.liveness_ttl_s)
                self.rt.queues.decode.heartbeat(rids, lease, self.wid)
            except Exception as e:  # noqa: BLE001 - Redis down: the next beat tries again
                log.warning("decode heartbeat of %s failed: %s", self.wid, e)

    def _claim(self, timeout_s: float) -> dict | None:
        if self._stop.is_set():
            return None
        req = self.rt.queues.decode.claim(timeout_s, self.rt.settings.decode_lease_seconds, self.wid)
        if req is not None:
            with self._held_lock:
                self._held[req["rid"]] = req
        return req

    def _release(self, req: dict) -> None:
        """Done with a request (answered, failed, cancelled or given up): it leaves the active list."""
        with self._held_lock:
            self._held.pop(req["rid"], None)
        try:
            self.rt.queues.decode.finish(req)
        except Exception as e:  # noqa: BLE001 - its lease expires on its own
            log.warning("could not release decode request %s: %s", req["rid"], e)

    def _should_stop(self, rid: str) -> bool:
        """Checked once per decode step: the client went away, or a stop's grace ran out."""
        return self._abandoning() or self.rt.streams.cancelled(rid)

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
                                      temperature=job.req["temperature"], seed=job.req.get("seed"), plan_ahead=job.ahead)
                    self._live[job.opened.backend.name, slot] = _Live(
                        job, _TokenStream(self.rt.streams, job.rid, self.rt.lm.tokenizer), time.perf_counter())
                    self._count(job.opened.backend.name, slot, runner)
                    admitted = True
            finally:
                if not admitted:  # answered, failed or dropped: done with it; a live one is released by _step
                    self._release(req)

    def _runner_supported(self) -> bool:
        """The batched runner runs Llama-family models only; for others the worker serves serially."""
        if self._runner_reasons is None:
            from decoder.weights import unsupported

            self._runner_reasons = unsupported(self.rt.ensure_weights().model)
            if self._runner_reasons:
                log.warning("decode runner unavailable (%s): serving one request at a time through transformers",
                            "; ".join(self._runner_reasons))
        return not self._runner_reasons

    def _plans_ahead(self, method, backend) -> bool:
        """A request of `method` goes to the runner planned ahead (`plan_ahead`, `resolve_plan_ahead`):
        its params are widened (`plan_ahead_widen`) before its planner opens; `stats.params` reports
        what it ran with."""
        return (resolve_plan_ahead(self.rt.settings, self.device, method, backend) and self.batched
                and self._runner_supported())

    def _runner(self, backend):
        from decoder.runner import Runner

        r = self._runners.get(backend.name)
        if r is None:
            r = self._runners[backend.name] = Runner(self.rt.ensure_weights(), backend, self.device, track_fraction=True,
                                                     cache_rows=None if self.rt.settings.offload_row_cache else False,
                                                     pipelined=None if self.rt.settings.decode_pipelined else False)
        return r

    def _step(self) -> None:
        """One token for every live request; finished or cancelled ones leave with a `done` event."""
        for name, runner in self._runners.items():
            if not any(key[0] == name for key in self._live):
                continue
            try:
                got = runner.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails the requests in it, not the worker
                log.exception("decode step of the %s runner failed", name)
                for key in [k for k in self._live if k[0] == name]:
                    metrics.job_finished(self.kind, "failed")
                    self.rt.streams.emit(self._live[key].job.rid, "error",
                                         {"code": "internal_error", "message": INTERNAL_ERROR_MESSAGE})
                    self._leave(runner, *key)
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
                    self._count(name, slot, runner)  # its row caches appear at its first one-token step
                    continue
                if reason == "cancelled" and self._abandoning():  # given up, not answered: the API retries it
                    self._leave(runner, name, slot)
                    continue
                ids = [t for t in req.tokens if t not in self.rt.lm.eos_token_ids]
                hits, rows = req.cache_counts()  # the offload backends' row cache (decoder.runner, cache_rows)
                self._done(live.job, ids, reason, ttft_s=live.t_first - live.job.t_start,
                           decode_s=now - live.t_first, stats={
                               "kv_fraction": round(runner.kv_fraction(slot), 5), "steps": req.produced,
                               "runner": "batched", "graph": runner.graph_status, "batch_max": live.batch_max,
                               "plan_ahead": live.job.ahead,
                               **({"row_cache_hit_rate": round(hits / rows, 4)} if rows else {})})
                self._leave(runner, name, slot)

    def _count(self, name: str, slot: int, runner) -> None:
        """A batched request's own device memory (`Request.nbytes`: request-local K/V, row caches)
        counts against the GPU tier while it runs, which evicts cached arrays to make room."""
        if self.tiers.gpu is not None:
            self.tiers.gpu.reserve(("request", name, slot), runner.requests[slot].nbytes())

    def _leave(self, runner, name: str, slot: int) -> None:
        """A batched request is done (answered, failed or given up): out of its runner, its memory no
        longer counted, its lease released."""
        live = self._live.pop((name, slot))
        runner.remove(slot)
        if self.tiers.gpu is not None:
            self.tiers.gpu.release(("request", name, slot))
        self._release(live.job.req)

    def _artifacts(self, cid: PromptHash, slug: str):
        """The cached read handle of a context, opened again when its manifest changed on disk (the
        context was rebuilt, got an index, or was deleted): a handle checks chunks against the
        manifest it read, and the tiers may hold arrays of the older build."""
        h = self._handles.get(cid)
        if h is not None and not h.is_current():
            self.forget(cid)
            h = None
        if h is None:
            h = self.rt.store.open(slug, cid)
            self._handles[cid] = h
            while len(self._handles) > 64:
                self._handles.popitem(last=False)
        self._handles.move_to_end(cid)
        return h

    def forget(self, cid: PromptHash) -> None:
        """Drop what this worker cached of a context (deleted, or found damaged)."""
        self._handles.pop(cid, None)
        self.tiers.drop(cid)

    def process(self, req: dict) -> None:
        """Answer one request, start to finish (the serial path: transformers' modules + the hook)."""
        with self._errors_reported(req):
            job = self._prepare(req)
            if job is not None:
                self._serve_serially(job)

    def _serve_serially(self, job: "_Job") -> None:
        lm = self.rt.lm
        stream = _TokenStream(self.rt.streams, job.rid, lm.tokenizer)
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
        cat, streams, rid, cid = self.rt.catalog, self.rt.streams, req["rid"], req["id"]
        try:
            yield
        except ArtifactError as e:
            metrics.job_finished(self.kind, "failed")
            code = "artifact_missing" if isinstance(e, ArtifactMissing) else "artifact_corrupt"
            log.error("context %s: %s", cid, e)
            self.forget(cid)
            cat.update(cid, status="failed", error_code=code, error_message=str(e)[:2000])
            streams.emit(rid, "error", {"code": code, "message": f"stored artifacts of this context are unusable: {e}"})
        except MethodUnavailable as e:
            metrics.job_finished(self.kind, "failed")
            streams.emit(rid, "error", {"code": "method_unavailable", "message": str(e)[:2000]})
        except Exception as e:  # noqa: BLE001
            metrics.job_finished(self.kind, "failed")
            log.exception("completion %s on %s failed", rid, cid)
            streams.emit(rid, "error", {"code": "internal_error", "message": INTERNAL_ERROR_MESSAGE})

    def _prepare(self, req: dict) -> "_Job | None":
        """Everything before the first token: checks (an error event and None when one fails), the
        backend, the index the API resolved, and `open_context` (tiers, planner)."""
        rt, streams, rid, cid = self.rt, self.rt.streams, req["rid"], req["id"]
        if streams.cancelled(rid):
            return None  # the client went away while the request was queued: nobody to answer
        rec = rt.catalog.get(cid)
        if rec is None:
            streams.emit(rid, "error", {"code": "not_found", "message": f"no context {cid}"})
            return None
        if rec["status"] != "ready":
            streams.emit(rid, "error", {"code": "context_not_ready", "message": f"context is {rec['status']}"})
            return None
        t_start = time.perf_counter()
        lm = rt.ensure_weights()
        method = get_method(req["method"])
        params = method.Params.model_validate(req["params"])
        art = self._artifacts(cid, rec["slug"])
        arrays = art.manifest["arrays"]
        kv_bytes = (int(arrays["kv/k"]["nbytes"]), int(arrays["kv/v"]["nbytes"]))
        gpu_tier = None if self.tiers.gpu is None else self.tiers.gpu.capacity
        backend = get_backend(req.get("backend") or resolve_backend(rt.settings, self.device, kv_bytes, gpu_tier))
        reasons = backend.validate_configuration(lm.spec, self.device, lm.model.dtype)
        if reasons:
            streams.emit(rid, "error", {"code": "unsupported_configuration",
                                    "message": f"attention backend {backend.name!r} cannot run here: " + "; ".join(reasons)})
            return None
        index_id = None
        if method.has_index:  # resolved once, by the API (requests queued by an older API carry none)
            index_id = req.get("index_id") or method.index_id(params, lm.spec, rt.method_env)
        if index_id is not None and index_id not in art.manifest["indexes"]:
            # built after this worker opened the context (a registration with new build params, or
            # SAAP's model retrained): the cached handle holds the older manifest
            self._handles.pop(cid, None)
            art = self._artifacts(cid, rec["slug"])
            if index_id not in art.manifest["indexes"]:  # changed since the API checked (a race): not built
                streams.emit(rid, "error", {"code": "method_not_built", "message":
                                        f"no {method.name!r} index {index_id} for this context (its build parameters "
                                        f"or trained model changed while the request waited); register it again"})
                return None
        q_ids = req["question_ids"]
        ahead = self._plans_ahead(method, backend)
        if ahead:  # plans from a predicted query: the budget widened to buy their fidelity back
            params = params.widened(rt.settings.plan_ahead_widen)
        opened = open_context(art, cid, method, params, index_id, tiers=self.tiers, spec=lm.spec, backend=backend,
                              max_local=len(q_ids) + req["max_tokens"], env=rt.method_env)
        return _Job(req, rid, method, params, opened, q_ids, art.n_tokens, t_start, ahead)

    def _done(self, job: "_Job", token_ids: list[int], finish_reason: str, *, ttft_s: float, decode_s: float,
              stats: dict) -> None:
        tok = self.rt.lm.tokenizer
        n, n_out, loads = job.n_ctx, len(token_ids), job.opened.loads
        tps = round(max(n_out - 1, 0) / decode_s, 2) if decode_s > 0 and n_out > 1 else None
        self.rt.streams.emit(job.rid, "done", {
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
                "kv_device": job.opened.kv_device,
                "method_stats": job.opened.planner.stats(),
            },
        })
        metrics.job_finished(self.kind, "done")
        metrics.decode_finished(job.method.name, n_out, tps, stats.get("kv_fraction"))
        self.rt.heartbeats.beat(self.kind, self.wid, ttl_s=self.liveness_ttl_s, info=self.info())  # fresh tier numbers for /metrics


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
    ahead: bool = False  # the runner plans it ahead, its params widened (`_plans_ahead`)


class _TokenStream:
    """Emits a request's tokens as text deltas (a multi-byte character waits for its last token).

    Incremental: `tokenizers`' `DecodeStream` decodes only the tokens since the last emitted text
    (plus the few it needs as a prefix), so a token costs O(1) amortized however long the answer;
    the deltas joined are the whole answer's `decode`."""

    def __init__(self, streams, rid: str, tokenizer):
        from tokenizers.decoders import DecodeStream

        self.streams, self.rid = streams, rid
        self.backend = tokenizer.backend_tokenizer  # the fast tokenizer's `tokenizers.Tokenizer`
        self.decoder = DecodeStream(skip_special_tokens=True)

    def delta(self, t: int) -> str | None:
        """The text token `t` completes (None while a multi-byte character is incomplete)."""
        return self.decoder.step(self.backend, t)

    def push(self, t: int) -> None:
        delta = self.delta(t)
        if delta:
            self.streams.emit(self.rid, "token", {"text": delta, "token_id": t})
