"""Rate limits per API key (issue 14, item 5): over its limit a key gets 429 `rate_limited` with
`Retry-After`, and the refused request changes nothing; other keys keep their own budget; the
window moves on; without keys the client address is counted; two API processes share one count
(Redis). No worker runs here: a registration only queues its build, which is what is counted."""

from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.ratelimit import LIMITED
from test_api import _settings

KEYS = ["rl-first-0123456789", "rl-second-abcdefghij"]
WINDOW = 2  # seconds: the limits below are "3 per 2 seconds" / "1 per 2 seconds"


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _app(tmp_path, prefix, lm, **kw):
    base = dict(run_workers=False, rate_limit=f"3 per {WINDOW} seconds", rate_limit_expensive=f"1 per {WINDOW} seconds")
    return create_app(_settings(tmp_path, prefix, **{**base, **kw}), lm=lm)


@pytest.fixture
def keyed(tmp_path, redis_prefix, lm):
    with TestClient(_app(tmp_path, redis_prefix, lm, api_keys=KEYS)) as c:
        yield c


def _register(c, i: int, key: str | None = KEYS[0]):
    return c.post("/v1/contexts", json={"text": f"document number {i} for the rate limit test"},
                  headers=_bearer(key) if key else {})


def _queued(c) -> tuple[int, int]:
    """(contexts in the catalog, prefill jobs queued)."""
    rt = c.app.state.runtime
    return rt.catalog.r.zcard(rt.catalog.k_contexts), rt.queues.depth()["prefill"]


def _assert_limited(r, openai: bool = False) -> int:
    assert r.status_code == 429, r.text
    retry = int(r.headers["retry-after"])
    assert 1 <= retry <= WINDOW
    assert r.json()["error"]["code"] == "rate_limited"
    if openai:
        assert r.json()["error"]["type"] == "invalid_request_error"
    return retry


def test_over_the_limit_429_changes_nothing_other_key_unaffected_window_moves(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    t0 = time.monotonic()
    for i in range(3):
        assert _register(keyed, i).status_code == 202
    assert _queued(keyed) == (3, 3)
    retry = _assert_limited(_register(keyed, 99))
    assert _queued(keyed) == (3, 3)  # the refused registration neither recorded nor queued anything
    assert _register(keyed, 4, KEYS[1]).status_code == 202  # the other key has its own budget
    assert _queued(keyed) == (4, 4)
    # reads are not limited
    assert keyed.get("/v1/contexts", headers=_bearer(KEYS[0])).status_code == 200
    # once the window has moved past the first requests, the key may register again
    time.sleep(max(0.0, WINDOW + 0.5 - (time.monotonic() - t0)))
    assert retry <= WINDOW and _register(keyed, 5).status_code == 202
    assert _queued(keyed) == (5, 5)
    assert not any(k in caplog.text for k in KEYS)  # keys are logged by a sha256 prefix only
    assert "rate limited: key:" in caplog.text


def test_completions_and_openai_routes_share_the_standard_limit_per_route(keyed):
    """Each limited route has its own budget under one limit; OpenAI's routes answer in OpenAI's
    shape. A refused completion never reaches the route (no 404 for the unknown context)."""
    cid = "ab" * 32
    for _ in range(3):
        assert keyed.post(f"/v1/contexts/{cid}/completions", json={"question": "hi"},
                          headers=_bearer(KEYS[0])).status_code == 404
    _assert_limited(keyed.post(f"/v1/contexts/{cid}/completions", json={"question": "hi"}, headers=_bearer(KEYS[0])))
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "context_id": cid}
    for _ in range(3):
        assert keyed.post("/v1/chat/completions", json=body, headers=_bearer(KEYS[0])).status_code != 429
    _assert_limited(keyed.post("/v1/chat/completions", json=body, headers=_bearer(KEYS[0])), openai=True)


def test_expensive_routes_have_the_lower_limit(keyed):
    train = keyed.app.state.runtime.queues.train
    assert keyed.post("/v1/admin/rebuild-catalog", headers=_bearer(KEYS[0])).status_code == 200
    _assert_limited(keyed.post("/v1/admin/rebuild-catalog", headers=_bearer(KEYS[0])))
    assert keyed.post("/v1/admin/rebuild-catalog", headers=_bearer(KEYS[1])).status_code == 200
    r = keyed.post("/v1/methods/saap/train", json={}, headers=_bearer(KEYS[0]))
    assert r.status_code != 429, r.text  # its own budget: not the admin route's
    _assert_limited(keyed.post("/v1/methods/saap/train", json={}, headers=_bearer(KEYS[0])))
    assert train.r.llen(train.k_queue) <= 1


def test_without_keys_the_client_address_is_counted(tmp_path, redis_prefix, lm):
    with TestClient(_app(tmp_path, redis_prefix, lm)) as c:
        for i in range(3):
            assert _register(c, i, key=None).status_code == 202
        _assert_limited(_register(c, 3, key=None))
        # a bearer header does not buy a new budget when the service has no keys
        _assert_limited(_register(c, 4, key="anything"))
    with TestClient(_app(tmp_path, redis_prefix, lm), client=("10.0.0.2", 5000)) as other:
        assert _register(other, 5, key=None).status_code == 202  # another address


def test_two_api_processes_share_one_count(tmp_path, redis_prefix, lm):
    with TestClient(_app(tmp_path, redis_prefix, lm, api_keys=KEYS)) as a, \
         TestClient(_app(tmp_path, redis_prefix, lm, api_keys=KEYS)) as b:
        assert _register(a, 0).status_code == 202
        assert _register(b, 1).status_code == 202
        assert _register(a, 2).status_code == 202
        _assert_limited(_register(b, 3))


def test_openapi_documents_429_on_limited_routes_only(keyed):
    schema = keyed.get("/openapi.json").json()
    limited = {(m.lower(), t) for m, t in LIMITED}
    for path, item in schema["paths"].items():
        for verb, op in item.items():
            if (verb, path) in limited:
                assert "Retry-After" in op["responses"]["429"]["headers"], (verb, path)
            else:
                assert "429" not in op["responses"], (verb, path)
    # every route of the table exists (a renamed route would silently lose its limit)
    assert limited <= {(v, p) for p, item in schema["paths"].items() for v in item}


def test_limits_off_by_default(tmp_path, redis_prefix, lm):
    with TestClient(create_app(_settings(tmp_path, redis_prefix, run_workers=False), lm=lm)) as c:
        for i in range(8):
            assert _register(c, i, key=None).status_code == 202
        assert "429" not in c.get("/openapi.json").json()["paths"]["/v1/contexts"]["post"]["responses"]
