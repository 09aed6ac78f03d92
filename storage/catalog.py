"""The catalog and the job queues, in Redis.

Redis is an index of what storage holds plus the work in flight; the artifacts on disk are the
truth. If Redis loses the catalog, `rebuild_from_store` re-adds every published context.

Keys (all under one configurable prefix, so tests and deployments can share a server):

    {p}ctx:{id}            hash: status, progress, model, n_tokens, methods (json), display_name,
                           created_at, updated_at, expires_at, bytes, timings (json), error_code, error_message
    {p}contexts            zset id -> created_at (listing, pagination)
    {p}expiry              zset id -> expires_at (the janitor removes what is due)
    {p}tokens:{id}         json token ids of a queued context (deleted when it is ready)
    {p}deleted:{id}        tombstone of a deleted (or expired) context, for a day: a build that finishes
                           after it deletes what it wrote; a build whose record vanished without one
                           (Redis lost its data) re-adds the record instead
    {p}q:prefill           list of prefill jobs (json); {p}q:prefill:active the ones being worked on
    {p}lease:{id}          a worker's heartbeat on a job (expires: the job is requeued)
    {p}q:decode            list of decode requests (json); {p}q:decode:active the ones a worker holds
    {p}dlease:{rid}        a decode worker's lease on request rid (expires: the worker died; the waiting
                           API retries the request once or answers 503 decode_worker_lost)
    {p}out:{rid}           stream of a decode request's events (token / done / error)
    {p}cancel:{rid}        set when the client went away
    {p}worker:{kind}:{wid} heartbeat of a live worker (expires)
    {p}train:{jid}         hash: an offline training job (SAAP): status, progress, phase, layers_done,
                           layers_total, method, model, fingerprint, settings (json), corpus, model_dir,
                           digest, created_at, updated_at, error_code, error_message, attempts
    {p}trains              zset jid -> created_at (listing)
    {p}train:running:{fp}  the one active (queued/running) training job of a model fingerprint
    {p}q:train             list of training jobs (json); {p}q:train:active the ones being worked on

Registration is single-flight: a WATCH/MULTI transaction creates the record and enqueues the job
only if no live record exists, so concurrent registrations of one document build it once.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import redis

STATUSES = ("queued", "prefilling", "indexing", "ready", "failed")
ACTIVE = ("queued", "prefilling", "indexing")
TRAIN_STATUSES = ("queued", "running", "done", "failed")


class TrainConflict(Exception):
    """Another training job of the same model is queued or running."""

    def __init__(self, other: str):
        super().__init__(f"training job {other} of this model is queued or running")
        self.other = other


@dataclass
class Registration:
    id: str
    created: bool  # a new build was queued by this call
    record: dict


def _decode(h: dict) -> dict:
    out = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v) for k, v in h.items()}
    for key in ("methods", "timings", "manifest", "settings"):
        if key in out and out[key]:
            out[key] = json.loads(out[key])
    for key in ("progress", "created_at", "updated_at", "expires_at", "train_s"):
        if out.get(key) not in (None, ""):
            out[key] = float(out[key])
        elif key in out:
            out[key] = None
    for key in ("n_tokens", "bytes", "attempts", "layers_done", "layers_total", "cancel_requested"):
        if out.get(key) not in (None, ""):
            out[key] = int(out[key])
    return out


def decode_job(request: dict, rid: str) -> str:
    """A decode request as queued: its JSON with the request id (`rid`) added."""
    return json.dumps({**request, "rid": rid})


def stream_events(got) -> list[tuple[str, str, dict]]:
    """A request's output stream entries, as XREAD returns them (sync or asyncio client), ->
    [(entry id, event, data)]."""
    out = []
    for _, entries in got or []:
        for eid, fields in entries:
            f = {k.decode(): v.decode() for k, v in fields.items()}
            out.append((eid.decode(), f["event"], json.loads(f["data"])))
    return out


class Catalog:
    def __init__(self, client: redis.Redis, prefix: str = "ctxcache:"):
        self.r = client
        self.p = prefix

    # -- keys -----------------------------------------------------------------------------------
    def k_ctx(self, cid: str) -> str:
        return f"{self.p}ctx:{cid}"

    @property
    def k_contexts(self) -> str:
        return f"{self.p}contexts"

    @property
    def k_expiry(self) -> str:
        return f"{self.p}expiry"

    def k_tokens(self, cid: str) -> str:
        return f"{self.p}tokens:{cid}"

    def k_deleted(self, cid: str) -> str:
        return f"{self.p}deleted:{cid}"

    @property
    def k_prefill(self) -> str:
        return f"{self.p}q:prefill"

    @property
    def k_prefill_active(self) -> str:
        return f"{self.p}q:prefill:active"

    def k_lease(self, cid: str) -> str:
        return f"{self.p}lease:{cid}"

    @property
    def k_decode(self) -> str:
        return f"{self.p}q:decode"

    @property
    def k_decode_active(self) -> str:
        return f"{self.p}q:decode:active"

    def k_decode_lease(self, rid: str) -> str:
        return f"{self.p}dlease:{rid}"

    def k_out(self, rid: str) -> str:
        return f"{self.p}out:{rid}"

    def k_cancel(self, rid: str) -> str:
        return f"{self.p}cancel:{rid}"

    def k_worker(self, kind: str, wid: str) -> str:
        return f"{self.p}worker:{kind}:{wid}"

    def k_train(self, jid: str) -> str:
        return f"{self.p}train:{jid}"

    def k_train_running(self, fingerprint: str) -> str:
        return f"{self.p}train:running:{fingerprint}"

    @property
    def k_trains(self) -> str:
        return f"{self.p}trains"

    @property
    def k_train_queue(self) -> str:
        return f"{self.p}q:train"

    @property
    def k_train_active(self) -> str:
        return f"{self.p}q:train:active"

    def ping(self) -> bool:
        return bool(self.r.ping())

    # -- records --------------------------------------------------------------------------------
    def get(self, cid: str) -> dict | None:
        h = self.r.hgetall(self.k_ctx(cid))
        if not h:
            return None
        rec = _decode(h)
        if rec.get("expires_at") and rec["expires_at"] <= time.time():
            return None  # expired: invisible now, removed by the janitor
        return rec

    def update(self, cid: str, **fields) -> bool:
        """Set fields on an existing record; False if the record is gone (deleted meanwhile)."""
        enc = {k: (json.dumps(v) if isinstance(v, (dict, list)) else "" if v is None else v) for k, v in fields.items()}
        enc["updated_at"] = time.time()
        key = self.k_ctx(cid)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    if not pipe.exists(key):
                        pipe.reset()
                        return False
                    pipe.multi()
                    pipe.hset(key, mapping=enc)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def register(
        self,
        cid: str,
        record: dict,
        token_ids: list[int],
        wanted: dict[str, dict],
        ttl_seconds: int | None,
    ) -> Registration:
        """Create the record and queue a build, unless one exists (then add missing methods).

        `wanted`: method name -> {"index_id", "params"} for methods that persist an index.
        """
        key = self.k_ctx(cid)
        now = time.time()
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    existing = pipe.hgetall(key)
                    cur = _decode(existing) if existing else None
                    if cur and cur.get("expires_at") and cur["expires_at"] <= now:
                        cur = None  # expired but not yet collected: register afresh
                    if cur and cur["status"] != "failed":
                        have = cur.get("methods") or {}
                        missing = {m: v for m, v in wanted.items() if have.get(m, {}).get("index_id") != v["index_id"]}
                        if not missing:
                            pipe.reset()
                            return Registration(cid, False, cur)
                        # add indexes to a context that exists (or is being built)
                        methods = {**have, **missing}
                        pipe.multi()
                        pipe.hset(key, mapping={"methods": json.dumps(methods), "updated_at": now})
                        if cur["status"] == "ready":
                            pipe.hset(key, mapping={"status": "indexing", "progress": 0})
                        pipe.rpush(self.k_prefill, json.dumps({"id": cid, "kind": "index", "queued_at": now}))
                        pipe.execute()
                        return Registration(cid, True, {**cur, "methods": methods})
                    rec = {
                        **record,
                        "id": cid,
                        "status": "queued",
                        "progress": 0.0,
                        "methods": json.dumps(wanted),
                        "created_at": now,
                        "updated_at": now,
                        "expires_at": now + ttl_seconds if ttl_seconds else "",
                        "error_code": "",
                        "error_message": "",
                        "attempts": int(cur.get("attempts", 0)) + 1 if cur else 1,
                    }
                    pipe.multi()
                    pipe.delete(key, self.k_deleted(cid))
                    pipe.hset(key, mapping={k: ("" if v is None else v) for k, v in rec.items()})
                    pipe.zadd(self.k_contexts, {cid: now})
                    if ttl_seconds:
                        pipe.zadd(self.k_expiry, {cid: now + ttl_seconds})
                    else:
                        pipe.zrem(self.k_expiry, cid)
                    pipe.set(self.k_tokens(cid), json.dumps(token_ids))
                    pipe.rpush(self.k_prefill, json.dumps({"id": cid, "kind": "build", "queued_at": now}))
                    pipe.execute()
                    return Registration(cid, True, _decode(rec | {"methods": json.dumps(wanted)}))
                except redis.WatchError:
                    continue

    def add_ready(self, cid: str, record: dict, methods: dict, manifest_summary: dict) -> bool:
        """Insert a context found on disk (catalog rebuild), with its expiry if it has one. No-op
        (False) if the id is known."""
        key = self.k_ctx(cid)
        now = time.time()
        rec = {"expires_at": "", **record, "id": cid, "status": "ready", "progress": 1.0, "methods": json.dumps(methods),
               "created_at": manifest_summary.get("created_at", now), "updated_at": now,
               "error_code": "", "error_message": "", "attempts": 1}
        if not self.r.hsetnx(key, "id", cid):
            return False
        self.r.hset(key, mapping={k: ("" if v is None else v) for k, v in rec.items()})
        self.r.zadd(self.k_contexts, {cid: rec["created_at"]})
        if rec.get("expires_at"):
            self.r.zadd(self.k_expiry, {cid: float(rec["expires_at"])})
        return True

    def set_ttl(self, cid: str, ttl_seconds: int | None) -> None:
        self.set_expiry(cid, time.time() + ttl_seconds if ttl_seconds else None)

    def set_expiry(self, cid: str, expires_at: float | None) -> None:
        """Set (or clear, None) when a context expires: the record and the janitor's schedule."""
        if expires_at:
            self.update(cid, expires_at=expires_at)
            self.r.zadd(self.k_expiry, {cid: expires_at})
        else:
            self.update(cid, expires_at=None)
            self.r.zrem(self.k_expiry, cid)

    def was_deleted(self, cid: str) -> bool:
        """Whether the context was deleted (or expired) in the last day and not registered since."""
        return bool(self.r.exists(self.k_deleted(cid)))

    def delete(self, cid: str) -> dict | None:
        rec = self.get(cid) or (_decode(self.r.hgetall(self.k_ctx(cid))) or None)
        with self.r.pipeline() as pipe:
            pipe.delete(self.k_ctx(cid), self.k_tokens(cid))
            pipe.zrem(self.k_contexts, cid)
            pipe.zrem(self.k_expiry, cid)
            pipe.set(self.k_deleted(cid), "1", ex=24 * 3600)
            pipe.execute()
        return rec

    def list(self, offset: int = 0, limit: int = 20, model: str | None = None, status: str | None = None) -> tuple[list[dict], int]:
        """Newest first. Returns (page, total matching)."""
        ids = [i.decode() for i in self.r.zrevrange(self.k_contexts, 0, -1)]
        recs = []
        for cid in ids:
            rec = self.get(cid)
            if rec is None:
                continue
            if model and rec.get("model") != model:
                continue
            if status and rec.get("status") != status:
                continue
            recs.append(rec)
        return recs[offset:offset + limit], len(recs)

    def due_for_expiry(self, now: float | None = None) -> list[str]:
        return [i.decode() for i in self.r.zrangebyscore(self.k_expiry, "-inf", now or time.time())]

    def tokens(self, cid: str) -> list[int] | None:
        raw = self.r.get(self.k_tokens(cid))
        return json.loads(raw) if raw else None

    def drop_tokens(self, cid: str) -> None:
        self.r.delete(self.k_tokens(cid))

    def set_tokens(self, cid: str, token_ids: list[int]) -> None:
        """Keep a context's token ids for a rebuild (its stored artifacts are being replaced)."""
        self.r.set(self.k_tokens(cid), json.dumps(token_ids))

    # -- leased jobs (prefill, training) ---------------------------------------------------------
    # A worker moves a job from the queue to the active list (BLMOVE) and keeps a lease on it alive;
    # the janitor puts jobs whose lease expired (crashed worker) back on their queue.
    def _claim(self, queue: str, active: str, timeout_s: float, lease_s: int) -> dict | None:
        raw = self.r.blmove(queue, active, timeout_s, "LEFT", "RIGHT")
        if raw is None:
            return None
        job = json.loads(raw)
        job["_raw"] = raw.decode() if isinstance(raw, bytes) else raw
        job["_active"] = active
        self.r.set(self.k_lease(job["id"]), "1", ex=lease_s)
        return job

    def claim_prefill(self, timeout_s: float, lease_s: int) -> dict | None:
        return self._claim(self.k_prefill, self.k_prefill_active, timeout_s, lease_s)

    def claim_train(self, timeout_s: float, lease_s: int) -> dict | None:
        return self._claim(self.k_train_queue, self.k_train_active, timeout_s, lease_s)

    def heartbeat(self, job: dict, lease_s: int) -> None:
        self.r.set(self.k_lease(job["id"]), "1", ex=lease_s)

    def finish_job(self, job: dict) -> None:
        with self.r.pipeline() as pipe:
            pipe.lrem(job["_active"], 1, job["_raw"])
            pipe.delete(self.k_lease(job["id"]))
            pipe.execute()


    def requeue_stale(self) -> int:
        """Jobs whose worker stopped heart-beating (crashed) go back to their queue."""
        n = 0
        for queue, active in ((self.k_prefill, self.k_prefill_active), (self.k_train_queue, self.k_train_active)):
            for raw in self.r.lrange(active, 0, -1):
                job = json.loads(raw)
                if not self.r.exists(self.k_lease(job["id"])):
                    if self.r.lrem(active, 1, raw):
                        self.r.lpush(queue, raw)
                        n += 1
        return n

    def queue_depth(self) -> dict:
        return {"prefill": self.r.llen(self.k_prefill), "prefill_active": self.r.llen(self.k_prefill_active),
                "decode": self.r.llen(self.k_decode), "decode_active": self.r.llen(self.k_decode_active),
                "train": self.r.llen(self.k_train_queue),
                "train_active": self.r.llen(self.k_train_active)}

    # -- training jobs --------------------------------------------------------------------------
    def submit_train(self, jid: str, record: dict) -> tuple[dict, bool]:
        """Queue training job `jid` (its id is a digest of what it trains: equal requests are one job)
        unless it exists and is queued, running or done; a failed or cancelled one is queued again. At most one
        job per model fingerprint is active: `TrainConflict` names the other one.

        Returns (record, created)."""
        key, fp = self.k_train(jid), record["fingerprint"]
        running_key = self.k_train_running(fp)
        now = time.time()
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key, running_key)
                    existing = pipe.hgetall(key)
                    cur = _decode(existing) if existing else None
                    if cur and cur["status"] not in ("failed", "cancelled"):
                        pipe.reset()
                        return cur, False
                    other = pipe.get(running_key)
                    other = other.decode() if isinstance(other, bytes) else other
                    if other and other != jid:
                        pipe.reset()
                        raise TrainConflict(other)
                    rec = {**record, "id": jid, "status": "queued", "progress": 0.0, "phase": "queued",
                           "layers_done": 0, "layers_total": record.get("layers_total", 0),
                           "settings": json.dumps(record["settings"]), "created_at": now, "updated_at": now,
                           "model_dir": "", "digest": "", "error_code": "", "error_message": "", "cancel_requested": 0,
                           "attempts": int(cur.get("attempts", 0)) if cur else 0}
                    pipe.multi()
                    pipe.delete(key)
                    pipe.hset(key, mapping={k: ("" if v is None else v) for k, v in rec.items()})
                    pipe.zadd(self.k_trains, {jid: now})
                    pipe.set(running_key, jid)
                    pipe.rpush(self.k_train_queue, json.dumps({"id": jid, "queued_at": now}))
                    pipe.execute()
                    return _decode(rec), True
                except redis.WatchError:
                    continue

    def cancel_train(self, jid: str) -> dict | None:
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
                    cur = _decode(raw)
                    if cur["status"] not in ("queued", "running"):
                        pipe.reset()
                        return cur
                    queued = [x for x in pipe.lrange(self.k_train_queue, 0, -1) if json.loads(x)["id"] == jid]
                    now = time.time()
                    pipe.multi()
                    # also flagged when queued: a worker that claimed it a moment ago stops at its first check
                    pipe.hset(key, mapping={"cancel_requested": 1, "updated_at": now})
                    if cur["status"] == "queued":
                        for x in queued:
                            pipe.lrem(self.k_train_queue, 0, x)
                        pipe.hset(key, mapping={"status": "cancelled", "phase": "cancelled"})
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        if cur["status"] == "queued":
            self.end_train(jid, cur["fingerprint"])  # frees the slot (the status is already set)
        return self.get_train(jid)

    def get_train(self, jid: str) -> dict | None:
        h = self.r.hgetall(self.k_train(jid))
        return _decode(h) if h else None

    def update_train(self, jid: str, **fields) -> None:
        enc = {k: (json.dumps(v) if isinstance(v, (dict, list)) else "" if v is None else v) for k, v in fields.items()}
        enc["updated_at"] = time.time()
        self.r.hset(self.k_train(jid), mapping=enc)

    def end_train(self, jid: str, fingerprint: str, **fields) -> None:
        """Final status of a job (done / failed / cancelled); frees the model's training slot."""
        self.update_train(jid, **fields)
        running_key = self.k_train_running(fingerprint)
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(running_key)
                    cur = pipe.get(running_key)
                    pipe.multi()
                    if (cur.decode() if isinstance(cur, bytes) else cur) == jid:
                        pipe.delete(running_key)
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def list_train(self, limit: int = 100) -> list[dict]:
        ids = [x.decode() if isinstance(x, bytes) else x for x in self.r.zrevrange(self.k_trains, 0, limit - 1)]
        return [rec for jid in ids if (rec := self.get_train(jid)) is not None]

    # -- decode requests ------------------------------------------------------------------------
    # A decode request is leased like a prefill job: the worker moves it from the queue to the active
    # list (BLMOVE, atomic) and holds {p}dlease:{rid}, renewed from a heartbeat thread while it decodes.
    # A request in the active list without a lease lost its worker; the API waiting on it notices
    # (service/api/decode_client.py) and resubmits it once under a new rid, or answers 503.
    def submit_decode(self, request: dict) -> str:
        rid = uuid.uuid4().hex
        self.r.rpush(self.k_decode, decode_job(request, rid))
        return rid

    def claim_decode(self, timeout_s: float, lease_s: int = 60, worker: str = "") -> dict | None:
        """The next decode request, leased to `worker` for `lease_s`; waits up to timeout_s for one
        (0: return at once — BLMOVE's own 0 would wait forever). The returned dict carries `_raw`
        (the queued JSON), which `finish_decode` needs."""
        if timeout_s <= 0:
            raw = self.r.lmove(self.k_decode, self.k_decode_active, "LEFT", "RIGHT")
        else:
            raw = self.r.blmove(self.k_decode, self.k_decode_active, timeout_s, "LEFT", "RIGHT")
        if raw is None:
            return None
        job = json.loads(raw)
        job["_raw"] = raw.decode() if isinstance(raw, bytes) else raw
        self.r.set(self.k_decode_lease(job["rid"]), worker or "1", ex=lease_s)
        return job

    def heartbeat_decode(self, rids: list[str], lease_s: int, worker: str = "") -> None:
        """Renew the leases of the requests a worker holds (one round trip for all of them)."""
        if not rids:
            return
        with self.r.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.set(self.k_decode_lease(rid), worker or "1", ex=lease_s)
            pipe.execute()

    def finish_decode(self, job: dict) -> None:
        """The worker is done with a request (answered, failed or cancelled): drop it and its lease."""
        with self.r.pipeline() as pipe:
            pipe.lrem(self.k_decode_active, 1, job["_raw"])
            pipe.delete(self.k_decode_lease(job["rid"]))
            pipe.execute()

    def abandon_decode(self, job: dict) -> None:
        """Give a held request up without answering it (a worker shutting down): its lease goes, so
        the waiting API sees the worker gone at once and retries the request or answers 503."""
        self.r.delete(self.k_decode_lease(job["rid"]))

    def unleased_decode(self) -> list[str]:
        """The active decode requests (their queued JSON) that no worker holds a lease on: their
        worker died. The API waiting on one removes it when it retries; `drop_decode` removes those
        no API waits on any more (the janitor)."""
        raws = self.r.lrange(self.k_decode_active, 0, -1)
        if not raws:
            return []
        with self.r.pipeline(transaction=False) as pipe:
            for raw in raws:
                pipe.exists(self.k_decode_lease(json.loads(raw)["rid"]))
            leased = pipe.execute()
        return [(raw.decode() if isinstance(raw, bytes) else raw) for raw, held in zip(raws, leased) if not held]

    def drop_decode(self, raw: str) -> bool:
        """Remove one active decode request (its queued JSON) unless a worker leased it meanwhile;
        True if it was removed."""
        rid = json.loads(raw)["rid"]
        with self.r.pipeline() as pipe:  # WATCH: a lease taken between the check and the removal wins
            try:
                pipe.watch(self.k_decode_lease(rid))
                if pipe.exists(self.k_decode_lease(rid)):
                    return False
                pipe.multi()
                pipe.lrem(self.k_decode_active, 1, raw)
                return bool(pipe.execute()[0])
            except redis.WatchError:
                return False

    def emit(self, rid: str, event: str, data: dict, ttl_s: int = 600) -> None:
        key = self.k_out(rid)
        with self.r.pipeline() as pipe:
            pipe.xadd(key, {"event": event, "data": json.dumps(data)})
            pipe.expire(key, ttl_s)
            pipe.execute()

    def events(self, rid: str, last_id: str, block_ms: int) -> list[tuple[str, str, dict]]:
        return stream_events(self.r.xread({self.k_out(rid): last_id}, block=block_ms))

    def cancel(self, rid: str) -> None:
        self.r.set(self.k_cancel(rid), "1", ex=600)

    def cancelled(self, rid: str) -> bool:
        return bool(self.r.exists(self.k_cancel(rid)))

    def cleanup_request(self, rid: str) -> None:
        self.r.delete(self.k_out(rid), self.k_cancel(rid))

    def keep_alive(self, kind: str, wid: str, ttl_s: int) -> None:
        """Renew a worker's heartbeat without replacing what it published (from a heartbeat thread,
        while the worker's loop is busy)."""
        key = self.k_worker(kind, wid)
        if not self.r.expire(key, ttl_s):
            self.r.set(key, json.dumps({"at": time.time()}), ex=ttl_s)

    # -- workers --------------------------------------------------------------------------------
    def worker_alive(self, kind: str, wid: str, ttl_s: int, info: dict | None = None) -> None:
        """Heartbeat; `info` (JSON) is what the worker publishes about itself (tiers, device)."""
        self.r.set(self.k_worker(kind, wid), json.dumps({"at": time.time(), **(info or {})}), ex=ttl_s)

    def live_workers(self, kind: str) -> int:
        return sum(1 for _ in self.r.scan_iter(match=self.k_worker(kind, "*"), count=100))

    def worker_info(self, kind: str) -> dict[str, dict]:
        """worker id -> its last heartbeat's info, for the live workers of a kind."""
        out = {}
        for key in self.r.scan_iter(match=self.k_worker(kind, "*"), count=100):
            raw = self.r.get(key)
            if raw:
                k = key.decode() if isinstance(key, bytes) else key
                out[k.rsplit(":", 1)[-1]] = json.loads(raw)
        return out
