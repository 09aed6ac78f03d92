"""API keys (issue 15, item 2): with `api_keys` set, every route but /healthz and the docs needs
`Authorization: Bearer <key>` (401 `unauthorized`, OpenAI's shape on the OpenAI routes); any of
the keys works; keys never reach the logs; without keys everything is open. No decode worker runs
here: the guard answers before any route does."""

from __future__ import annotations

import logging
import re

import openai
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.cli import _client
from service.settings import Settings
from test_api import _settings

KEYS = ["k-first-0123456789", "k-second-abcdefghij"]
OPEN = {"/healthz", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"}


@pytest.fixture
def keyed(tmp_path, redis_prefix, lm):
    with TestClient(create_app(_settings(tmp_path, redis_prefix, run_workers=False, api_keys=KEYS), lm=lm)) as c:
        yield c


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_keys_required_on_protected_routes(keyed, caplog):
    caplog.set_level(logging.DEBUG)
    for headers in ({}, _bearer("wrong"), _bearer(KEYS[0] + "x"), {"Authorization": KEYS[0]},
                    {"Authorization": f"Basic {KEYS[0]}"}):
        r = keyed.get("/v1/contexts", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "unauthorized" and r.headers["www-authenticate"].startswith("Bearer")
    for key in KEYS:  # any of the keys
        assert keyed.get("/v1/contexts", headers=_bearer(key)).status_code == 200
    assert keyed.get("/v1/contexts", headers={"authorization": f"bearer {KEYS[1]}"}).status_code == 200
    assert keyed.get("/healthz").status_code == 200
    assert keyed.get("/openapi.json").status_code == 200
    for path in ("/readyz", "/metrics", "/v1/methods", "/no/such/path"):
        assert keyed.get(path).status_code == 401, path
    # a POST without a key is refused before its body is looked at
    assert keyed.post("/v1/contexts", content=b"\xff not json").status_code == 401
    assert not any(k in caplog.text for k in KEYS)


def test_every_route_is_guarded(keyed):
    """Each operation of the OpenAPI document, called without a key, answers 401 unless it is open:
    a route added later cannot be left unprotected."""
    schema = keyed.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    checked = 0
    for path, item in schema["paths"].items():
        for verb, op in item.items():
            concrete = re.sub(r"\{[^}]+\}", "x", path)
            r = keyed.request(verb.upper(), concrete)
            if path in OPEN:
                assert r.status_code != 401 and op["security"] == [], path
            else:
                assert r.status_code == 401, (verb, path, r.status_code)
                assert op["security"] == [{"apiKey": []}], path
                checked += 1
    assert checked >= 15


def test_openai_routes_answer_401_in_openai_shape(keyed):
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "context_id": "ab" * 32}
    r = keyed.post("/v1/chat/completions", json=body)
    assert r.status_code == 401
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "authentication_error",
                                  "param": None, "code": "unauthorized"}}
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=keyed, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.code == "unauthorized"
    good = openai.OpenAI(base_url="http://testserver/v1", api_key=KEYS[1], http_client=keyed, max_retries=0)
    assert [m.id for m in good.models.list()] == ["smollm2-135m"]


def test_without_keys_everything_is_open(tmp_path, redis_prefix, lm):
    with TestClient(create_app(_settings(tmp_path, redis_prefix, run_workers=False), lm=lm)) as c:
        for path in ("/v1/contexts", "/readyz", "/metrics", "/v1/models", "/healthz"):
            assert c.get(path).status_code != 401, path
        assert "securitySchemes" not in c.get("/openapi.json").json().get("components", {})


def test_keys_from_the_environment_are_secret(monkeypatch):
    monkeypatch.setenv("CTXCACHE_API_KEYS", f" {KEYS[0]}, {KEYS[1]} ,")
    s = Settings()
    assert [k.get_secret_value() for k in s.api_keys] == KEYS
    assert not any(k in repr(s) or k in str(s.model_dump()) for k in KEYS)
    monkeypatch.setenv("CTXCACHE_API_KEYS", " , ")
    assert Settings().api_keys is None


def test_cli_sends_the_key(monkeypatch):
    monkeypatch.setenv("CTXCACHE_API_KEY", KEYS[0])
    with _client("http://127.0.0.1:1") as c:
        assert c.headers["authorization"] == f"Bearer {KEYS[0]}"
    monkeypatch.delenv("CTXCACHE_API_KEY")
    with _client("http://127.0.0.1:1") as c:
        assert "authorization" not in c.headers
