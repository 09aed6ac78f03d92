"""Distributed mode: the API, a prefill worker and a decode worker as separate processes sharing
Redis (real, 127.0.0.1:6379, isolated key prefix) and the data directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from conftest import PASSKEY_QUESTION, REDIS_URL, passkey_document
from servers import stop_processes
from service.app import create_app
from test_api import _settings, ask, wait_ready

pytestmark = pytest.mark.slow


def test_api_and_workers_in_separate_processes(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False)
    env = {**os.environ, "CTXCACHE_KEY_PREFIX": redis_prefix, "CTXCACHE_LOG_LEVEL": "WARNING"}
    exe = [sys.executable, "-m", "service.cli", "worker"]
    common = ["--redis-url", REDIS_URL, "--data-dir", str(settings.data_dir)]
    procs = [subprocess.Popen(exe + [kind, *common], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for kind in ("prefill", "decode")]
    try:
        with TestClient(create_app(settings, lm=lm)) as c:
            end = time.time() + 120
            while c.get("/readyz").status_code != 200 and time.time() < end:
                assert all(p.poll() is None for p in procs), [p.stdout.read().decode()[-2000:] for p in procs]
                time.sleep(0.3)
            workers = c.get("/readyz").json()["checks"]["workers"]
            assert workers["prefill"] == 1 and workers["decode"] == 1
            assert c.app.state.workers and all(w.kind == "janitor" for w in c.app.state.workers)  # no workers in the API
            cid = c.post("/v1/contexts", json={"text": passkey_document(27182)}).json()["id"]
            assert wait_ready(c, cid)["status"] == "ready"
            out = ask(c, cid, "topk", {"k": 64}, max_tokens=12, question=PASSKEY_QUESTION)
            assert "27182" in out["text"]
    finally:
        stop_processes(procs)
    assert all(p.returncode == 0 for p in procs), [p.stdout.read().decode()[-2000:] for p in procs]
