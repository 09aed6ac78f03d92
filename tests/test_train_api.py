"""SAAP training over REST (`/v1/methods/saap/train`) and the data dir reaching the method: a job
trains into the service's data dir, registrations find the model there, a retrained model makes
old indexes answer 409 instead of reading them with the wrong classifier."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from conftest import PASSKEY_QUESTION, passkey_document
from indexer.base import MethodEnv, get_method
from indexer.saap_model import default_model_dir
from test_api import client, wait_ready  # noqa: F401 - `client` is a fixture (a service on real Redis)

pytestmark = pytest.mark.slow

# Tiny: 2 layers, 2 windows of 256 tokens, 20 steps (~10-20 s here); the rest runs full attention.
TINY = {"preset": "small", "layers": [1, 2], "docs": 2, "doc_tokens": 256, "steps": 20}


def wait_job(c: TestClient, jid: str, timeout: float = 300.0) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        job = c.get(f"/v1/methods/saap/train/{jid}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"training job {jid} not finished after {timeout}s: {job}")


def _code(r) -> str:
    return r.json()["error"]["code"]


def test_method_env_decides_where_saap_looks(lm, tmp_path, monkeypatch):
    """The caller's data dir (the service's --data-dir), not the process environment, locates the model."""
    m = get_method("saap")
    monkeypatch.setenv("CTXCACHE_DATA_DIR", str(tmp_path / "from-env"))
    (reason,) = m.validate_configuration(lm.spec, m.Params(), MethodEnv(tmp_path / "mine"))
    assert str(default_model_dir(lm.spec.fingerprint, tmp_path / "mine")) in reason
    assert "POST /v1/methods/saap/train" in reason
    (reason,) = m.validate_configuration(lm.spec, m.Params())  # no env: the service's default location
    assert str(tmp_path / "from-env" / "saap") in reason


def test_bad_training_requests_are_4xx_and_queue_nothing(client):
    cases = [
        ({}, 422, "validation_error"),  # preset is required: the default (full) would be a ~385 h CPU job here
        ({"preset": "medium"}, 422, "validation_error"),
        ({"preset": "small", "steps": 0}, 422, "invalid_parameter"),
        ({"preset": "small", "clusters": 1}, 422, "invalid_parameter"),
        ({"preset": "small", "layers": [0, 1]}, 422, "invalid_parameter"),
        ({"preset": "small", "layers": [30]}, 422, "invalid_parameter"),
        ({"preset": "small", "corpus": "../etc"}, 422, "validation_error"),
        ({"preset": "small", "corpus": "missing"}, 422, "unknown_corpus"),
        ({"preset": "small", "surprise": 1}, 422, "validation_error"),
    ]
    for body, status, code in cases:
        r = client.post("/v1/methods/saap/train", json=body)
        assert (r.status_code, _code(r)) == (status, code), (body, r.text)
    r = client.post("/v1/methods/topk/train", json={"preset": "small"})
    assert (r.status_code, _code(r)) == (422, "not_trainable")
    r = client.post("/v1/methods/nope/train", json={"preset": "small"})
    assert (r.status_code, _code(r)) == (404, "not_found")
    r = client.get("/v1/methods/saap/train/" + "0" * 64)
    assert (r.status_code, _code(r)) == (404, "not_found")
    assert client.get("/v1/methods/saap/train").json() == []
    assert client.app.state.runtime.queues.depth()["train"] == 0


def test_model_dir_from_a_request_stays_under_the_data_dir(client, tmp_path):
    """`model_dir` is a build parameter API clients send: the service refuses a path outside its
    data dir (422, nothing registered), also through `..` or a symlink, and reads a relative one
    from the data dir. Library callers (no confined env) may point anywhere."""
    from indexer.base import MethodEnv

    data = client.app.state.runtime.settings.data_dir
    (data / "escape").symlink_to(tmp_path)
    doc = passkey_document(11111)
    for bad in ("/etc", "../outside", "escape/saap", str(tmp_path)):
        r = client.post("/v1/contexts", json={"text": doc, "methods": ["saap"], "params": {"saap": {"model_dir": bad}}})
        assert (r.status_code, _code(r)) == (422, "unsupported_configuration"), (bad, r.text)
        assert "outside the service's data directory" in r.json()["error"]["message"], bad
    r = client.post("/v1/contexts", json={"text": doc, "methods": ["saap"], "params": {"saap": {"model_dir": "saap/x"}}})
    assert (r.status_code, _code(r)) == (422, "unsupported_configuration")  # inside, but nothing trained there
    msg = r.json()["error"]["message"]  # the path relative to the data dir, never the server's absolute path
    assert "<data_dir>/saap/x" in msg and str(data.resolve()) not in msg
    assert client.get("/v1/contexts").json()["total"] == 0

    env = MethodEnv(data, confined=True)
    assert env.resolve("saap/m") == data.resolve() / "saap" / "m"
    assert env.resolve(str(data / "saap" / "m")) == data.resolve() / "saap" / "m"
    assert MethodEnv(data).resolve("/etc") == Path("/etc")  # not confined: the caller's choice


def test_train_over_rest_then_register_and_ask(client, lm):
    rt = client.app.state.runtime
    model_dir = default_model_dir(lm.spec.fingerprint, rt.settings.data_dir)
    doc = passkey_document(52817, depth=0.5)

    # before training, a saap registration is refused and says how to train (REST included)
    r = client.post("/v1/contexts", json={"text": doc, "methods": ["saap"]})
    assert (r.status_code, _code(r)) == (422, "unsupported_configuration")
    assert "POST /v1/methods/saap/train" in r.json()["error"]["message"]

    r = client.post("/v1/methods/saap/train", json=TINY)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["created"] is True and job["status"] in ("queued", "running") and job["layers_total"] == 2
    again = client.post("/v1/methods/saap/train", json=TINY)  # the same request is the same job
    assert again.status_code == 200 and again.json()["id"] == job["id"] and again.json()["created"] is False
    other = client.post("/v1/methods/saap/train", json={**TINY, "seed": 7})  # one job per model at a time
    assert (other.status_code, _code(other)) == (409, "training_in_progress")
    assert other.json()["error"]["details"]["job_id"] == job["id"]

    done = wait_job(client, job["id"])
    assert done["status"] == "done", done
    assert done["progress"] == 1.0 and done["layers_done"] == 2 and done["attempts"] == 1
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert done["digest"] == manifest["digest"] and done["model_dir"] == str(model_dir)
    assert sorted(manifest["layers"]) == ["1", "2"] and manifest["settings"]["steps"] == 20
    assert [j["id"] for j in client.get("/v1/methods/saap/train").json()] == [job["id"]]

    r = client.post("/v1/methods/saap/train", json=TINY)  # done and its model in place: nothing to do
    assert r.status_code == 200 and r.json()["status"] == "done" and r.json()["created"] is False
    r = client.post("/v1/methods/saap/train", json={**TINY, "seed": 7})  # would replace a model in use
    assert (r.status_code, _code(r)) == (409, "model_exists")
    assert json.loads((model_dir / "manifest.json").read_text())["digest"] == manifest["digest"]  # unchanged

    # the service's data dir reaches the method: register (validate + build) and ask (open)
    cid = client.post("/v1/contexts", json={"text": doc, "methods": ["saap"]}).json()["id"]
    rec = wait_ready(client, cid)
    assert rec["status"] == "ready", rec
    r = client.post(f"/v1/contexts/{cid}/completions",
                    json={"question": PASSKEY_QUESTION, "method": "saap", "params": {"nprobe": 2}, "max_tokens": 4})
    assert r.status_code == 200, r.text
    stats = r.json()["stats"]
    assert stats["method"] == "saap" and stats["kv_fraction"] < 1.0
    sel = stats["method_stats"]["selectivity_per_step"]  # SAAP's own metric, one value per decode step
    assert len(sel) == stats["steps"] and all(0 < x < 1 for x in sel), stats["method_stats"]

    # retrain (replace) with a custom corpus from <data_dir>/corpora/<name>
    corpus = rt.settings.data_dir / "corpora" / "mine"
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text(passkey_document(11111, n_rep=30))
    r = client.post("/v1/methods/saap/train", json={**TINY, "layers": [1], "corpus": "mine", "replace": True})
    assert r.status_code == 202, r.text
    second = wait_job(client, r.json()["id"])
    assert second["status"] == "done" and second["corpus"] == "mine", second
    manifest2 = json.loads((model_dir / "manifest.json").read_text())
    assert manifest2["digest"] == second["digest"] != manifest["digest"]
    assert manifest2["corpus"]["path"] == str(corpus.resolve())

    # the old index was built with the old model (its digest is part of the index id): never read
    # with the new classifier; registering again builds an index with the new one
    ask = {"question": PASSKEY_QUESTION, "method": "saap", "params": {"nprobe": 2}, "max_tokens": 4}
    r = client.post(f"/v1/contexts/{cid}/completions", json=ask)
    assert (r.status_code, _code(r)) == (409, "method_not_built"), r.text
    assert "current trained model" in r.json()["error"]["message"]
    full = client.post(f"/v1/contexts/{cid}/completions", json={"question": PASSKEY_QUESTION, "max_tokens": 4})
    assert full.status_code == 200  # the context itself is intact
    old_id = rec["methods"]["saap"]["index_id"]
    again = client.post("/v1/contexts", json={"text": doc, "methods": ["saap"]})
    assert again.status_code in (200, 202) and again.json()["id"] == cid
    rec2 = wait_ready(client, cid)
    assert rec2["status"] == "ready" and rec2["methods"]["saap"]["index_id"] != old_id, rec2
    r = client.post(f"/v1/contexts/{cid}/completions", json=ask)
    assert r.status_code == 200, r.text

    # the safety net behind the id check (a model replaced between the index's build and a request):
    # `open` compares the digest the index recorded with the trained model's, 409 method_unavailable
    from evaluation.fidelity import build_index
    from decoder.prefill import prefill
    from indexer.base import DecodeContext, MethodUnavailable

    saap, params = get_method("saap"), get_method("saap").Params()
    cap = prefill(lm, lm.context_ids(doc))
    index = build_index(saap, params, cap, rt.method_env)
    ctx = DecodeContext(cap.n_tokens, lm.spec, 16, rt.method_env)
    saap.open(index, params, ctx)  # the model it was built with: opens
    ident = index.layer("model_id", 0).clone()
    ident[40] ^= 1  # another trained model's digest
    stale = type(index)(lambda name, layer: ident if name == "model_id" else index.layer(name, layer), index.names)
    with pytest.raises(MethodUnavailable, match="register it again"):
        saap.open(stale, params, ctx)


def test_train_worker_trains_on_its_own_copy_of_the_model(client, monkeypatch):
    """The corpus capture runs the model truncated to its first layers by changing its config
    (`training.capture.first_layers`): the train worker must never do that to the model object the
    prefill and decode workers share, or a concurrent completion would silently skip layers."""
    from training import capture, loop

    served = client.app.state.runtime.ensure_weights().model
    n_layers = served.config.num_hidden_layers
    seen, depth = [], []
    orig_train, orig_first = loop.train_saap, capture.first_layers

    def spy_train(lm, *a, **kw):
        seen.append(lm.model)
        return orig_train(lm, *a, **kw)

    @contextlib.contextmanager
    def spy_first(model, n):
        with orig_first(model, n):
            depth.append(served.config.num_hidden_layers)  # the served model, while training truncates its own
            yield

    monkeypatch.setattr(loop, "train_saap", spy_train)
    monkeypatch.setattr(capture, "first_layers", spy_first)
    r = client.post("/v1/methods/saap/train", json={**TINY, "layers": [1], "steps": 5})
    assert r.status_code == 202, r.text
    assert wait_job(client, r.json()["id"])["status"] == "done"
    assert seen and all(m is not served for m in seen)
    assert depth and set(depth) == {n_layers}  # never truncated, also not during the capture


def test_cancel_a_queued_job_frees_the_slot_and_it_can_be_posted_again(tmp_path, redis_prefix, lm):
    from test_api import _settings

    from service.app import create_app

    with TestClient(create_app(_settings(tmp_path, redis_prefix, run_workers=False), lm=lm)) as c:  # nobody trains
        job = c.post("/v1/methods/saap/train", json=TINY).json()
        assert job["status"] == "queued"
        r = c.delete(f"/v1/methods/saap/train/{job['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["phase"] == "cancelled"
        assert c.app.state.runtime.queues.depth()["train"] == 0
        assert c.delete(f"/v1/methods/saap/train/{job['id']}").json()["status"] == "cancelled"  # idempotent
        other = c.post("/v1/methods/saap/train", json={**TINY, "seed": 7})  # the model's slot is free again
        assert other.status_code == 202, other.text
        assert c.delete(f"/v1/methods/saap/train/{other.json()['id']}").status_code == 200
        again = c.post("/v1/methods/saap/train", json=TINY)  # the same request queues the same job again
        assert again.status_code == 202 and again.json()["id"] == job["id"] and again.json()["created"] is True
        assert again.json()["status"] == "queued" and again.json()["cancel_requested"] is False
        assert c.app.state.runtime.queues.depth()["train"] == 1
        r = c.delete("/v1/methods/saap/train/" + "0" * 64)
        assert (r.status_code, _code(r)) == (404, "not_found")


def test_cancel_a_running_job(client, lm):
    """A running job stops at its next check (every 256 steps here) and ends `cancelled`, without a
    manifest (no model); the slot is free for the next job; a finished job cannot be cancelled."""
    model_dir = default_model_dir(lm.spec.fingerprint, client.app.state.runtime.settings.data_dir)
    long = {**TINY, "steps": 5000}  # ~10 ms a step here: about a minute per layer
    jid = client.post("/v1/methods/saap/train", json=long).json()["id"]
    end = time.time() + 120
    while not client.get(f"/v1/methods/saap/train/{jid}").json()["phase"].startswith("layer"):
        assert time.time() < end, "the job never reached its first layer"
        time.sleep(0.1)
    r = client.delete(f"/v1/methods/saap/train/{jid}")
    assert r.status_code == 202 and r.json()["status"] == "running" and r.json()["cancel_requested"] is True
    t0 = time.time()
    job = wait_job(client, jid, timeout=60)
    assert job["status"] == "cancelled" and job["phase"] == "cancelled", job
    assert time.time() - t0 < 30  # stopped at a check, not at the end of the run (~2 min)
    assert not (model_dir / "manifest.json").exists()
    done = client.post("/v1/methods/saap/train", json={**TINY, "layers": [1], "steps": 5})
    assert done.status_code == 202, done.text  # the slot is free
    assert wait_job(client, done.json()["id"])["status"] == "done"
    r = client.delete(f"/v1/methods/saap/train/{done.json()['id']}")
    assert (r.status_code, _code(r)) == (409, "job_finished")
