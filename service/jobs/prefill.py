"""The prefill worker: builds a registered context (the model over its tokens, the requested
indexes) and publishes it to storage, then marks its catalog record ready."""

from __future__ import annotations

import contextlib
import logging

from decoder.pipeline import build_context
from indexer.base import get_method
from service import metrics
from service.errors import redact_paths
from service.jobs.base import LeasedLoop
from service.jobs.queue import LeasedQueue
from service.maintenance import restore_record
from storage.artifacts import ArtifactCorrupt, ArtifactError
from storage.keys import KV_DTYPES, PromptHash

log = logging.getLogger("ctxcache.worker")


class PrefillWorker(LeasedLoop):
    """Claims a prefill job, runs the model over the context, builds the requested indexes and
    publishes everything atomically."""

    kind = "prefill"

    def queue(self) -> LeasedQueue:
        return self.rt.queues.prefill

    def process(self, job: dict) -> None:
        cat, cid = self.rt.catalog, job["id"]
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

    def _build(self, cid: PromptHash, rec: dict) -> None:
        rt, cat = self.rt, self.rt.catalog
        lm = rt.ensure_weights()
        spec = lm.spec
        if rec.get("slug") != spec.slug:
            raise RuntimeError(f"context was registered for model {rec.get('model')} ({rec.get('slug')}); this worker serves {spec.slug}")
        methods = {m: v for m, v in (rec.get("methods") or {}).items() if v.get("index_id")}  # index-free: nothing to build
        published = rt.store.exists(spec.slug, cid) and self._intact(cid, spec.slug)
        if published:
            manifest = rt.store.read_manifest(spec.slug, cid)
            todo = {m: v for m, v in methods.items() if v["index_id"] not in manifest["indexes"]}
            if not todo:
                self._ready(cid, spec.slug, manifest)
                return
            tokens = rt.store.open(spec.slug, cid).read("tokens").tolist()
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
        res = build_context(lm, rt.store, cid, tokens, todo_built, env=rt.method_env,
                            chunk_tokens=rt.settings.prefill_chunk_tokens, progress=progress, on_index=on_index,
                            manifest_extra={"prompt_format": rec.get("prompt_format", "chat"),
                                            "display_name": rec.get("display_name") or "",
                                            "expires_at": rec.get("expires_at")},
                            kv_dtype=kv_dtype)
        manifest = res.manifest
        if not self._ready(cid, spec.slug, manifest):
            if cat.was_deleted(cid):
                rt.store.delete(spec.slug, cid)  # deleted while we were building: leave nothing behind
            else:  # the record vanished without a delete (Redis lost its data): storage is the truth
                log.warning("context %s: its record vanished during the build; re-added from the manifest", cid)
                restore_record(rt, spec.slug, manifest)
        cat.drop_tokens(cid)

    @staticmethod
    def _kv_dtype(cid: PromptHash, spec, tokens: list[int], recorded: str | None) -> str:
        """The dtype to store the K/V in: the one the context id was computed with (the record's,
        set by the API from `kv_dtype`, tried first). A record without it (registered before the
        setting, or restored from a manifest) still gets the id's dtype; tokens that hash to the id
        under no dtype are refused rather than stored under a wrong id."""
        for dt in dict.fromkeys([d for d in (recorded, *KV_DTYPES) if d in KV_DTYPES]):
            if PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, tokens, dt) == cid:
                return dt
        raise RuntimeError("the context's token ids do not hash to its id under any kv dtype; register it again")

    def _intact(self, cid: PromptHash, slug: str) -> bool:
        """Whether a published context verifies chunk by chunk (`ContextStore.verify`). A context is
        never marked ready from a manifest whose chunks fail: a damaged one is removed here and built
        again (its token ids kept in the catalog first, when the catalog lost them and the stored
        ones verify)."""
        rt, cat = self.rt, self.rt.catalog
        try:
            problems = rt.store.verify(slug, cid)
        except ArtifactCorrupt as e:  # the manifest itself is unreadable
            problems = [str(e)]
        if not problems:
            return True
        log.error("context %s: stored artifacts are damaged, rebuilding (%d problems, first: %s)",
                  cid, len(problems), problems[0])
        if cat.tokens(cid) is None and not any(p.startswith("tokens") for p in problems):
            with contextlib.suppress(ArtifactError, ValueError):
                cat.set_tokens(cid, rt.store.open(slug, cid).read("tokens").tolist())
        rt.store.delete(slug, cid)
        return False

    def _ready(self, cid: PromptHash, slug: str, manifest: dict) -> bool:
        """Mark the context ready; then write its current name and expiry into the manifest (a PATCH
        or a re-registration may have changed them since the build started). False: no record."""
        cat = self.rt.catalog
        if not cat.update(cid, status="ready", progress=1.0, n_tokens=manifest["n_tokens"], bytes=manifest["bytes"],
                          timings=manifest.get("timings", {}), error_code="", error_message=""):
            return False
        rec = cat.get(cid)
        if rec is not None:
            try:
                self.rt.store.update_metadata(slug, cid, display_name=rec.get("display_name") or "",
                                              expires_at=rec.get("expires_at"))
            except (ArtifactError, OSError) as e:  # served from the catalog meanwhile; a rebuild would use the older values
                log.warning("context %s: could not write name/expiry into its manifest: %s", cid, e)
        return True
