"""What every worker shares: a loop that survives Redis outages and bad jobs (`Loop`), and one over
a leased queue that keeps the lease of the job it runs alive (`LeasedLoop`).

Each worker runs as such a loop, in its own process (`ctxcache worker prefill|decode|train`) or as
a thread of the API process in embedded mode: the same code either way.
"""

from __future__ import annotations

import logging
import threading
import uuid

import redis
import torch

from service.jobs.queue import LeasedQueue
from service.runtime import Runtime

log = logging.getLogger("ctxcache.worker")


class Loop:
    kind = "worker"

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.wid = uuid.uuid4().hex[:8]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Loop":
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
                self.rt.heartbeats.beat(self.kind, self.wid, ttl_s=self.liveness_ttl_s, info=self.info())
                self.tick()
                backoff = 0.5
            except Exception as e:  # noqa: BLE001 - a worker must survive Redis outages and bad jobs
                log.warning("%s %s: %s", self.kind, self.wid, e, exc_info=not _is_redis_down(e))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def tick(self) -> None:
        raise NotImplementedError


def _is_redis_down(e: Exception) -> bool:
    return isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))


class LeasedLoop(Loop):
    """Claims one leased job at a time from `queue()` and keeps its lease alive while `process`
    runs (and the worker's own heartbeat, so a worker busy with a long job still counts as live). A
    crash leaves the job in the active list; once its lease expires the janitor requeues it."""

    def queue(self) -> LeasedQueue:
        raise NotImplementedError

    def process(self, job: dict) -> None:
        raise NotImplementedError

    def tick(self) -> None:
        queue = self.queue()
        job = queue.claim(timeout_s=1.0, lease_s=self.rt.settings.job_lease_seconds, worker=self.wid)
        if job is None:
            return
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(queue, job, beat_stop), daemon=True)
        beat.start()
        try:
            self.process(job)
        finally:
            beat_stop.set()
            beat.join()
            queue.finish(job)

    def _heartbeat(self, queue: LeasedQueue, job: dict, stop: threading.Event) -> None:
        lease = self.rt.settings.job_lease_seconds
        while not stop.wait(max(1.0, min(lease, self.liveness_ttl_s) / 3)):
            try:
                queue.heartbeat([job["id"]], lease, self.wid)
                self.rt.heartbeats.keep_alive(self.kind, self.wid, self.liveness_ttl_s)
            except Exception:  # noqa: BLE001
                log.warning("heartbeat failed for job %s", job["id"])
