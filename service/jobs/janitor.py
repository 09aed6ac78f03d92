"""The janitor: removes expired contexts (record and artifacts), puts prefill and training jobs
of crashed workers back on their queue, and drops decode requests nobody waits on any more. Every
API process runs one (`service/app.py`), so does every worker process (`ctxcache worker`)."""

from __future__ import annotations

import logging
import time

from service.contexts import delete_context
from service.jobs.base import Loop
from service.runtime import Runtime

log = logging.getLogger("ctxcache.worker")


class Janitor(Loop):
    """Removes expired contexts (record + artifacts), requeues jobs of crashed workers and drops
    decode requests that lost both their worker and their client."""

    kind = "janitor"

    def __init__(self, rt: Runtime, on_delete=None):
        super().__init__(rt)
        self.on_delete = on_delete
        self._unleased: dict[str, float] = {}  # active decode request (queued JSON) -> first seen without lease
        self._orphans: dict[str, set[str]] = {}  # prefill / train queue -> its jobs seen without a lease last sweep

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
        requeued = sum(self._requeue_orphans(q) for q in (self.rt.queues.prefill, self.rt.queues.train))
        store.gc_temp(older_than_s=max(3600.0, 10 * self.rt.settings.job_lease_seconds))
        return {"expired": expired, "requeued": requeued, "decode_dropped": self._drop_orphaned_decodes()}

    def _requeue_orphans(self, queue) -> int:
        """Requeue the prefill / training jobs of crashed workers: those without a lease on this sweep
        and the one before (a worker's claim moves the job into the active list, then sets its
        lease: a job seen once without one may be mid-claim; requeued, it would be built twice)."""
        now = set(queue.unleased())
        moved = sum(queue.requeue(raw) for raw in now & self._orphans.get(queue.name, set()))
        self._orphans[queue.name] = now
        return moved

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
        queue, now = self.rt.queues.decode, time.monotonic()
        grace = 2 * self.rt.settings.decode_lease_seconds
        self._unleased = {raw: self._unleased.get(raw, now) for raw in queue.unleased()}
        dropped = 0
        for raw, since in list(self._unleased.items()):
            if now - since >= grace and queue.drop_unleased(raw):
                del self._unleased[raw]
                dropped += 1
        if dropped:
            log.info("dropped %d decode request(s) whose worker and client are gone", dropped)
        return dropped
