"""One leased job queue over Redis, used by every kind of work: prefill builds, decode requests,
training jobs.

    {p}q:{name}            list of queued jobs (JSON)
    {p}q:{name}:active     the jobs a worker holds
    {p}{lease}:{id}        a worker's lease on job `id` (value: the worker's id), renewed from a
                           heartbeat thread; it expires when the worker dies

A worker moves a job from the queue to the active list (LMOVE/BLMOVE: atomic, so two workers never
take one job) and sets its lease. When it is done (answered, failed, cancelled) it removes the job
and the lease. A job in the active list without a lease lost its worker; what then happens depends
on the kind of work: prefill and training jobs are put back on their queue by the janitor
(`requeue`, once it saw the job unleased on two sweeps: a claim is two commands); a decode
request is resubmitted once by the API waiting on it (`service/api/decode_client.py`), and the
janitor drops those nobody waits on (`drop_unleased`).

Jobs are dicts; typed ids in them (`storage.keys.PromptHash`) are written with `to_string` when a
job is queued and parsed back with `from_string` when it is claimed (the queue's `typed` fields),
so a worker gets the typed value. A claimed job carries `_raw`, the JSON it was queued as (how the
queue and the active list hold it).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import redis

from storage.keys import PromptHash, TrainJobId


# KEYS: the job's lease, the active list, the queue; ARGV: the job's JSON. Moves it unless leased.
_REQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('LREM', KEYS[2], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[3], ARGV[1])
return 1
"""


def encode(job: dict) -> str:
    """A job as queued: JSON, typed ids in their string form."""
    return json.dumps(job, default=_to_string)


def _to_string(value) -> str:
    if hasattr(value, "to_string"):
        return value.to_string()
    raise TypeError(f"{type(value).__name__} cannot be queued")


def _id_text(job_id) -> str:
    return job_id if isinstance(job_id, str) else _to_string(job_id)


def _text(raw) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class LeasedQueue:
    """Queue `name` with its active list and the leases of the jobs held (see the module docstring).
    `id_field`: the job field that names its lease; `lease`: the lease keys' infix; `typed`: job
    fields parsed with `from_string` of the given type when a job is claimed."""

    def __init__(self, client: redis.Redis, prefix: str, name: str, *, id_field: str = "id", lease: str = "lease",
                 typed: dict[str, type] | None = None):
        self.r = client
        self.name = name
        self.k_queue = f"{prefix}q:{name}"
        self.k_active = f"{prefix}q:{name}:active"
        self._lease = f"{prefix}{lease}:"
        self.id_field = id_field
        self.typed = typed or {}
        self._requeue = None  # the requeue script, registered on first use

    def k_lease(self, job_id: str) -> str:
        return f"{self._lease}{job_id}"

    def _lease_of(self, job: dict) -> str:
        return self.k_lease(_id_text(job[self.id_field]))

    # -- queueing -------------------------------------------------------------------------------
    def push(self, job: dict, pipe=None) -> str:
        """Queue `job` (on `pipe` when given: inside the caller's transaction). Returns its JSON."""
        raw = encode(job)
        (pipe if pipe is not None else self.r).rpush(self.k_queue, raw)
        return raw

    def submit(self, job: dict) -> str:
        """Queue `job` under a fresh id in its `id_field` (a decode request's `rid`); returns the id."""
        job_id = uuid.uuid4().hex
        self.push({**job, self.id_field: job_id})
        return job_id

    def queued(self) -> list[dict]:
        """The jobs waiting, oldest first, each with its `_raw`."""
        return [self._parse(raw) for raw in self.r.lrange(self.k_queue, 0, -1)]

    def depth(self) -> tuple[int, int]:
        """(jobs waiting, jobs held by a worker)."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.llen(self.k_queue)
            pipe.llen(self.k_active)
            queued, active = pipe.execute()
        return queued, active

    # -- a worker's side ------------------------------------------------------------------------
    def claim(self, timeout_s: float, lease_s: int, worker: str = "") -> dict | None:
        """The next job, leased to `worker` for `lease_s`; waits up to timeout_s for one (0: return
        at once; BLMOVE's own 0 would wait forever)."""
        if timeout_s <= 0:
            raw = self.r.lmove(self.k_queue, self.k_active, "LEFT", "RIGHT")
        else:
            raw = self.r.blmove(self.k_queue, self.k_active, timeout_s, "LEFT", "RIGHT")
        if raw is None:
            return None
        job = self._parse(raw)
        self.r.set(self._lease_of(job), worker or "1", ex=lease_s)
        return job

    def heartbeat(self, job_ids: list, lease_s: int, worker: str = "") -> None:
        """Renew the leases of the jobs a worker holds, by their ids (one round trip for all)."""
        if not job_ids:
            return
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.set(self.k_lease(_id_text(job_id)), worker or "1", ex=lease_s)
            pipe.execute()

    def finish(self, job: dict) -> None:
        """The worker is done with `job` (answered, failed or cancelled): drop it and its lease."""
        with self.r.pipeline() as pipe:
            pipe.lrem(self.k_active, 1, job["_raw"])
            pipe.delete(self._lease_of(job))
            pipe.execute()

    # -- lost jobs (their worker died) ----------------------------------------------------------
    def unleased(self) -> list[str]:
        """The active jobs (their queued JSON) that no worker holds a lease on: their worker died."""
        raws = self.r.lrange(self.k_active, 0, -1)
        if not raws:
            return []
        with self.r.pipeline(transaction=False) as pipe:
            for raw in raws:
                pipe.exists(self._lease_of(json.loads(raw)))
            leased = pipe.execute()
        return [_text(raw) for raw, held in zip(raws, leased) if not held]

    def requeue(self, raw: str) -> bool:
        """Put one active job (its queued JSON) back at the head of the queue unless a worker holds
        its lease; True if it moved. One atomic step (a script): a crash cannot drop the job between
        leaving the active list and rejoining the queue, two janitors cannot queue it twice, and a
        lease taken since the caller looked wins."""
        if self._requeue is None:
            self._requeue = self.r.register_script(_REQUEUE)
        return bool(self._requeue(keys=[self._lease_of(json.loads(raw)), self.k_active, self.k_queue], args=[raw]))

    def drop_unleased(self, raw: str) -> bool:
        """Remove one active job (its queued JSON) unless a worker leased it meanwhile; True if it
        was removed."""
        lease = self._lease_of(json.loads(raw))
        with self.r.pipeline() as pipe:  # WATCH: a lease taken between the check and the removal wins
            try:
                pipe.watch(lease)
                if pipe.exists(lease):
                    return False
                pipe.multi()
                pipe.lrem(self.k_active, 1, raw)
                return bool(pipe.execute()[0])
            except redis.WatchError:
                return False

    def _parse(self, raw) -> dict:
        job = json.loads(raw)
        for field, cls in self.typed.items():
            if job.get(field) is not None:
                job[field] = cls.from_string(job[field])
        job["_raw"] = _text(raw)
        return job


@dataclass
class Queues:
    """The service's three queues (`Runtime.queues`): prefill builds (`{"id": PromptHash, "kind":
    "build" | "index", "queued_at"}`), decode requests (the API's completion job plus its request
    id `rid`, which names its lease `{p}dlease:{rid}` and its event stream) and training jobs
    (`{"id": TrainJobId, "queued_at"}`, leased under `{p}lease:{id}` like prefill jobs)."""

    prefill: LeasedQueue
    decode: LeasedQueue
    train: LeasedQueue

    @classmethod
    def create(cls, client: redis.Redis, prefix: str) -> "Queues":
        return cls(LeasedQueue(client, prefix, "prefill", typed={"id": PromptHash}),
                   LeasedQueue(client, prefix, "decode", id_field="rid", lease="dlease", typed={"id": PromptHash}),
                   LeasedQueue(client, prefix, "train", typed={"id": TrainJobId}))

    def depth(self) -> dict[str, int]:
        """Jobs waiting (`prefill`, `decode`, `train`) and held (`<kind>_active`) in each queue."""
        out = {}
        for q in (self.prefill, self.decode, self.train):
            out[q.name], out[f"{q.name}_active"] = q.depth()
        return out
