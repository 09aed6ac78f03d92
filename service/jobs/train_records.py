"""Offline training jobs' records (SAAP), in Redis; the jobs themselves run through the `train`
queue (`service/jobs/queue.py`) on a train worker (`service/jobs/train.py`).

    {p}train:{jid}         hash: status, progress, phase, layers_done, layers_total, method, model,
                           fingerprint, settings (json), corpus, model_dir, digest, created_at,
                           updated_at, error_code, error_message, attempts, cancel_requested
    {p}trains              zset jid -> created_at (listing)
    {p}train:running:{fp}  the one active (queued/running) training job of a model fingerprint

A job is named by its `storage.keys.TrainJobId`; records come back as dicts whose `id` is its string.
"""

from __future__ import annotations

import time

import redis

from service.jobs.queue import LeasedQueue
from storage.catalog import decode_hash, encode_fields, update_existing
from storage.keys import TrainJobId


class TrainConflict(Exception):
    """Another training job of the same model is queued or running."""

    def __init__(self, other: str):
        super().__init__(f"training job {other} of this model is queued or running")
        self.other = other


class TrainJobs:
    """The records of training jobs, and their queue (`queue`: a job is queued with its record)."""

    def __init__(self, client: redis.Redis, prefix: str, queue: LeasedQueue):
        self.r = client
        self.p = prefix
        self.queue = queue

    def k_train(self, jid: TrainJobId) -> str:
        return f"{self.p}train:{jid.to_string()}"

    def k_running(self, fingerprint: str) -> str:
        return f"{self.p}train:running:{fingerprint}"

    @property
    def k_trains(self) -> str:
        return f"{self.p}trains"

    def submit(self, jid: TrainJobId, record: dict) -> tuple[dict, bool]:
        """Queue training job `jid` (its id is a digest of what it trains: equal requests are one job)
        unless it exists and is queued, running or done; a failed or cancelled one is queued again. At most one
        job per model fingerprint is active: `TrainConflict` names the other one.

        Returns (record, created)."""
        key, fp, sid = self.k_train(jid), record["fingerprint"], jid.to_string()
        running_key = self.k_running(fp)
        now = time.time()
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key, running_key)
                    existing = pipe.hgetall(key)
                    cur = decode_hash(existing) if existing else None
                    if cur and cur["status"] not in ("failed", "cancelled"):
                        pipe.reset()
                        return cur, False
                    other = pipe.get(running_key)
                    other = other.decode() if isinstance(other, bytes) else other
                    if other and other != sid:
                        pipe.reset()
                        raise TrainConflict(other)
                    rec = {**record, "id": sid, "status": "queued", "progress": 0.0, "phase": "queued",
                           "layers_done": 0, "layers_total": record.get("layers_total", 0),
                           "settings": record["settings"], "created_at": now, "updated_at": now,
                           "model_dir": "", "digest": "", "error_code": "", "error_message": "", "cancel_requested": 0,
                           "attempts": int(cur.get("attempts", 0)) if cur else 0}
                    pipe.multi()
                    pipe.delete(key)
                    pipe.hset(key, mapping={**encode_fields(rec), "updated_at": now})
                    pipe.zadd(self.k_trains, {sid: now})
                    pipe.set(running_key, sid)
                    self.queue.push({"id": jid, "queued_at": now}, pipe)
                    pipe.execute()
                    return decode_hash(encode_fields(rec) | {"updated_at": now}), True
                except redis.WatchError:
                    continue

    def cancel(self, jid: TrainJobId) -> dict | None:
        """Cancel job `jid`: a queued one leaves the queue and is `cancelled` now (its model's training
        slot freed); a running one gets `cancel_requested`, which its worker checks between corpus
        windows, layers and every few hundred steps, then ends the job `cancelled`. A job that ended
        (done, failed, cancelled) is returned unchanged. None when there is no such job."""
        key = self.k_train(jid)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.hgetall(key)
                    if not raw:
                        pipe.reset()
                        return None
                    cur = decode_hash(raw)
                    if cur["status"] not in ("queued", "running"):
                        pipe.reset()
                        return cur
                    queued = [job["_raw"] for job in self.queue.queued() if job["id"] == jid]
                    now = time.time()
                    pipe.multi()
                    # also flagged when queued: a worker that claimed it a moment ago stops at its first check
                    pipe.hset(key, mapping={"cancel_requested": 1, "updated_at": now})
                    if cur["status"] == "queued":
                        for x in queued:
                            pipe.lrem(self.queue.k_queue, 0, x)
                        pipe.hset(key, mapping={"status": "cancelled", "phase": "cancelled"})
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        if cur["status"] == "queued":
            self.end(jid, cur["fingerprint"])  # frees the slot (the status is already set)
        return self.get(jid)

    def get(self, jid: TrainJobId) -> dict | None:
        h = self.r.hgetall(self.k_train(jid))
        return decode_hash(h) if h else None

    def update(self, jid: TrainJobId, **fields) -> bool:
        """Set fields on an existing job record; False (nothing written) if it is gone."""
        return update_existing(self.r, self.k_train(jid), encode_fields(fields))

    def end(self, jid: TrainJobId, fingerprint: str, **fields) -> None:
        """Final status of a job (done / failed / cancelled); frees the model's training slot."""
        self.update(jid, **fields)
        running_key = self.k_running(fingerprint)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(running_key)
                    cur = pipe.get(running_key)
                    pipe.multi()
                    if (cur.decode() if isinstance(cur, bytes) else cur) == jid.to_string():
                        pipe.delete(running_key)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def list(self, limit: int = 100) -> list[dict]:
        ids = [x.decode() if isinstance(x, bytes) else x for x in self.r.zrevrange(self.k_trains, 0, limit - 1)]
        return [rec for sid in ids if (rec := self.get(TrainJobId.from_string(sid))) is not None]
