"""Workers: prefill (build + persist), decode (answer questions), train (offline SAAP training jobs),
janitor (expiry, stale jobs).

Each runs as a loop over Redis queues, in its own process (`ctxcache worker prefill|decode|train`) or as
a thread of the API process in embedded mode: the same code either way.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict

import torch

from decoder.generate import ContextKV, generate
from decoder.prefill import prefill
from indexer.base import IndexReader, MethodUnavailable, get_method
from service.runtime import Runtime, resolve_device
from storage.artifacts import ArtifactCorrupt, ArtifactError, ArtifactMissing, IndexArrays
from storage.keys import PromptHash
from storage.tier import DramTier

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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def run_forever(self) -> None:
        if self.rt.settings.torch_threads:
            torch.set_num_threads(self.rt.settings.torch_threads)
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.rt.catalog.worker_alive(self.kind, self.wid, ttl_s=15)
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
    """Claims one leased job at a time and keeps its lease alive while `process` runs. A crash leaves
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
        while not stop.wait(max(1.0, lease / 3)):
            try:
                self.rt.catalog.heartbeat(job, lease)
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
            code = "artifact_corrupt" if isinstance(e, ArtifactCorrupt) else "build_failed"
            cat.update(cid, status="failed", error_code=code, error_message=f"{type(e).__name__}: {e}"[:2000])

    def _build(self, cid: str, rec: dict) -> None:
        rt, cat = self.rt, self.rt.catalog
        lm = rt.ensure_weights()
        spec = lm.spec
        if rec.get("slug") != spec.slug:
            raise RuntimeError(f"context was registered for model {rec.get('model')} ({rec.get('slug')}); this worker serves {spec.slug}")
        key = PromptHash(cid)
        methods = {m: v for m, v in (rec.get("methods") or {}).items() if v.get("index_id")}  # index-free: nothing to build
        published = rt.store.exists(spec.slug, key)
        if published:
            manifest = rt.store.read_manifest(spec.slug, key)
            todo = {m: v for m, v in methods.items() if v["index_id"] not in manifest["indexes"]}
            if not todo:
                self._ready(cid, manifest)
                return
            tokens = rt.store.open(spec.slug, key).read("tokens").tolist()
        else:
            todo = methods
            tokens = cat.tokens(cid)
            if tokens is None:
                raise RuntimeError("token ids of this context are gone from the catalog; register it again")
        cat.update(cid, status="prefilling", progress=0.0, error_code="", error_message="")
        t0 = time.perf_counter()
        last = [0.0]

        def progress(f: float) -> None:
            if f - last[0] >= 0.05 or f >= 1.0:
                last[0] = f
                cat.update(cid, progress=round(0.8 * f, 3))

        cap = prefill(lm, tokens, chunk_tokens=rt.settings.prefill_chunk_tokens, keep_q=bool(todo), progress=progress)
        t_prefill = time.perf_counter() - t0
        cat.update(cid, status="indexing", progress=0.8)
        builds = []
        for i, (name, entry) in enumerate(sorted(todo.items())):
            method = get_method(name)
            params = method.Params.model_validate(entry["params"])
            t1 = time.perf_counter()
            arrays = method.build(cap, params, rt.method_env)
            builds.append(IndexArrays(name, method.version, params.build_params(), entry["index_id"].split("-", 1)[1],
                                      {k: v.cpu() for k, v in arrays.items()}, time.perf_counter() - t1))
            cat.update(cid, progress=round(0.8 + 0.15 * (i + 1) / len(todo), 3))
        timings = {"prefill_s": round(t_prefill, 4), "prefill_tokens_per_s": round(len(tokens) / max(t_prefill, 1e-9), 1),
                   "index_s": {b.method: round(b.build_s, 4) for b in builds}}
        if published:
            manifest = rt.store.add_indexes(spec.slug, key, builds)
        else:
            manifest = rt.store.publish(key, spec, tokens, cap.k, cap.v, builds,
                                        {"timings": timings, "prompt_format": rec.get("prompt_format", "chat"),
                                         "display_name": rec.get("display_name") or "", "expires_at": rec.get("expires_at")})
        del cap
        if not self._ready(cid, manifest):
            rt.store.delete(spec.slug, key)  # deleted while we were building: leave nothing behind
        cat.drop_tokens(cid)

    def _ready(self, cid: str, manifest: dict) -> bool:
        return self.rt.catalog.update(
            cid, status="ready", progress=1.0, n_tokens=manifest["n_tokens"], bytes=manifest["bytes"],
            timings=manifest.get("timings", {}), error_code="", error_message="",
        )


class DecodeWorker(_Loop):
    """Answers completion requests. Keeps a DRAM tier of artifact arrays (LRU by bytes), so only a
    context's first question reads from disk."""

    kind = "decode"

    def __init__(self, rt: Runtime):
        super().__init__(rt)
        self.tier = DramTier(rt.settings.dram_tier_bytes)
        self._handles: OrderedDict[str, object] = OrderedDict()
        self.device = resolve_device(rt.settings.device)

    def tick(self) -> None:
        req = self.rt.catalog.claim_decode(timeout_s=1.0)
        if req is not None:
            self.process(req)

    def _artifacts(self, cid: str, slug: str):
        h = self._handles.get(cid)
        if h is None:
            h = self.rt.store.open(slug, PromptHash(cid))
            self._handles[cid] = h
            while len(self._handles) > 64:
                self._handles.popitem(last=False)
        self._handles.move_to_end(cid)
        return h

    def forget(self, cid: str) -> None:
        self._handles.pop(cid, None)
        self.tier.drop(cid)

    def process(self, req: dict) -> None:
        cat, rid, cid = self.rt.catalog, req["rid"], req["id"]
        try:
            self._answer(req)
        except ArtifactError as e:
            code = "artifact_missing" if isinstance(e, ArtifactMissing) else "artifact_corrupt"
            log.error("context %s: %s", cid, e)
            self.forget(cid)
            cat.update(cid, status="failed", error_code=code, error_message=str(e)[:2000])
            cat.emit(rid, "error", {"code": code, "message": f"stored artifacts of this context are unusable: {e}"})
        except MethodUnavailable as e:
            cat.emit(rid, "error", {"code": "method_unavailable", "message": str(e)[:2000]})
        except Exception as e:  # noqa: BLE001
            log.exception("completion %s on %s failed", rid, cid)
            cat.emit(rid, "error", {"code": "internal_error", "message": f"{type(e).__name__}: {e}"[:500]})

    def _answer(self, req: dict) -> None:
        rt, cat, rid, cid = self.rt, self.rt.catalog, req["rid"], req["id"]
        rec = cat.get(cid)
        if rec is None:
            cat.emit(rid, "error", {"code": "not_found", "message": f"no context {cid}"})
            return
        if rec["status"] != "ready":
            cat.emit(rid, "error", {"code": "context_not_ready", "message": f"context is {rec['status']}"})
            return
        t_start = time.perf_counter()
        lm = rt.ensure_weights()
        method = get_method(req["method"])
        params = method.Params.model_validate(req["params"])
        art = self._artifacts(cid, rec["slug"])
        index_id = method.index_id(params, lm.spec, rt.method_env) if method.has_index else None  # as the API did
        if index_id is not None and index_id not in art.manifest["indexes"]:
            # built after this worker opened the context (a registration with new build params, or
            # SAAP's model retrained): the cached handle holds the older manifest
            self._handles.pop(cid, None)
            art = self._artifacts(cid, rec["slug"])
            if index_id not in art.manifest["indexes"]:  # changed since the API checked (a race): not built
                cat.emit(rid, "error", {"code": "method_not_built", "message":
                                        f"no {method.name!r} index {index_id} for this context (its build parameters "
                                        f"or trained model changed while the request waited); register it again"})
                return
        n = art.n_tokens
        load = {"s": 0.0, "misses": 0, "hits": 0}

        def load_layer(name: str, layer: int) -> torch.Tensor:
            t0 = time.perf_counter()
            t, hit = self.tier.get((cid, name, layer), lambda: art.read(name, layer))
            load["hits" if hit else "misses"] += 1
            load["s"] += time.perf_counter() - t0
            return t

        index = None
        # host-resident methods (csattn offload) keep K/V and index in DRAM and ship rows themselves
        kv_device = "cpu" if method.host_resident(params) else self.device
        if method.has_index:
            prefix = f"indexes/{index_id}/"
            index = IndexReader(lambda name, layer: load_layer(prefix + name, layer).to(kv_device), art.index_arrays(index_id))
        session = method.open(index, params, n, rt.method_env)
        ctx = ContextKV(n, load_layer, kv_device)
        tok = lm.tokenizer
        emitted: list[int] = []
        text_so_far = [""]

        def on_token(t: int) -> None:
            emitted.append(t)
            text = tok.decode(emitted, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                return  # a multi-byte character is not complete yet
            delta = text[len(text_so_far[0]):]
            text_so_far[0] = text
            if delta:
                cat.emit(rid, "token", {"text": delta, "token_id": t})

        t_gen = time.perf_counter()
        res = generate(lm, ctx, session, params, req["question_ids"], max_tokens=req["max_tokens"],
                       temperature=req["temperature"], seed=req.get("seed"), on_token=on_token,
                       should_stop=lambda: cat.cancelled(rid))
        text = tok.decode(res.token_ids, skip_special_tokens=True)
        n_out = len(res.token_ids)
        cat.emit(rid, "done", {
            "text": text,
            "token_ids": res.token_ids,
            "finish_reason": res.finish_reason,
            "usage": {"cached_tokens": n, "prompt_tokens": len(req["question_ids"]), "completion_tokens": n_out,
                      "total_tokens": n + len(req["question_ids"]) + n_out},
            "stats": {
                "method": method.name,
                "params": params.model_dump(),
                "cache": "cold" if load["misses"] else "warm",
                "ttft_ms": round(1000 * (t_gen - t_start + res.ttft_s), 2),
                "load_ms": round(1000 * load["s"], 2),
                "tier_hits": load["hits"],
                "tier_misses": load["misses"],
                "decode_tokens_per_s": round(max(n_out - 1, 0) / res.decode_s, 2) if res.decode_s > 0 and n_out > 1 else None,
                "kv_fraction": round(res.stats.kv_fraction, 5),
                "select_ms": round(1000 * res.stats.select_s, 2),
                "attend_ms": round(1000 * res.stats.attend_s, 2),
                "steps": res.stats.steps,
                "device": self.device,
                "kv_device": kv_device,
                "method_stats": session.stats(),
            },
        })


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
        from indexer._saap_train import TrainingCancelled, TrainSettings, train_saap

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
            # layers by changing its config (`_saap_train.first_layers`), which would silently cut a
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
            cat.end_train(jid, fp, status="cancelled", phase="cancelled")
            return
        except Exception as e:  # noqa: BLE001 - a failed job becomes the job's status, never a lost job
            log.exception("training job %s failed", jid)
            cat.end_train(jid, fp, status="failed", phase="failed", error_code="train_failed",
                          error_message=f"{type(e).__name__}: {e}"[:2000])
            return
        cat.end_train(jid, fp, status="done", phase="done", progress=1.0, model_dir=str(out),
                      digest=manifest["digest"], layers_done=len(manifest["layers"]),
                      layers_total=len(manifest["layers"]), train_s=round(time.perf_counter() - t0, 2))


class Janitor(_Loop):
    """Removes expired contexts (record + artifacts) and requeues jobs of crashed workers."""

    kind = "janitor"

    def __init__(self, rt: Runtime, on_delete=None):
        super().__init__(rt)
        self.on_delete = on_delete

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
        return {"expired": expired, "requeued": requeued}


def delete_context(rt: Runtime, cid: str) -> bool:
    """Remove a context's record and its artifacts. True if anything existed."""
    raw = rt.catalog.r.hgetall(rt.catalog.k_ctx(cid))
    slug = (raw.get(b"slug") or b"").decode() or rt.lm.spec.slug
    rt.catalog.delete(cid)
    removed = rt.store.delete(slug, PromptHash(cid))
    return bool(raw) or removed
