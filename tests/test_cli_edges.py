"""The CLI's rough edges: an unreachable service, context-id prefixes, `-p` field errors, `train saap`
without `--preset` on a CPU; and the API docs served without a CDN. A live HTTP server (uvicorn in
a thread, real Redis) with no workers: nothing here needs a prefill."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import pytest
import redis
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import REDIS_URL, ROOT, passkey_document
from servers import free_port, live_server
from service.app import create_app
from service.cli import app as cli
from storage.catalog import Catalog
from storage.keys import PromptHash
from test_api import _settings

run = CliRunner().invoke


@pytest.fixture
def server(tmp_path, redis_prefix, lm):
    with live_server(create_app(_settings(tmp_path, redis_prefix, run_workers=False), lm=lm)) as base:
        yield base, Catalog(redis.Redis.from_url(REDIS_URL), redis_prefix)


def _register(url: str, tmp_path, key: int) -> str:
    doc = tmp_path / f"doc{key}.txt"
    doc.write_text(passkey_document(key, n_rep=2))
    res = run(cli, ["register", str(doc), "--no-wait", "--url", url])
    assert res.exit_code == 0, res.output
    return res.stdout.strip().splitlines()[-1]


def test_unreachable_server_is_one_line_without_traceback():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # a real process: what a user sees on the terminal (CliRunner would swallow a traceback)
    for args in (["list"], ["status", "a" * 64], ["ask", "a" * 64, "hi"]):
        p = subprocess.run([sys.executable, "-m", "service.cli", *args, "--url", url], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        assert p.returncode == 1, out
        assert "Traceback" not in out and "httpx" not in out, out
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) == 1 and "cannot reach the ctxcache service at " + url in lines[0], out


def test_context_id_prefix(server, tmp_path):
    url, cat = server
    cid = _register(url, tmp_path, 11111)
    other = _register(url, tmp_path, 22222)

    res = run(cli, ["status", cid[:8], "--url", url])  # a unique prefix names the context
    assert res.exit_code == 0, res.output
    assert f'"id": "{cid}"' in res.stdout

    # a second context sharing the first 8 hex digits: that prefix is now ambiguous, a longer one is not
    twin = cid[:8] + hashlib.sha256(b"twin").hexdigest()[:56]
    assert twin[8:12] != cid[8:12]
    rec = cat.get(PromptHash(cid))
    cat.register(PromptHash(twin), {k: rec[k] for k in ("model", "slug", "n_tokens", "prompt_format", "display_name") if k in rec},
                 [1, 2, 3], {}, None)
    res = run(cli, ["status", cid[:8], "--url", url])
    assert res.exit_code == 2 and "ambiguous" in res.output and cid in res.output and twin in res.output, res.output
    res = run(cli, ["status", cid[:12], "--url", url])
    assert res.exit_code == 0 and f'"id": "{cid}"' in res.stdout, res.output

    # too short, not hex, or no match: clear errors, nothing sent as a path
    for bad in (cid[:5], "zzzzzzzz"):
        res = run(cli, ["status", bad, "--url", url])
        assert res.exit_code == 2 and "unique prefix of at least 6" in res.output, res.output
    absent = next(p for p in ("000000", "ffffff", "123456") if not any(x.startswith(p) for x in (cid, other, twin)))
    res = run(cli, ["status", absent, "--url", url])
    assert res.exit_code == 1 and f"no context id starts with {absent}" in res.output, res.output

    res = run(cli, ["delete", other[:10], "--url", url])  # delete (and ask) take prefixes too
    assert res.exit_code == 0 and f"deleted {other}" in res.output, res.output
    assert cat.get(PromptHash(other)) is None and cat.get(PromptHash(cid)) is not None


def test_bad_param_prints_pydantic_field_errors(server, tmp_path):
    url, cat = server
    cid = _register(url, tmp_path, 33333)
    cat.update(PromptHash(cid), status="ready")  # parameters are checked before anything reads the context's artifacts
    res = run(cli, ["ask", cid[:8], "q", "-m", "topk", "-p", "k=-5", "--url", url])
    assert res.exit_code == 1, res.output
    assert "error 422 invalid_parameter" in res.output
    assert re.search(r"params\.k: Input should be greater than", res.output), res.output  # pydantic's own message
    res = run(cli, ["ask", cid, "q", "-p", "novalue", "--url", url])
    assert res.exit_code == 2 and "KEY=VALUE" in res.output, res.output


def test_train_saap_without_preset_refuses_on_cpu(tmp_path):
    data = _settings(tmp_path).data_dir  # the converted test model, linked
    res = run(cli, ["train", "saap", "--device", "cpu", "--data-dir", str(data), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "refused" in res.output and "--preset small" in res.output and "h (over train_budget_seconds" in res.output
    assert not (tmp_path / "out").exists()  # nothing started


def test_docs_are_served_without_a_cdn(tmp_path):
    from service.settings import Settings

    # with API keys set: the pages and every asset they load stay open, as the docs always were
    app = create_app(Settings(data_dir=tmp_path / "data", api_keys="k1"), lm=object())
    c = TestClient(app)  # no lifespan: the docs need no runtime
    for page in ("/docs", "/redoc"):
        r = c.get(page)
        assert r.status_code == 200
        assert not re.search(r"https?://", r.text), f"{page} loads something from another host"
        assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
        assert assets and all(a.startswith("/docs-assets/") for a in assets), assets
        for a in assets:
            got = c.get(a)
            assert got.status_code == 200 and len(got.content) > 1000, a
    assert c.get("/openapi.json").status_code == 200
    assert c.get("/metrics").status_code == 401  # the rest still needs a key
