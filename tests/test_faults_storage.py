"""Storage is the source of truth: faults injected around the catalog and the disk.

* Redis loses its data while a context is being built (FLUSHDB): the build still publishes and
  the context is back in the catalog, ready and answering (the 202 the client got stays true).
* A PATCH (ttl 0 = never expires, a new display name) survives Redis losing its data and a rebuild
  of the catalog from storage, on demand (admin route, CLI) and at start.
* A failed manifest write leaves no temp file; `/readyz` reports storage that cannot be written.

Real default model on the CPU, real Redis under a per-test key prefix (the "FLUSHDB" deletes every
key under that prefix: the same loss for this catalog, without touching other tests' keys)."""

from __future__ import annotations

import contextlib
import errno
import json
import resource
import signal
import time

import pytest
import redis
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import REDIS_URL, passkey_document
from service.app import create_app
from service.cli import app as cli_app
from storage import artifacts
from storage.artifacts import MANIFEST, MANIFEST_LOCK, ContextStore, IndexArrays
from test_api import _settings, ask, wait_ready
from test_storage import _Spec, _publish


def _flush(prefix: str) -> int:
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))
    return r.delete(*keys) if keys else 0


def _wait_back(c, cid: str, timeout: float = 120.0) -> dict:
    """Poll until the context is ready (a 404 while its record is gone counts as not yet)."""
    end = time.time() + timeout
    while time.time() < end:
        r = c.get(f"/v1/contexts/{cid}")
        if r.status_code == 200 and r.json()["status"] in ("ready", "failed"):
            return r.json()
        time.sleep(0.1)
    raise AssertionError(f"context {cid} not back after {timeout}s: {r.status_code} {r.text}")


def _wait_workers(c, timeout: float = 30.0) -> None:
    heartbeats, end = c.app.state.runtime.heartbeats, time.time() + timeout
    while time.time() < end and not heartbeats.live("decode"):
        time.sleep(0.1)


@pytest.fixture
def settings(tmp_path, redis_prefix):
    return _settings(tmp_path, redis_prefix)


def test_flushdb_mid_prefill_publishes_and_reregisters(settings, redis_prefix, lm):
    with TestClient(create_app(settings, lm=lm)) as c:
        store = c.app.state.runtime.store
        publish = store.publish
        flushed = []

        def publish_after_flush(*a, **kw):  # the catalog is wiped while the worker is mid-build
            flushed.append(_flush(redis_prefix))
            return publish(*a, **kw)

        store.publish = publish_after_flush
        r = c.post("/v1/contexts", json={"text": passkey_document(31415, n_rep=4), "display_name": "flushed",
                                         "ttl_seconds": 3600})
        assert r.status_code == 202
        cid = r.json()["id"]
        rec = _wait_back(c, cid)
        assert flushed and flushed[0] > 0  # the record, the queued job and the token ids were gone
        assert rec["status"] == "ready" and rec["display_name"] == "flushed"
        assert rec["expires_at"] == pytest.approx(r.json()["expires_at"], abs=1.0)
        assert any(store.root.glob(f"*/{cid}/{MANIFEST}"))
        _wait_workers(c)  # their heartbeats went with the flush
        assert "31415" in ask(c, cid, max_tokens=10)["text"]


def test_delete_during_prefill_still_leaves_nothing(settings, lm):
    """The other side of the rule above: a context deleted while it was built is not brought back."""
    with TestClient(create_app(settings, lm=lm)) as c:
        store = c.app.state.runtime.store
        publish = store.publish
        cid_box: list[str] = []

        def publish_after_delete(*a, **kw):
            assert c.delete(f"/v1/contexts/{cid_box[0]}").status_code == 204
            return publish(*a, **kw)

        store.publish = publish_after_delete
        prefill = c.app.state.runtime.queues.prefill
        r = c.post("/v1/contexts", json={"text": passkey_document(27, n_rep=4)})
        cid_box.append(r.json()["id"])
        end = time.time() + 120
        while time.time() < end and any(prefill.depth()):
            time.sleep(0.05)  # the job is done once it left both lists
        assert c.get(f"/v1/contexts/{cid_box[0]}").status_code == 404
        assert not any(store.root.glob(f"*/{cid_box[0]}"))


def test_patch_survives_flushdb_and_rebuild(settings, redis_prefix, lm, monkeypatch):
    with TestClient(create_app(settings, lm=lm)) as c:
        # an expiry an hour out (a 3 s one let a slow build expire before the PATCH: the test was flaky);
        # a rebuild that read it back instead of the manifest's would show it in `expires_at`
        r = c.post("/v1/contexts", json={"text": passkey_document(16180, n_rep=4), "display_name": "before",
                                         "ttl_seconds": 3600})
        cid = r.json()["id"]
        assert wait_ready(c, cid)["status"] == "ready"
        r = c.patch(f"/v1/contexts/{cid}", json={"ttl_seconds": 0, "display_name": "after"})
        assert r.status_code == 200 and r.json()["expires_at"] is None and r.json()["display_name"] == "after"
        manifest = json.loads(next(c.app.state.runtime.store.root.glob(f"*/{cid}/{MANIFEST}")).read_text())
        assert manifest["expires_at"] is None and manifest["display_name"] == "after"

        assert _flush(redis_prefix) > 0
        assert c.get(f"/v1/contexts/{cid}").status_code == 404
        r = c.post("/v1/admin/rebuild-catalog")
        assert r.status_code == 200 and r.json() == {"added": 1, "known": 0}
        time.sleep(3 * settings.janitor_interval_seconds)  # the janitor ran: nothing is due
        rec = c.get(f"/v1/contexts/{cid}").json()
        assert rec["status"] == "ready" and rec["expires_at"] is None and rec["display_name"] == "after"
        _wait_workers(c)
        assert "16180" in ask(c, cid, max_tokens=10)["text"]
        assert c.post("/v1/admin/rebuild-catalog").json() == {"added": 0, "known": 1}

        # the CLI drives the same route
        _flush(redis_prefix)
        monkeypatch.setattr("service.cli._client", lambda url: contextlib.nullcontext(c))
        res = CliRunner().invoke(cli_app, ["rebuild-catalog"])
        assert res.exit_code == 0 and "re-added 1 contexts" in res.output, res.output
        assert c.get(f"/v1/contexts/{cid}").json()["display_name"] == "after"
    # ... and a restart rebuilds it at start with the current values
    _flush(redis_prefix)
    with TestClient(create_app(settings, lm=lm)) as c:
        rec = c.get(f"/v1/contexts/{cid}").json()
        assert rec["status"] == "ready" and rec["expires_at"] is None and rec["display_name"] == "after"


def test_patch_during_the_build_reaches_the_manifest(settings, redis_prefix, lm):
    """A PATCH that lands while the context is built (before its manifest exists) is copied into the
    manifest when the build publishes, so a rebuilt catalog has it too."""
    with TestClient(create_app(settings, lm=lm)) as c:
        store = c.app.state.runtime.store
        publish = store.publish
        box: list[str] = []

        def patch_then_publish(*a, **kw):
            r = c.patch(f"/v1/contexts/{box[0]}", json={"ttl_seconds": 0, "display_name": "renamed"})
            assert r.status_code == 200, r.text
            return publish(*a, **kw)

        store.publish = patch_then_publish
        r = c.post("/v1/contexts", json={"text": passkey_document(2024, n_rep=4), "display_name": "first",
                                         "ttl_seconds": 600})
        box.append(r.json()["id"])
        assert wait_ready(c, box[0])["status"] == "ready"
        manifest = json.loads(next(store.root.glob(f"*/{box[0]}/{MANIFEST}")).read_text())
        assert manifest["display_name"] == "renamed" and manifest["expires_at"] is None
        _flush(redis_prefix)
        assert c.post("/v1/admin/rebuild-catalog").json()["added"] == 1
        rec = c.get(f"/v1/contexts/{box[0]}").json()
        assert rec["display_name"] == "renamed" and rec["expires_at"] is None


def test_a_failed_manifest_write_leaves_no_temp_file(tmp_path, monkeypatch):
    store = ContextStore(tmp_path)
    key, _, _, _ = _publish(store, n=64, with_index=False)
    ctx = store.context_dir(_Spec.slug, key)
    before = sorted(p.name for p in ctx.iterdir())

    def disk_full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artifacts.json, "dump", disk_full)
    extra = IndexArrays("demo", 1, {"a": 1}, "0123456789abcdef", {"table": torch.arange(10).view(2, 5).int()})
    with pytest.raises(OSError):
        store.add_indexes(_Spec.slug, key, [extra])
    with pytest.raises(OSError):
        store.update_metadata(_Spec.slug, key, display_name="x")
    monkeypatch.undo()
    leftovers = [p.name for p in ctx.iterdir() if p.name not in before and p.name not in ("indexes", MANIFEST_LOCK)]
    assert leftovers == []
    assert not list(tmp_path.glob("*/.tmp-*")) and not list(ctx.glob(".tmp-*"))
    assert store.read_manifest(_Spec.slug, key)["indexes"] == {}  # the old manifest stands


def test_readyz_reports_storage_that_cannot_be_written(settings, lm):
    """Permission bits do not show a full disk (or a root process writing a read-only folder): the
    check writes a file. A file-size limit of 0 makes every write fail like a full disk."""
    with TestClient(create_app(settings, lm=lm)) as c:
        assert c.get("/readyz").json()["checks"]["storage"]["ok"] is True
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
        try:
            r = c.get("/readyz")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old_handler)
        assert r.status_code == 503, r.text
        storage = r.json()["checks"]["storage"]
        assert storage["ok"] is False and "cannot be written" in storage["error"]
        assert c.get("/readyz").json()["checks"]["storage"]["ok"] is True


class _Watched(redis.Redis):
    """A client that, after every command it sends itself, reads the context's record through a
    second connection and keeps what it saw: a record caught without its status is a torn write."""

    def __init__(self, key: str, **kw):
        super().__init__(**kw)
        self._key, self._peek, self.seen = key, redis.Redis.from_url(REDIS_URL), []

    def execute_command(self, *args, **options):
        out = super().execute_command(*args, **options)
        h = self._peek.hgetall(self._key)
        if h:
            self.seen.append(set(h))
        return out


def test_catalog_rebuild_never_shows_a_record_without_its_status(redis_prefix):
    """`add_ready` (the catalog rebuild after Redis lost its data) writes a record in one step: a GET
    between its writes used to read `{id}` alone and answer 500 (KeyError 'status'; CI, stop 24)."""
    from storage.catalog import Catalog
    from storage.keys import PromptHash

    cid = PromptHash("ab" * 32)
    probe = Catalog(redis.Redis.from_url(REDIS_URL), redis_prefix)
    client = _Watched(probe.k_ctx(cid), connection_pool=redis.ConnectionPool.from_url(REDIS_URL))
    cat = Catalog(client, redis_prefix)
    assert cat.add_ready(cid, {"model": "m", "n_tokens": 3}, {}, {"created_at": 1.0})
    assert all(b"status" in fields for fields in client.seen), client.seen
    assert probe.get(cid)["status"] == "ready" and probe.get(cid)["n_tokens"] == 3
    assert not cat.add_ready(cid, {"model": "other"}, {}, {})  # known: unchanged
    assert probe.get(cid)["model"] == "m"


def test_updates_after_the_record_is_gone_write_nothing(redis_prefix):
    """A worker's progress write after Redis lost the record (or after a delete) must not recreate
    it as a partial hash that reads back without a status: contexts and training jobs alike."""
    from service.jobs.train_records import TrainJobs
    from storage.catalog import Catalog
    from storage.keys import PromptHash, TrainJobId

    r = redis.Redis.from_url(REDIS_URL)
    cat, cid = Catalog(r, redis_prefix), PromptHash("cd" * 32)
    assert not cat.update(cid, progress=0.5)
    assert not r.exists(cat.k_ctx(cid))
    jobs = TrainJobs(r, redis_prefix, queue=None)  # update and get never touch the queue
    jid = TrainJobId("ef" * 32)
    assert not jobs.update(jid, phase="layer 3")
    assert jobs.get(jid) is None
