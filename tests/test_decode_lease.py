"""Decode requests are leased like prefill jobs (issue 14, item 4), with the real default model and
a real Redis:

* the only decode worker, busy with one long completion, still counts as live: `/readyz` stays 200
  and a new completion is accepted (queued), not refused with 503 `no_decode_worker`;
* a decode worker killed (kill -9) mid-request: the client gets the answer of a retry on another
  worker, or, with no other worker, a fast 503 `decode_worker_lost` -- never a 504 after the timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import REDIS_URL, passkey_document
from servers import stop_processes
from service.app import create_app
from test_api import _settings
from test_cancellation import LONG, live_server, register

pytestmark = pytest.mark.slow

LEASE = 3  # decode_lease_seconds in these tests: a dead worker is noticed within ~5 s


def test_busy_decode_worker_stays_ready_and_accepts_completions(tmp_path, redis_prefix, lm):
    """The heartbeat is sent from its own thread while the worker decodes; before, a completion
    longer than the 15 s heartbeat TTL made the only worker look dead."""
    settings = _settings(tmp_path, redis_prefix, decode_lease_seconds=LEASE)
    with live_server(create_app(settings, lm=lm)) as (base, app):
        rt = app.state.runtime
        cid = register(base, passkey_document(4242))
        with httpx.Client(base_url=base, timeout=60) as c:
            with c.stream("POST", f"/v1/contexts/{cid}/completions", json={**LONG, "max_tokens": 1000,
                                                                             "stream": True}) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and any(line.startswith("event: token") for line in lines)
                t0, statuses = time.time(), []
                while time.time() - t0 < 17:  # past the old 15 s heartbeat TTL
                    statuses.append(c.get("/readyz").status_code)
                    time.sleep(0.5)
                assert set(statuses) == {200}, statuses
                # a new completion is queued behind the busy worker, not refused (it waits: a read timeout)
                with pytest.raises(httpx.ReadTimeout):
                    c.post(f"/v1/contexts/{cid}/completions", json={"question": "Hi", "max_tokens": 1},
                           timeout=httpx.Timeout(30, read=2.0))
                assert rt.heartbeats.live("decode") == 1


def _worker(kind: str, settings, prefix: str) -> subprocess.Popen:
    env = {**os.environ, "CTXCACHE_KEY_PREFIX": prefix, "CTXCACHE_LOG_LEVEL": "WARNING",
           "CTXCACHE_DECODE_LEASE_SECONDS": str(LEASE), "CTXCACHE_TORCH_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", kind, "--redis-url", REDIS_URL,
                             "--data-dir", str(settings.data_dir)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _worker_id(proc: subprocess.Popen) -> str:
    """The worker id a worker process prints once it runs ("ctxcache decode worker <wid> running")."""
    for line in proc.stdout:
        if " worker " in line and line.rstrip().endswith(")"):
            return line.split(" worker ", 1)[1].split()[0]
    raise AssertionError(f"worker exited with {proc.wait()}")


def _holder(rt, timeout: float = 60.0) -> tuple[str, str]:
    """(request id, worker id) of the decode request being worked on, once it produced a token."""
    end = time.time() + timeout
    while time.time() < end:
        for key in rt.redis.scan_iter(match=rt.queues.decode.k_lease("*"), count=1000):
            rid = key.decode().rsplit(":", 1)[1]
            if rt.redis.xlen(rt.streams.k_out(rid)):
                return rid, rt.redis.get(key).decode()
        time.sleep(0.05)
    raise AssertionError("no decode request got going")


def test_killed_decode_worker_is_retried_once_then_fails_fast(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False, decode_lease_seconds=LEASE,
                         decode_timeout_seconds=60)
    procs = [_worker(kind, settings, redis_prefix) for kind in ("prefill", "decode", "decode")]
    try:
        wids = {_worker_id(p): p for p in procs[1:]}
        with live_server(create_app(settings, lm=lm)) as (base, app):
            rt = app.state.runtime
            cid = register(base, passkey_document(777))
            ask = {**LONG, "max_tokens": 48}
            out: dict = {}

            def post(key):
                t0 = time.perf_counter()
                r = httpx.post(f"{base}/v1/contexts/{cid}/completions", json=ask, timeout=120)
                out[key] = (r, time.perf_counter() - t0)

            # 1. two workers: the one holding the request dies, the other answers it
            t = threading.Thread(target=post, args=("retried",))
            t.start()
            rid, wid = _holder(rt)
            wids.pop(wid).send_signal(signal.SIGKILL)
            t_kill = time.perf_counter()
            t.join(120)
            r, _ = out["retried"]
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"] != rid  # answered under the retry's request id
            assert body["usage"]["completion_tokens"] == 48 and body["finish_reason"] == "length"
            assert time.perf_counter() - t_kill < 40  # lease (3 s) + 48 tokens, not the 60 s timeout

            # 2. the last worker dies too: nobody to retry on, a fast 503 with a stable code
            t = threading.Thread(target=post, args=("lost",))
            t.start()
            _holder(rt)
            next(iter(wids.values())).send_signal(signal.SIGKILL)
            t_kill = time.perf_counter()
            t.join(120)
            r, _ = out["lost"]
            assert r.status_code == 503 and r.json()["error"]["code"] == "decode_worker_lost", r.text
            assert time.perf_counter() - t_kill < 15
            assert rt.queues.depth()["decode"] == 0 and rt.queues.depth()["decode_active"] == 0  # nothing left behind
    finally:
        stop_processes(procs, timeout_s=30)
