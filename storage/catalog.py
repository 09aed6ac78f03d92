"""The catalog of contexts, in Redis: one record per context, its listing and expiry schedule.

Redis is an index of what storage holds; the artifacts on disk are the truth. If Redis loses the
catalog, `service.maintenance.rebuild_catalog` re-adds every published context. The work in flight
(job queues, leases, decode streams, worker heartbeats, training jobs) is not here: it is the
service's, in `service/jobs/`.

Keys (all under one configurable prefix, so tests and deployments can share a server):

    {p}ctx:{id}            hash: status, progress, model, n_tokens, methods (json), display_name,
                           created_at, updated_at, expires_at, bytes, timings (json), error_code, error_message
    {p}contexts            zset id -> created_at (listing, pagination)
    {p}expiry              zset id -> expires_at (the janitor removes what is due)
    {p}tokens:{id}         json token ids of a queued context (deleted when it is ready)
    {p}deleted:{id}        tombstone of a deleted (or expired) context, for a day: a build that finishes
                           after it deletes what it wrote; a build whose record vanished without one
                           (Redis lost its data) re-adds the record instead

A context is named by its `storage.keys.PromptHash` everywhere in this API; its string form is
used only in the keys and the zsets' members. Records come back as dicts whose `id` is that string
(what the API answers with).

Registration is single-flight: a WATCH/MULTI transaction creates the record and queues its build
(through the `enqueue` the caller passes: the service's prefill queue) only if no live record
exists, so concurrent registrations of one document build it once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from storage.keys import PromptHash

STATUSES = ("queued", "prefilling", "indexing", "ready", "failed")
ACTIVE = ("queued", "prefilling", "indexing")

# enqueue(job, pipeline): add a build job to a queue inside the registering transaction
Enqueue = Callable[[dict, redis.client.Pipeline], object]


@dataclass
class Registration:
    id: PromptHash
    created: bool  # a new build was queued by this call
    record: dict


def decode_hash(h: dict) -> dict:
    """A Redis hash as HGETALL returns it (bytes) -> a record: JSON fields parsed, numbers typed,
    empty strings as None. Shared with the training-job records (`service/jobs/train_records.py`)."""
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


def encode_fields(fields: dict) -> dict:
    """Record fields for HSET: dicts and lists as JSON, None as "", `updated_at` now."""
    enc = {k: (json.dumps(v) if isinstance(v, (dict, list)) else "" if v is None else v) for k, v in fields.items()}
    enc["updated_at"] = time.time()
    return enc


def write_if(r: redis.Redis, key: str, exists: bool, write: Callable[[redis.client.Pipeline], object]) -> bool:
    """Run the commands `write` queues on a pipeline as one transaction, only if the key's existence
    is `exists` when it runs (WATCH/MULTI, retried on a concurrent write); False if it is not."""
    with r.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                if bool(pipe.exists(key)) != exists:
                    pipe.reset()
                    return False
                pipe.multi()
                write(pipe)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


def update_existing(r: redis.Redis, key: str, mapping: dict) -> bool:
    """HSET `mapping` on the hash at `key` only if it exists (False if not): a write after the
    record was deleted or lost never recreates it as a partial record without its status."""
    return write_if(r, key, True, lambda pipe: pipe.hset(key, mapping=mapping))


class Catalog:
    """The context records under one key prefix (see the module docstring)."""

    def __init__(self, client: redis.Redis, prefix: str = "ctxcache:"):
        self.r = client
        self.p = prefix

    # -- keys -----------------------------------------------------------------------------------
    def k_ctx(self, cid: PromptHash) -> str:
        return f"{self.p}ctx:{cid.to_string()}"

    @property
    def k_contexts(self) -> str:
        return f"{self.p}contexts"

    @property
    def k_expiry(self) -> str:
        return f"{self.p}expiry"

    def k_tokens(self, cid: PromptHash) -> str:
        return f"{self.p}tokens:{cid.to_string()}"

    def k_deleted(self, cid: PromptHash) -> str:
        return f"{self.p}deleted:{cid.to_string()}"

    def ping(self) -> bool:
        return bool(self.r.ping())

    # -- records --------------------------------------------------------------------------------
    def get(self, cid: PromptHash) -> dict | None:
        h = self.r.hgetall(self.k_ctx(cid))
        if not h:
            return None
        rec = decode_hash(h)
        if rec.get("expires_at") and rec["expires_at"] <= time.time():
            return None  # expired: invisible now, removed by the janitor
        return rec

    def update(self, cid: PromptHash, **fields) -> bool:
        """Set fields on an existing record; False if the record is gone (deleted meanwhile)."""
        return update_existing(self.r, self.k_ctx(cid), encode_fields(fields))

    def register(
        self,
        cid: PromptHash,
        record: dict,
        token_ids: list[int],
        wanted: dict[str, dict],
        ttl_seconds: int | None,
        enqueue: Enqueue | None = None,
    ) -> Registration:
        """Create the record and queue a build, unless one exists (then add missing methods).

        `wanted`: method name -> {"index_id", "params"} for methods that persist an index.
        `enqueue(job, pipe)` adds the build job (`{"id": cid, "kind": "build" | "index", "queued_at"}`)
        to a queue inside this transaction (the service passes its prefill queue's `push`); None
        queues nothing (the record only).
        """
        key, sid = self.k_ctx(cid), cid.to_string()
        now = time.time()

        def queue(kind: str) -> None:
            if enqueue is not None:
                enqueue({"id": cid, "kind": kind, "queued_at": now}, pipe)

        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    existing = pipe.hgetall(key)
                    cur = decode_hash(existing) if existing else None
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
                        queue("index")
                        pipe.execute()
                        return Registration(cid, True, {**cur, "methods": methods})
                    rec = {
                        **record,
                        "id": sid,
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
                    pipe.zadd(self.k_contexts, {sid: now})
                    if ttl_seconds:
                        pipe.zadd(self.k_expiry, {sid: now + ttl_seconds})
                    else:
                        pipe.zrem(self.k_expiry, sid)
                    pipe.set(self.k_tokens(cid), json.dumps(token_ids))
                    queue("build")
                    pipe.execute()
                    return Registration(cid, True, decode_hash(rec | {"methods": json.dumps(wanted)}))
                except redis.WatchError:
                    continue

    def add_ready(self, cid: PromptHash, record: dict, methods: dict, manifest_summary: dict) -> bool:
        """Insert a context found on disk (catalog rebuild), with its expiry if it has one. No-op
        (False) if the id is known."""
        key, sid = self.k_ctx(cid), cid.to_string()
        now = time.time()
        rec = {"expires_at": "", **record, "id": sid, "status": "ready", "progress": 1.0, "methods": json.dumps(methods),
               "created_at": manifest_summary.get("created_at", now), "updated_at": now,
               "error_code": "", "error_message": "", "attempts": 1}
        def write(pipe) -> None:
            pipe.hset(key, mapping={k: ("" if v is None else v) for k, v in rec.items()})
            pipe.zadd(self.k_contexts, {sid: rec["created_at"]})
            if rec.get("expires_at"):
                pipe.zadd(self.k_expiry, {sid: float(rec["expires_at"])})

        # One transaction: a reader sees no record or the whole one (an HSETNX of the id followed by
        # an HSET of the rest let a GET in between read a record with an id and no status).
        return write_if(self.r, key, False, write)

    def set_ttl(self, cid: PromptHash, ttl_seconds: int | None) -> None:
        self.set_expiry(cid, time.time() + ttl_seconds if ttl_seconds else None)

    def set_expiry(self, cid: PromptHash, expires_at: float | None) -> None:
        """Set (or clear, None) when a context expires: the record and the janitor's schedule."""
        if expires_at:
            self.update(cid, expires_at=expires_at)
            self.r.zadd(self.k_expiry, {cid.to_string(): expires_at})
        else:
            self.update(cid, expires_at=None)
            self.r.zrem(self.k_expiry, cid.to_string())

    def was_deleted(self, cid: PromptHash) -> bool:
        """Whether the context was deleted (or expired) in the last day and not registered since."""
        return bool(self.r.exists(self.k_deleted(cid)))

    def delete(self, cid: PromptHash) -> dict | None:
        """Remove the record (leaving a tombstone for a day); returns it as it was, expired or not."""
        rec = self.get(cid) or (decode_hash(self.r.hgetall(self.k_ctx(cid))) or None)
        with self.r.pipeline() as pipe:
            pipe.delete(self.k_ctx(cid), self.k_tokens(cid))
            pipe.zrem(self.k_contexts, cid.to_string())
            pipe.zrem(self.k_expiry, cid.to_string())
            pipe.set(self.k_deleted(cid), "1", ex=24 * 3600)
            pipe.execute()
        return rec

    def list(self, offset: int = 0, limit: int = 20, model: str | None = None,
             status: str | None = None) -> tuple[list[dict], int]:
        """Newest first. Returns (page, total matching)."""
        ids = [PromptHash.from_string(i.decode()) for i in self.r.zrevrange(self.k_contexts, 0, -1)]
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

    def due_for_expiry(self, now: float | None = None) -> list[PromptHash]:
        return [PromptHash.from_string(i.decode()) for i in self.r.zrangebyscore(self.k_expiry, "-inf", now or time.time())]

    def tokens(self, cid: PromptHash) -> list[int] | None:
        raw = self.r.get(self.k_tokens(cid))
        return json.loads(raw) if raw else None

    def drop_tokens(self, cid: PromptHash) -> None:
        self.r.delete(self.k_tokens(cid))

    def set_tokens(self, cid: PromptHash, token_ids: list[int]) -> None:
        """Keep a context's token ids for a rebuild (its stored artifacts are being replaced)."""
        self.r.set(self.k_tokens(cid), json.dumps(token_ids))
