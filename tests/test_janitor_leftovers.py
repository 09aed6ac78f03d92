"""Decode requests left behind when the API and the decode worker die together (issue 14): the
request stays in the decode active list with no lease and no one waiting, and nothing else would
ever remove it. The janitor removes it once no API could still be waiting (twice the decode lease
after it saw it unleased) and never touches a request a live worker holds. Real Redis; the worker
side is the decode queue's own claim/heartbeat calls (no model runs)."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from service.app import create_app
from test_api import _settings

LEASE = 2  # decode_lease_seconds: the janitor's grace is 2 * LEASE


def _active(queue) -> set[str]:
    return {r.decode() for r in queue.r.lrange(queue.k_active, 0, -1)}


def test_janitor_drops_dead_request_keeps_live_one(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False, decode_lease_seconds=LEASE,
                         janitor_interval_seconds=0.2)
    with TestClient(create_app(settings, lm=lm)) as c:  # only the janitor runs in this process
        queues = c.app.state.runtime.queues
        queue = queues.decode
        queue.submit({"question_ids": [1, 2], "max_tokens": 4})
        queue.submit({"question_ids": [3, 4], "max_tokens": 4})
        dead = queue.claim(0, lease_s=LEASE, worker="w-dead")  # its worker is killed: never renewed
        t_claim = time.monotonic()
        live = queue.claim(0, lease_s=LEASE, worker="w-live")
        stop = threading.Event()

        def renew():  # the live worker's heartbeat thread
            while not stop.wait(LEASE / 3):
                queue.heartbeat([live["rid"]], LEASE, worker="w-live")

        beat = threading.Thread(target=renew, daemon=True)
        beat.start()
        try:
            assert _active(queue) == {dead["_raw"], live["_raw"]}
            gone_at = None
            while time.monotonic() - t_claim < 15:
                if dead["_raw"] not in _active(queue):
                    gone_at = time.monotonic() - t_claim
                    break
                time.sleep(0.1)
            assert gone_at is not None, "the dead request's active entry was never removed"
            # not before its lease expired plus the grace in which a waiting API would have acted
            assert gone_at >= LEASE + 2 * LEASE - 0.5, gone_at
            time.sleep(1.0)  # more sweeps: the live request stays, with its lease
            assert _active(queue) == {live["_raw"]}
            assert queue.r.get(queue.k_lease(live["rid"])) == b"w-live"
            assert queues.depth()["decode_active"] == 1
        finally:
            stop.set()
            beat.join()
        # the live one, once its worker is gone too, is dropped in turn
        queue.r.delete(queue.k_lease(live["rid"]))
        deadline = time.monotonic() + 3 * LEASE + 3
        while _active(queue) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _active(queue) == set()


def test_drop_decode_spares_a_leased_request(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False, decode_lease_seconds=LEASE,
                         janitor_interval_seconds=60)
    with TestClient(create_app(settings, lm=lm)) as c:
        queue = c.app.state.runtime.queues.decode
        queue.submit({"question_ids": [1], "max_tokens": 1})
        job = queue.claim(0, lease_s=LEASE)
        assert queue.unleased() == []
        assert not queue.drop_unleased(job["_raw"])  # leased: kept
        queue.r.delete(queue.k_lease(job["rid"]))
        assert queue.unleased() == [job["_raw"]]
        assert queue.drop_unleased(job["_raw"]) and _active(queue) == set()


def _prefill_queue(prefix):
    import redis

    from conftest import REDIS_URL
    from service.jobs.queue import Queues

    return Queues.create(redis.Redis.from_url(REDIS_URL), prefix)


def _job(n: int) -> dict:
    from storage.keys import PromptHash

    return {"id": PromptHash(f"{n:064x}"), "kind": "build", "queued_at": 0.0}


def test_requeue_is_one_step_and_never_takes_a_leased_job(redis_prefix):
    """`LeasedQueue.requeue`: a held job stays; a job whose lease is gone goes back to the head of
    the queue exactly once, however many janitors try (the old LREM then LPUSH could lose it between
    the two, had its process died there)."""
    q = _prefill_queue(redis_prefix).prefill
    q.push(_job(1))
    q.push(_job(2))
    held = q.claim(0, lease_s=60, worker="w")
    assert not q.requeue(held["_raw"])  # its worker holds the lease
    assert q.depth() == (1, 1)
    q.r.delete(q._lease_of(held))  # the worker died: its lease expired
    assert q.requeue(held["_raw"]) and not q.requeue(held["_raw"])  # a second janitor finds nothing to move
    assert q.depth() == (2, 0) and q.queued()[0]["id"] == held["id"]  # at the head, once


def test_janitor_requeues_a_dead_workers_job_on_its_second_sweep_only(redis_prefix):
    """A claim moves the job into the active list and then sets its lease: a sweep in between sees a
    job without a lease. The janitor requeues only jobs it saw unleased on the sweep before, so a
    claim in flight is not built twice, and a crashed worker's job still comes back."""
    from types import SimpleNamespace

    from service.jobs.janitor import Janitor

    queues = _prefill_queue(redis_prefix)
    janitor = Janitor(SimpleNamespace(queues=queues))
    q = queues.prefill
    q.push(_job(3))
    q.push(_job(4))
    claiming = q.r.lmove(q.k_queue, q.k_active, "LEFT", "RIGHT")  # a worker's claim, halfway
    assert janitor._requeue_orphans(q) == 0  # first seen unleased: left alone
    q.r.set(q.k_lease(f"{3:064x}"), "w", ex=60)  # ... the claim completes
    assert janitor._requeue_orphans(q) == 0 and q.depth() == (1, 1)
    dead = q.claim(0, lease_s=60, worker="w-dead")
    q.r.delete(q._lease_of(dead))  # that worker died
    assert janitor._requeue_orphans(q) == 0  # seen once
    assert janitor._requeue_orphans(q) == 1  # seen twice: back on the queue
    assert q.depth() == (1, 1) and q.queued()[0]["id"] == dead["id"]
    assert {r.decode() for r in q.r.lrange(q.k_active, 0, -1)} == {claiming.decode()}
