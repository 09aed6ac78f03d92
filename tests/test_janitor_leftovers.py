"""Decode requests left behind when the API and the decode worker die together (issue 14): the
request stays in the decode active list with no lease and no one waiting, and nothing else would
ever remove it. The janitor removes it once no API could still be waiting (twice the decode lease
after it saw it unleased) and never touches a request a live worker holds. Real Redis; the worker
side is the catalog's own claim/heartbeat calls (no model runs)."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient

from service.app import create_app
from test_api import _settings

LEASE = 2  # decode_lease_seconds: the janitor's grace is 2 * LEASE


def _active(cat) -> set[str]:
    return {r.decode() for r in cat.r.lrange(cat.k_decode_active, 0, -1)}


def test_janitor_drops_dead_request_keeps_live_one(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False, decode_lease_seconds=LEASE,
                         janitor_interval_seconds=0.2)
    with TestClient(create_app(settings, lm=lm)) as c:  # only the janitor runs in this process
        cat = c.app.state.runtime.catalog
        cat.submit_decode({"question_ids": [1, 2], "max_tokens": 4})
        cat.submit_decode({"question_ids": [3, 4], "max_tokens": 4})
        dead = cat.claim_decode(0, lease_s=LEASE, worker="w-dead")  # its worker is killed: never renewed
        t_claim = time.monotonic()
        live = cat.claim_decode(0, lease_s=LEASE, worker="w-live")
        stop = threading.Event()

        def renew():  # the live worker's heartbeat thread
            while not stop.wait(LEASE / 3):
                cat.heartbeat_decode([live["rid"]], LEASE, worker="w-live")

        beat = threading.Thread(target=renew, daemon=True)
        beat.start()
        try:
            assert _active(cat) == {dead["_raw"], live["_raw"]}
            gone_at = None
            while time.monotonic() - t_claim < 15:
                if dead["_raw"] not in _active(cat):
                    gone_at = time.monotonic() - t_claim
                    break
                time.sleep(0.1)
            assert gone_at is not None, "the dead request's active entry was never removed"
            # not before its lease expired plus the grace in which a waiting API would have acted
            assert gone_at >= LEASE + 2 * LEASE - 0.5, gone_at
            time.sleep(1.0)  # more sweeps: the live request stays, with its lease
            assert _active(cat) == {live["_raw"]}
            assert cat.r.get(cat.k_decode_lease(live["rid"])) == b"w-live"
            assert cat.queue_depth()["decode_active"] == 1
        finally:
            stop.set()
            beat.join()
        # the live one, once its worker is gone too, is dropped in turn
        cat.r.delete(cat.k_decode_lease(live["rid"]))
        deadline = time.monotonic() + 3 * LEASE + 3
        while _active(cat) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _active(cat) == set()


def test_drop_decode_spares_a_leased_request(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False, decode_lease_seconds=LEASE,
                         janitor_interval_seconds=60)
    with TestClient(create_app(settings, lm=lm)) as c:
        cat = c.app.state.runtime.catalog
        cat.submit_decode({"question_ids": [1], "max_tokens": 1})
        job = cat.claim_decode(0, lease_s=LEASE)
        assert cat.unleased_decode() == []
        assert not cat.drop_decode(job["_raw"])  # leased: kept
        cat.r.delete(cat.k_decode_lease(job["rid"]))
        assert cat.unleased_decode() == [job["_raw"]]
        assert cat.drop_decode(job["_raw"]) and _active(cat) == set()
