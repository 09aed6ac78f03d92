"""The `ctxcache` CLI against a live HTTP server (uvicorn in a thread, real Redis)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import PASSKEY_QUESTION, passkey_document
from servers import live_server
from service.app import create_app
from service.cli import app as cli
from test_api import _settings

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path, redis_prefix, lm):
    with live_server(create_app(_settings(tmp_path, redis_prefix), lm=lm)) as base:
        yield base


def test_register_list_ask_delete(server, tmp_path):
    run = CliRunner().invoke
    doc = tmp_path / "doc.txt"
    doc.write_text(passkey_document(61803))
    res = run(cli, ["register", str(doc), "--url", server])
    assert res.exit_code == 0, res.output
    cid = res.stdout.strip().splitlines()[-1]
    assert len(cid) == 64

    res = run(cli, ["list", "--url", server])
    assert res.exit_code == 0 and cid in res.stdout and "ready" in res.stdout and "doc.txt" in res.stdout

    res = run(cli, ["ask", cid, PASSKEY_QUESTION, "--method", "topk", "-p", "k=64", "--max-tokens", "12", "--url", server])
    assert res.exit_code == 0, res.output
    assert "61803" in res.stdout

    res = run(cli, ["ask", cid, PASSKEY_QUESTION, "--method", "nope", "--url", server])
    assert res.exit_code == 1 and "unknown_method" in res.output

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe not utf-8")
    res = run(cli, ["register", str(bad), "--url", server])
    assert res.exit_code == 1 and "UTF-8" in res.output

    assert run(cli, ["delete", cid, "--url", server]).exit_code == 0
    res = run(cli, ["status", cid, "--url", server])
    assert res.exit_code == 1 and "not_found" in res.output
