"""Metrics from every process: a prefill and a decode worker as separate processes, each serving
Prometheus metrics on its `--metrics-port`, next to the API's `/metrics` (real Redis, isolated
key prefix). Every name a scrape shows is in docs/operations.md's metrics table, and every name there shows."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import PASSKEY_QUESTION, REDIS_URL, ROOT, passkey_document
from servers import stop_processes
from service.app import create_app
from test_api import _settings, ask, wait_ready

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(text: str) -> tuple[dict[tuple[str, frozenset], float], set[str]]:
    """(sample name, labels) -> value, and the ctxcache metric names as queried (`_total` on counters)."""
    values, names = {}, set()
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("ctxcache_") and not fam.name.endswith("_created"):  # client's creation stamps
            names.add(fam.name + "_total" if fam.type == "counter" else fam.name)
        for s in fam.samples:
            values[s.name, frozenset(s.labels.items())] = s.value
    return values, names


def _value(values: dict, name: str, **labels) -> float | None:
    return values.get((name, frozenset(labels.items())))


def _scrape(port: int, procs, timeout: float = 60.0) -> str:
    """A worker's metrics page (its server starts before the worker takes jobs)."""
    end = time.time() + timeout
    while True:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.TransportError:
            assert all(p.poll() is None for p in procs), [p.stdout.read().decode()[-2000:] for p in procs]
            assert time.time() < end, "worker metrics endpoint never answered"
            time.sleep(0.3)


def _documented() -> set[str]:
    """The metric names in docs/operations.md's table under "### Metrics"."""
    readme = (ROOT / "docs" / "operations.md").read_text()
    section = readme.split("### Metrics", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `(ctxcache_[a-z_]+)`", section, flags=re.M))


def test_worker_processes_export_metrics(tmp_path, redis_prefix, lm):
    settings = _settings(tmp_path, redis_prefix, run_workers=False)
    env = {**os.environ, "CTXCACHE_KEY_PREFIX": redis_prefix, "CTXCACHE_LOG_LEVEL": "WARNING"}
    common = ["--redis-url", REDIS_URL, "--data-dir", str(settings.data_dir)]
    ports = {"prefill": _free_port(), "decode": _free_port()}
    procs = []
    try:
        with TestClient(create_app(settings, lm=lm)) as c:
            cid = c.post("/v1/contexts", json={"text": passkey_document(14142, n_rep=6)}).json()["id"]
            # no worker yet: the API shows the queued build
            api, _ = _samples(c.get("/metrics").text)
            assert _value(api, "ctxcache_queue_depth", kind="prefill", state="queued") == 1.0

            procs = [subprocess.Popen([sys.executable, "-m", "service.cli", "worker", kind, *common,
                                       "--metrics-port", str(ports[kind])],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                     for kind in ("prefill", "decode")]
            first = _samples(_scrape(ports["prefill"], procs))[0]
            assert _value(first, "ctxcache_jobs_total", kind="prefill", outcome="failed") == 0.0  # present from the start
            assert wait_ready(c, cid, timeout=120)["status"] == "ready"
            before = _value(_samples(c.get("/metrics").text)[0], "ctxcache_completions_total", method="topk",
                            outcome="ok") or 0.0  # the API's registry is this test process's: other tests count too
            out = ask(c, cid, "topk", {"k": 64}, max_tokens=8, question=PASSKEY_QUESTION)
            n_out, kv_fraction = out["usage"]["completion_tokens"], out["stats"]["kv_fraction"]

            pre, pre_names = _samples(_scrape(ports["prefill"], procs))
            dec, dec_names = _samples(_scrape(ports["decode"], procs))
            api, api_names = _samples(c.get("/metrics").text)
    finally:
        stop_processes(procs)

    # the prefill worker: its job done, the queue drained
    assert _value(pre, "ctxcache_jobs_total", kind="prefill", outcome="done") == 1.0
    assert _value(pre, "ctxcache_queue_depth", kind="prefill", state="queued") == 0.0
    assert _value(pre, "ctxcache_queue_depth", kind="decode", state="queued") == 0.0

    # the decode worker: the completion, its tokens, speed and selectivity, its own tiers
    assert _value(dec, "ctxcache_jobs_total", kind="decode", outcome="done") == 1.0
    assert _value(dec, "ctxcache_decode_tokens_total", method="topk") == n_out
    assert _value(dec, "ctxcache_decode_selectivity_ratio_count", method="topk") == 1.0
    assert _value(dec, "ctxcache_decode_selectivity_ratio_sum", method="topk") == pytest.approx(kv_fraction)
    assert 0 < kv_fraction < 1
    assert _value(dec, "ctxcache_decode_tokens_per_second_count", method="topk") == 1.0
    assert _value(dec, "ctxcache_decode_tokens_per_second_sum", method="topk") == pytest.approx(
        out["stats"]["decode_tokens_per_s"])
    tier = [(lbl, v) for (name, lbl), v in dec.items() if name == "ctxcache_tier_bytes"]
    assert len(tier) == 1 and dict(tier[0][0])["tier"] == "dram" and tier[0][1] > 0
    wid = dict(tier[0][0])["worker"]
    assert _value(dec, "ctxcache_tier_misses_total", worker=wid, tier="dram") > 0
    # the API: its completion counted, and the decode worker's tiers as its heartbeat published them
    assert _value(api, "ctxcache_completions_total", method="topk", outcome="ok") == before + 1
    assert _value(api, "ctxcache_tier_bytes", worker=wid, tier="dram") == tier[0][1]

    # Grafana-ready and documented: every name shown is in docs/operations.md's table, and every name there shows
    documented, shown = _documented(), pre_names | dec_names | api_names
    assert shown - documented == set(), f"undocumented metrics: {shown - documented}"
    assert documented - shown == set(), f"documented but never exported: {documented - shown}"
