"""What the service tests share to run the service for real: the app served by uvicorn on a free
local port in a thread, stopping worker subprocesses, registering a passkey context and waiting
until it is ready."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from conftest import passkey_document


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app, graceful_shutdown_s: float | None = None, start_timeout_s: float = 120.0) -> Iterator[str]:
    """`app` served by uvicorn on a free local port, in a thread; yields the base URL and stops the
    server (and joins its thread) on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=graceful_shutdown_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.time() + start_timeout_s
    while not server.started:
        assert thread.is_alive() and time.time() < end, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """SIGTERM every process still running, then wait for each; SIGKILL one that does not exit."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()


def register_passkey(c, key: int, **kw) -> str:
    """Register a short passkey document through a test client (4 noise repeats) and wait until it
    is ready; returns its id."""
    from test_api import wait_ready

    r = c.post("/v1/contexts", json={"text": passkey_document(key, n_rep=4), **kw})
    assert r.status_code in (200, 202), r.text
    cid = r.json()["id"]
    assert wait_ready(c, cid)["status"] == "ready"
    return cid
