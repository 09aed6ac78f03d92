"""Artifacts in object storage (`storage/objstore.py`), against a real S3 API server: moto in
server mode, started by this module on 127.0.0.1 and spoken to over HTTP by the same obstore
client that talks to AWS or MinIO (nothing is mocked in the client).

* A context registered through the API lives in the bucket only (the data dir holds the model),
  answers, passes fsck, and its delete empties its prefix.
* A write that dies before its manifest leaves a build nobody sees: not listed, not opened, not
  re-added by a catalog rebuild; registering again builds it; `gc_temp` removes the leftover.
* Of two writers of one context the first manifest wins; manifest updates are compare-and-swaps
  (no lost update between concurrent writers, each with its own client).
* A chunk swapped or deleted in the bucket answers `artifact_corrupt`, never other tokens.
* Two decode workers, each with its own client and tiers, answer from one bucket.
* After Redis lost the catalog, it is rebuilt from the bucket, also by a service on another data dir.

Real default model on the CPU, real Redis under a per-test key prefix, a bucket prefix per test."""

from __future__ import annotations

import threading
import uuid

import boto3
import obstore
import pytest
import torch
from fastapi.testclient import TestClient
from moto.server import ThreadedMotoServer
from obstore.store import S3Store
from typer.testing import CliRunner

from conftest import MODEL_CACHE, passkey_document
from servers import register_passkey
from service.app import create_app
from service.cli import app as cli_app
from service.runtime import Runtime
from service.jobs.decode import DecodeWorker
from service.jobs.prefill import PrefillWorker
from storage.artifacts import MANIFEST, ArtifactMissing, ContextStore, IndexArrays
from storage.keys import PromptHash
from storage.objstore import ObjectContextStore, StorageUnavailable
from test_api import _settings, ask, wait_ready
from test_faults_storage import _flush, _wait_workers
from test_storage import _publish, _Spec

BUCKET = "ctxcache-test"
QUESTION = "What is the pass key?"


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on a free port of 127.0.0.1, with one bucket; AWS credentials in the
    environment as a deployment would set them (moto accepts any)."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = pytest.MonkeyPatch()
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_REGION": "us-east-1"}.items():
        env.setenv(name, value)
    env.delenv("AWS_ENDPOINT_URL", raising=False)
    env.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    yield endpoint
    env.undo()
    server.stop()


@pytest.fixture
def storage_url() -> str:
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"


def _bucket(url: str, endpoint: str) -> S3Store:
    """An independent client on the test's prefix (what an operator or another machine sees)."""
    return S3Store.from_url(url, endpoint=endpoint, client_options={"allow_http": True})


def _keys(bucket: S3Store, prefix: str | None = None) -> list[str]:
    return sorted(m["path"] for batch in obstore.list(bucket, prefix) for m in batch)


def _s3_settings(tmp_path, redis_prefix, url, endpoint, **kw):
    return _settings(tmp_path, redis_prefix, storage_url=url, storage_endpoint_url=endpoint, **kw)


_register = register_passkey


def _completion(c, cid: str):
    return c.post(f"/v1/contexts/{cid}/completions",
                  json={"question": QUESTION, "method": "full", "max_tokens": 6, "temperature": 0})


# ---- storage level ------------------------------------------------------------------------------


def test_round_trip_updates_are_compare_and_swap(s3_endpoint, storage_url, monkeypatch):
    store = ObjectContextStore(storage_url, endpoint_url=s3_endpoint)
    key, k, v, manifest = _publish(store, dtype=torch.bfloat16)
    assert {m["root"] for m in manifest["arrays"].values()} == {manifest["arrays"]["kv/k"]["root"]}
    art = store.open(_Spec.slug, key)
    assert torch.equal(art.read("kv/k", 1).view(torch.int16), k[1].view(torch.int16))  # bit-exact bf16
    assert torch.equal(art.read("kv/v"), v) and art.read("tokens").tolist() == list(range(300))
    assert store.verify(_Spec.slug, key) == []

    # concurrent writers, each with its own client: a rename and two index builds all land
    other = ObjectContextStore(storage_url, endpoint_url=s3_endpoint)
    extras = [IndexArrays("demo", 1, {"a": i}, f"{i:016x}", {"table": torch.full((2, 4), i).int()}) for i in (2, 3)]
    jobs = [lambda: store.update_metadata(_Spec.slug, key, display_name="renamed"),
            lambda: store.add_indexes(_Spec.slug, key, [extras[0]]),
            lambda: other.add_indexes(_Spec.slug, key, [extras[1]])]
    threads = [threading.Thread(target=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = other.read_manifest(_Spec.slug, key)
    assert final["display_name"] == "renamed"
    assert set(final["indexes"]) == {"demo-0123456789abcdef", extras[0].index_id, extras[1].index_id}
    assert store.verify(_Spec.slug, key) == []
    assert store.open(_Spec.slug, key).read(f"indexes/{extras[1].index_id}/table", 1).tolist() == [3] * 4

    # another writer lands between this one's read and its write: the swap is refused and retried
    real_get, reads = ObjectContextStore._get_manifest, []

    def other_writes_after_the_read(self, slug, k):
        got = real_get(self, slug, k)
        reads.append(self)
        if self is store and reads.count(store) == 1:
            other.add_indexes(slug, k, [IndexArrays("demo", 1, {"a": 5}, "5" * 16, {"table": torch.ones(2, 3).int()})])
        return got

    monkeypatch.setattr(ObjectContextStore, "_get_manifest", other_writes_after_the_read)
    store.update_metadata(_Spec.slug, key, display_name="mine")
    monkeypatch.undo()
    assert reads.count(store) == 2  # read, refused (If-Match), read again, written
    final = store.read_manifest(_Spec.slug, key)
    assert final["display_name"] == "mine" and "demo-" + "5" * 16 in final["indexes"]

    # a cached handle keeps its arrays over a rename, not over a new index
    art = store.open(_Spec.slug, key)
    store.update_metadata(_Spec.slug, key, display_name="again")
    assert art.is_current()
    store.add_indexes(_Spec.slug, key, [IndexArrays("demo", 1, {"a": 4}, "4" * 16, {"table": torch.ones(2, 2).int()})])
    assert not art.is_current()

    assert store.delete(_Spec.slug, key)
    assert _keys(_bucket(storage_url, s3_endpoint)) == [] and not store.exists(_Spec.slug, key)
    assert not art.is_current()
    with pytest.raises(ArtifactMissing):
        store.update_metadata(_Spec.slug, key, display_name="gone")


def test_a_write_that_dies_before_its_manifest_is_invisible(s3_endpoint, storage_url, monkeypatch):
    store = ObjectContextStore(storage_url, endpoint_url=s3_endpoint)
    real_write = ObjectContextStore._write_array

    def dies_at_v(self, group, name, t, chunks):
        if name == "kv/v":
            raise KeyboardInterrupt("killed mid-publish")
        return real_write(self, group, name, t, chunks)

    monkeypatch.setattr(ObjectContextStore, "_write_array", dies_at_v)
    monkeypatch.setattr(ObjectContextStore, "_discard_build", lambda self, prefix: None)  # a kill cleans nothing
    with pytest.raises(KeyboardInterrupt):
        _publish(store)
    monkeypatch.undo()
    bucket = _bucket(storage_url, s3_endpoint)
    left = _keys(bucket)
    assert any("/kv/k/c/" in k for k in left) and not any(k.endswith(MANIFEST) for k in left)
    key = PromptHash(next(k for k in left if "/kv/k/c/" in k).split("/")[1])
    assert not store.exists(_Spec.slug, key) and list(store.iter_manifests()) == []
    with pytest.raises(ArtifactMissing):
        store.open(_Spec.slug, key)

    assert store.gc_temp(older_than_s=3600) == 0  # too young to be a crash's
    store.min_gc_interval_s = 0
    key2, _, _, manifest = _publish(store)
    assert key2 == key
    assert store.gc_temp(older_than_s=0) == 1  # the dead build, not the published one
    assert all(f"/{manifest['arrays']['kv/k']['root']}/" in k or k.endswith(MANIFEST) or k.endswith("zarr.json")
               for k in _keys(bucket))
    assert store.verify(_Spec.slug, key) == [] and [m["prompt_hash"] for _, m in store.iter_manifests()] == [key.hex]


def test_racing_writers_first_manifest_wins(s3_endpoint, storage_url):
    a = ObjectContextStore(storage_url, endpoint_url=s3_endpoint)
    b = ObjectContextStore(storage_url, endpoint_url=s3_endpoint)
    key, k, _, first = _publish(a)
    _, _, _, second = _publish(b)  # same content, built again elsewhere
    assert second == first  # the manifest in force is the first writer's ...
    builds = {k.split("/")[2] for k in _keys(_bucket(storage_url, s3_endpoint)) if k.count("/") > 2}
    assert builds == {first["arrays"]["kv/k"]["root"]}  # ... and the second's build was deleted
    assert torch.equal(b.open(_Spec.slug, key).read("kv/k"), k)


def test_a_local_context_copied_into_the_bucket_is_served(tmp_path, s3_endpoint, storage_url):
    """What `aws s3 sync <data_dir>/contexts s3://...` does: every file as an object, same paths."""
    local = ContextStore(tmp_path)
    key, k, _, _ = _publish(local)
    bucket = _bucket(storage_url, s3_endpoint)
    for f in tmp_path.rglob("*"):
        if f.is_file() and not f.name.startswith("."):
            obstore.put(bucket, f.relative_to(tmp_path).as_posix(), f.read_bytes())
    store = ObjectContextStore(storage_url, endpoint_url=s3_endpoint)
    assert [m["prompt_hash"] for _, m in store.iter_manifests()] == [key.hex]
    assert torch.equal(store.open(_Spec.slug, key).read("kv/k"), k) and store.verify(_Spec.slug, key) == []
    obstore.delete(bucket, f"{_Spec.slug}/{key.hex}/kv/k/c/1/2/0/0")
    assert store.verify(_Spec.slug, key) == ["kv/k/c/1/2/0/0: chunk missing in the object store"]


def test_unreachable_storage_is_storage_unavailable(storage_url):
    store = ObjectContextStore(storage_url, endpoint_url="http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(StorageUnavailable):
        list(store.iter_manifests())
    assert store.storage_check()["ok"] is False


# ---- through the service -------------------------------------------------------------------------


def test_the_api_starts_with_the_bucket_down_and_says_so(tmp_path, redis_prefix, storage_url, lm):
    """The catalog rebuild at start cannot reach the bucket: the API still starts (it logs the
    failure), answers liveness, and readiness reports the storage as not ok (503)."""
    settings = _s3_settings(tmp_path, redis_prefix, storage_url, "http://127.0.0.1:9", run_workers=False)
    with TestClient(create_app(settings, lm=lm)) as c:
        assert c.get("/healthz").status_code == 200
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"]["storage"]["ok"] is False, r.text


def test_a_context_lives_in_the_bucket_and_answers(tmp_path, redis_prefix, s3_endpoint, storage_url, lm):
    settings = _s3_settings(tmp_path, redis_prefix, storage_url, s3_endpoint)
    bucket = _bucket(storage_url, s3_endpoint)
    with TestClient(create_app(settings, lm=lm)) as c:
        assert isinstance(c.app.state.runtime.store, ObjectContextStore)
        ready = c.get("/readyz")  # the storage probe writes to the bucket, not to a local folder
        assert ready.status_code == 200 and ready.json()["checks"]["storage"]["ok"], ready.text
        cid = _register(c, 31415, display_name="in s3")
        assert "31415" in ask(c, cid, max_tokens=10)["text"]
        slug = c.app.state.runtime.lm.spec.slug
        keys = _keys(bucket)
        assert f"{slug}/{cid}/{MANIFEST}" in keys
        assert any(k.startswith(f"{slug}/{cid}/b-") and "/kv/k/c/" in k for k in keys)
        local = [p for p in settings.data_dir.rglob("*")
                 if p.is_file() and p.relative_to(settings.data_dir).parts[0] != "models"]
        assert local == [] and not settings.contexts_dir.exists()  # nothing of it on the local disk
        r = c.patch(f"/v1/contexts/{cid}", json={"display_name": "renamed"})
        assert r.status_code == 200
        assert c.app.state.runtime.store.read_manifest(slug, PromptHash(cid))["display_name"] == "renamed"
        out = c.post("/v1/admin/fsck").json()
        assert out["checked"] == 1 and out["damaged"] == []
        assert c.delete(f"/v1/contexts/{cid}").status_code == 204
        assert _keys(bucket, f"{slug}/{cid}") == []


def test_a_failed_publish_is_invisible_and_registering_again_builds_it(tmp_path, redis_prefix, s3_endpoint,
                                                                       storage_url, lm, monkeypatch):
    settings = _s3_settings(tmp_path, redis_prefix, storage_url, s3_endpoint)
    real_write = ObjectContextStore._write_array

    def fails_at_v(self, group, name, t, chunks):
        if name == "kv/v":
            raise OSError("connection reset mid-publish")
        return real_write(self, group, name, t, chunks)

    with TestClient(create_app(settings, lm=lm)) as c:
        monkeypatch.setattr(ObjectContextStore, "_write_array", fails_at_v)
        r = c.post("/v1/contexts", json={"text": passkey_document(4242, n_rep=4)})
        cid = r.json()["id"]
        rec = wait_ready(c, cid)
        assert rec["status"] == "failed" and rec["error"]["code"] == "build_failed"
        monkeypatch.undo()
        assert _keys(_bucket(storage_url, s3_endpoint)) == []  # the failed write deleted its build
        _flush(redis_prefix)
        assert c.post("/v1/admin/rebuild-catalog").json() == {"added": 0, "known": 0}
        _wait_workers(c)
        assert _register(c, 4242) == cid
        assert "4242" in ask(c, cid, max_tokens=10)["text"]


def test_a_swapped_or_missing_chunk_in_the_bucket_is_artifact_corrupt(tmp_path, redis_prefix, s3_endpoint,
                                                                      storage_url, lm):
    # no DRAM tier: every read goes to the bucket (as under an evicting tier)
    settings = _s3_settings(tmp_path, redis_prefix, storage_url, s3_endpoint, dram_tier_bytes=0)
    bucket = _bucket(storage_url, s3_endpoint)
    with TestClient(create_app(settings, lm=lm)) as c:
        swapped, missing = _register(c, 4711), _register(c, 2718)
        first = ask(c, swapped, max_tokens=6)
        slug, store = c.app.state.runtime.lm.spec.slug, c.app.state.runtime.store

        def chunk(cid: str, rel: str) -> str:
            root = store.read_manifest(slug, PromptHash(cid))["arrays"]["kv/k"]["root"]
            return f"{slug}/{cid}/{root}/kv/k/{rel}"

        a, b = chunk(swapped, "c/0/0/0/0"), chunk(swapped, "c/1/0/0/0")
        da, db = bytes(obstore.get(bucket, a).bytes()), bytes(obstore.get(bucket, b).bytes())
        obstore.put(bucket, a, db)
        obstore.put(bucket, b, da)  # two valid chunks (their own crcs hold), in each other's place
        obstore.delete(bucket, chunk(missing, "c/3/1/0/0"))

        # offline, straight from the bucket (no service): both found, exit 1
        res = CliRunner().invoke(cli_app, ["fsck", "--storage-url", storage_url],
                                 env={"CTXCACHE_STORAGE_ENDPOINT_URL": s3_endpoint})
        assert res.exit_code == 1, res.output
        assert f"DAMAGED {swapped}" in res.output and f"DAMAGED {missing}" in res.output, res.output
        assert "2 contexts checked" in res.output

        for cid, word in ((swapped, "checksum"), (missing, "missing")):
            r = _completion(c, cid)
            assert r.status_code == 500 and r.json()["error"]["code"] == "artifact_corrupt", r.text
            assert word in r.json()["error"]["message"]
            rec = c.get(f"/v1/contexts/{cid}").json()
            assert rec["status"] == "failed" and rec["error"]["code"] == "artifact_corrupt"
        assert store.verify(slug, PromptHash(missing)) == ["kv/k/c/3/1/0/0: chunk missing in the object store"]

        r = c.post("/v1/contexts", json={"text": passkey_document(4711, n_rep=4)})  # rebuilt, not trusted
        assert r.status_code == 202 and wait_ready(c, swapped)["status"] == "ready"
        assert store.verify(slug, PromptHash(swapped)) == []
        assert ask(c, swapped, max_tokens=6)["token_ids"] == first["token_ids"]


def test_two_decode_workers_share_one_bucket(tmp_path, redis_prefix, s3_endpoint, storage_url, lm):
    """Each worker has its own runtime (obstore client, handles, tiers) and its own model copy, as
    on two machines; the API runs no workers. Each answers in turn from the bucket."""
    from decoder.model import load_model

    settings = _s3_settings(tmp_path, redis_prefix, storage_url, s3_endpoint, run_workers=False)
    with TestClient(create_app(settings, lm=lm)) as c:
        prefill = PrefillWorker(Runtime.create(settings, lm=lm)).start()
        decoders = [DecodeWorker(Runtime.create(settings, lm=lm)),
                    DecodeWorker(Runtime.create(settings, lm=load_model("smollm2-135m", MODEL_CACHE)))]
        assert decoders[0].rt.store is not decoders[1].rt.store
        try:
            cid = _register(c, 27182)
            answers = []
            for i, worker in enumerate(decoders):
                worker.start()
                if i:
                    decoders[0].stop()
                _wait_workers(c)
                answers.append(ask(c, cid, max_tokens=10))
                assert PromptHash(cid) in worker._handles  # this worker opened it from the bucket
            assert all("27182" in a["text"] for a in answers)
            assert answers[0]["token_ids"] == answers[1]["token_ids"]
            assert all(a["stats"]["cache"] == "cold" for a in answers)  # each read it from the bucket itself
        finally:
            for w in (prefill, *decoders):
                w.stop()


def test_catalog_is_rebuilt_from_the_bucket(tmp_path, redis_prefix, s3_endpoint, storage_url, lm):
    settings = _s3_settings(tmp_path / "one", redis_prefix, storage_url, s3_endpoint)
    with TestClient(create_app(settings, lm=lm)) as c:
        cid = _register(c, 16180, display_name="kept", ttl_seconds=3600)
        assert _flush(redis_prefix) > 0
        assert c.get(f"/v1/contexts/{cid}").status_code == 404
        assert c.post("/v1/admin/rebuild-catalog").json() == {"added": 1, "known": 0}
        rec = c.get(f"/v1/contexts/{cid}").json()
        assert rec["status"] == "ready" and rec["display_name"] == "kept" and rec["expires_at"] is not None
        _wait_workers(c)
        assert "16180" in ask(c, cid, max_tokens=10)["text"]
    # another machine: a fresh data dir, an empty catalog, the same bucket: found at start
    _flush(redis_prefix)
    other = _s3_settings(tmp_path / "two", redis_prefix, storage_url, s3_endpoint)
    with TestClient(create_app(other, lm=lm)) as c:
        rec = c.get(f"/v1/contexts/{cid}").json()
        assert rec["status"] == "ready" and rec["display_name"] == "kept"
        _wait_workers(c)
        assert "16180" in ask(c, cid, max_tokens=10)["text"]
