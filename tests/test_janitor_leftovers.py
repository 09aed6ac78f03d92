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
