"""The train worker: runs offline training jobs (SAAP) queued by `POST /v1/methods/saap/train`,
reporting progress into the job's record (`service/jobs/train_records.py`)."""

from __future__ import annotations

import json
import logging
import time

from service import metrics
from service.errors import redact_paths
from service.jobs.base import LeasedLoop
from service.jobs.queue import LeasedQueue
from service.runtime import resolve_device

log = logging.getLogger("ctxcache.worker")


class TrainWorker(LeasedLoop):
    """Runs offline training jobs (`POST /v1/methods/saap/train`): the same `train_saap` as
    `ctxcache train saap`, with the service's model and data dir, reporting progress into the job
    record. Training is resumable (finished layers are checkpointed), so a job requeued after a
    crash continues where it stopped. It trains on the service's `device` (auto: the GPU when
    there is one), with its own copy of the model's weights, loaded per job."""

    kind = "train"

    def queue(self) -> LeasedQueue:
        return self.rt.queues.train

    def process(self, job: dict) -> None:
        from training.loop import TrainingCancelled, train_saap
        from training.settings import TrainSettings

        jobs, jid = self.rt.train_jobs, job["id"]
        rec = jobs.get(jid)
        if rec is None or rec["status"] in ("done", "failed", "cancelled"):
            return
        fp = rec["fingerprint"]
        jobs.update(jid, status="running", phase="starting", attempts=int(rec.get("attempts") or 0) + 1)
        t0 = time.perf_counter()

        def on_progress(ev: dict) -> None:
            done, total = ev["layers_done"], max(1, ev["layers_total"])
            # corpus capture is ~15% of a small run's time; layers share the rest
            jobs.update(jid, phase=ev["phase"] if ev["phase"] == "capture" else f"layer {ev['layer']}",
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
                             should_stop=lambda: bool((jobs.get(jid) or {}).get("cancel_requested")))
            manifest = json.loads((out / "manifest.json").read_text())
        except TrainingCancelled:
            log.info("training job %s cancelled", jid)
            metrics.job_finished(self.kind, "cancelled")
            jobs.end(jid, fp, status="cancelled", phase="cancelled")
            return
        except Exception as e:  # noqa: BLE001 - a failed job becomes the job's status, never a lost job
            log.exception("training job %s failed", jid)
            metrics.job_finished(self.kind, "failed")
            jobs.end(jid, fp, status="failed", phase="failed", error_code="train_failed",
                     error_message=redact_paths(f"{type(e).__name__}: {e}"[:2000], self.rt.settings.data_dir))
            return
        metrics.job_finished(self.kind, "done")
        jobs.end(jid, fp, status="done", phase="done", progress=1.0, model_dir=str(out),
                 digest=manifest["digest"], layers_done=len(manifest["layers"]),
                 layers_total=len(manifest["layers"]), train_s=round(time.perf_counter() - t0, 2))
