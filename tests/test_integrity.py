"""Verified reads: every chunk read from disk is checked against the crc32c its manifest recorded at
publish, each time it is read (not once per cached handle); a damaged context answers an error,
never a wrong answer, is marked failed, is rebuilt when registered again, and `fsck` finds it.

The API tests run the real default model on the CPU with a DRAM tier of 0 bytes (every read goes to
disk, as under an evicting tier) and real Redis under a per-test key prefix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import passkey_document
from servers import register_passkey
from service.app import create_app
from service.cli import app as cli_app
from storage.artifacts import MANIFEST, ArtifactCorrupt, ContextStore, IndexArrays, _write_json_atomic
from storage.keys import PromptHash
from test_api import _settings, ask, wait_ready
from test_storage import _Spec, _publish

QUESTION = "What is the pass key?"


# ---- storage level ------------------------------------------------------------------------------


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_a_chunk_swapped_for_another_valid_chunk_fails_its_read(tmp_path):
    store = ContextStore(tmp_path)
    key, k, v, manifest = _publish(store, n=300)
    art = store.open(_Spec.slug, key)
    assert torch.equal(art.read("kv/k", 0), k[0])
    kdir = store.context_dir(_Spec.slug, key) / "kv" / "k"
    _swap(kdir / "c/0/1/0/0", kdir / "c/1/1/0/0")  # both decode fine: each carries its own valid crc32c
    with pytest.raises(ArtifactCorrupt, match="checksum"):
        art.read("kv/k", 0)  # the same handle: checked on every read, not once
    with pytest.raises(ArtifactCorrupt):
        store.open(_Spec.slug, key).read("kv/k", 1)
    assert torch.equal(art.read("kv/v", 0), v[0])  # the arrays left alone still read
    assert set(manifest["arrays"]["kv/k"]["chunk_crc32c"]) == {f"c/{layer}/{h}/0/0" for layer in range(2) for h in range(3)}
    problems = store.verify(_Spec.slug, key)
    assert sorted(problems) == ["kv/k/c/0/1/0/0: chunk checksum differs from the manifest",
                                "kv/k/c/1/1/0/0: chunk checksum differs from the manifest"]


def test_a_chunk_deleted_after_first_use_fails_its_next_read(tmp_path):
    store = ContextStore(tmp_path)
    key, _, v, _ = _publish(store, n=300)
    art = store.open(_Spec.slug, key)
    assert torch.equal(art.read("kv/v", 1), v[1])  # first use: every array checked, handle cached
    (store.context_dir(_Spec.slug, key) / "kv/v/c/1/2/0/0").unlink()
    with pytest.raises(ArtifactCorrupt, match="missing"):
        art.read("kv/v", 1)  # zarr alone would return zeros for that head
    assert store.verify(_Spec.slug, key) == ["kv/v/c/1/2/0/0: chunk missing on disk"]


def test_a_manifest_without_chunk_checksums_still_fails_on_a_missing_chunk(tmp_path):
    """Contexts published before chunk checksums existed: a missing chunk is still an error on read,
    and verify falls back to the whole-array sha256."""
    store = ContextStore(tmp_path)
    key, _, _, manifest = _publish(store, n=300)
    ctx = store.context_dir(_Spec.slug, key)
    for meta in manifest["arrays"].values():
        meta.pop("chunk_crc32c", None)
    _write_json_atomic(ctx / MANIFEST, manifest)
    art = store.open(_Spec.slug, key)
    art.read("kv/k", 0)
    (ctx / "kv/k/c/0/0/0/0").unlink()
    with pytest.raises(ArtifactCorrupt, match="missing"):
        art.read("kv/k", 0)
    assert store.verify(_Spec.slug, key) == ["kv/k: 1 of 6 chunks missing on disk"]
    (ctx / "kv/v/c/1/0/0/0").write_bytes((ctx / "kv/v/c/0/0/0/0").read_bytes())  # valid, but the wrong data
    assert store.verify(_Spec.slug, key)[-1] == "kv/v: data differs from the sha256 in the manifest"


def test_a_flipped_bit_is_found_by_verify_and_fails_the_read(tmp_path):
    store = ContextStore(tmp_path)
    key, _, _, _ = _publish(store, n=300)
    chunk = store.context_dir(_Spec.slug, key) / "kv/k/c/1/0/0/0"
    data = bytearray(chunk.read_bytes())
    data[17] ^= 0x10  # the data, not the crc the file carries: the manifest's crc still matches that
    chunk.write_bytes(bytes(data))
    assert store.verify(_Spec.slug, key) == ["kv/k/c/1/0/0/0: chunk data does not match its crc32c"]
    with pytest.raises(ArtifactCorrupt):
        store.open(_Spec.slug, key).read("kv/k", 1)


def test_index_arrays_added_later_are_verified_too(tmp_path):
    store = ContextStore(tmp_path)
    key, _, _, _ = _publish(store, n=300, with_index=False)
    extra = IndexArrays("demo", 1, {"a": 2}, "fedcba9876543210", {"table": torch.arange(10).view(2, 5).int()})
    manifest = store.add_indexes(_Spec.slug, key, [extra])
    name = "indexes/demo-fedcba9876543210/table"
    tdir = store.context_dir(_Spec.slug, key) / name
    _swap(tdir / "c/0/0", tdir / "c/1/0")  # layer 0's table answers with layer 1's rows
    with pytest.raises(ArtifactCorrupt, match="checksum"):
        store.open(_Spec.slug, key).read(name, 0)
    assert store.verify(_Spec.slug, key) == [f"{name}/c/0/0: chunk checksum differs from the manifest",
                                             f"{name}/c/1/0: chunk checksum differs from the manifest"]
    assert set(manifest["arrays"][name]["chunk_crc32c"]) == {"c/0/0", "c/1/0"}


def test_a_cached_handle_notices_a_rebuild_but_not_a_rename(tmp_path):
    """The decode worker keeps read handles; one whose context was rebuilt into other chunks must be
    opened again (its manifest's checksums are stale), one whose name or expiry changed need not."""
    store = ContextStore(tmp_path)
    key, _, _, _ = _publish(store, n=300)
    art = store.open(_Spec.slug, key)
    store.update_metadata(_Spec.slug, key, display_name="renamed", expires_at=None)
    assert art.is_current() and art.manifest["display_name"] == "renamed"
    store.delete(_Spec.slug, key)
    assert not art.is_current()
    torch.manual_seed(1)
    store.publish(key, _Spec(), list(range(300)), torch.randn(2, 3, 300, 8), torch.randn(2, 3, 300, 8), [], {})
    assert not art.is_current()
    with pytest.raises(ArtifactCorrupt):
        art.read("kv/k", 0)  # the stale handle itself refuses the new chunks
    assert store.open(_Spec.slug, key).read("kv/k", 0).shape == (3, 300, 8)


# ---- through the service -------------------------------------------------------------------------


@pytest.fixture
def client(tmp_path, redis_prefix, lm):
    with TestClient(create_app(_settings(tmp_path, redis_prefix, dram_tier_bytes=0), lm=lm)) as c:
        yield c


_register = register_passkey


def _context_dir(c, cid: str) -> Path:
    return next(c.app.state.runtime.store.root.glob(f"*/{cid}"))


def _completion(c, cid: str):
    return c.post(f"/v1/contexts/{cid}/completions",
                  json={"question": QUESTION, "method": "full", "max_tokens": 6, "temperature": 0})


def test_swapped_chunk_answers_artifact_corrupt_then_reregistration_rebuilds(client):
    c = client
    cid = _register(c, 4711)
    first = ask(c, cid, max_tokens=6)
    kdir = _context_dir(c, cid) / "kv" / "k"
    _swap(kdir / "c/0/0/0/0", kdir / "c/1/0/0/0")

    r = _completion(c, cid)
    assert r.status_code == 500 and r.json()["error"]["code"] == "artifact_corrupt", r.text
    rec = c.get(f"/v1/contexts/{cid}").json()
    assert rec["status"] == "failed" and rec["error"]["code"] == "artifact_corrupt"
    r = _completion(c, cid)
    assert r.status_code == 409 and r.json()["error"]["code"] == "context_not_ready"

    # registering it again must rebuild it, not mark it ready from the manifest whose chunks fail
    r = c.post("/v1/contexts", json={"text": passkey_document(4711, n_rep=4)})
    assert r.status_code == 202 and r.json()["created"] is True
    assert wait_ready(c, cid)["status"] == "ready"
    assert c.app.state.runtime.store.verify(_context_dir(c, cid).parent.name, PromptHash(cid)) == []
    again = ask(c, cid, max_tokens=6)
    assert again["token_ids"] == first["token_ids"]


def test_chunks_deleted_after_first_use_under_an_evicting_tier_are_an_error(client):
    c = client
    cid = _register(c, 2718)
    ask(c, cid, max_tokens=4)  # first use: the handle is opened and cached by the decode worker
    vdir = _context_dir(c, cid) / "kv" / "v"
    for layer in (3, 7):
        for f in (vdir / "c" / str(layer)).rglob("*"):
            if f.is_file():
                f.unlink()
    r = _completion(c, cid)
    assert r.status_code == 500 and r.json()["error"]["code"] == "artifact_corrupt", r.text
    assert "missing" in r.json()["error"]["message"]


def test_fsck_finds_and_marks_a_damaged_context(client, tmp_path):
    c = client
    good, bad = _register(c, 1111), _register(c, 2222)
    chunk = _context_dir(c, bad) / "kv" / "k" / "c" / "5" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))

    # offline, straight from the data dir (no service): reports, exits 1
    res = CliRunner().invoke(cli_app, ["fsck", "--data-dir", str(tmp_path / "data")])
    assert res.exit_code == 1, res.output
    assert f"DAMAGED {bad}" in res.output and good not in res.output and "2 contexts checked" in res.output

    r = c.post("/v1/admin/fsck")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["checked"] == 2 and out["ok"] == 1
    assert [(d["id"], d["code"], d["marked"]) for d in out["damaged"]] == [(bad, "artifact_corrupt", True)]
    assert out["damaged"][0]["problems"] == ["kv/k/c/5/0/0/0: chunk data does not match its crc32c"]
    rec = c.get(f"/v1/contexts/{bad}").json()
    assert rec["status"] == "failed" and rec["error"]["code"] == "artifact_corrupt"
    assert c.get(f"/v1/contexts/{good}").json()["status"] == "ready"
    assert _completion(c, bad).status_code == 409
    assert _completion(c, good).status_code == 200

    # a ready record whose artifacts are gone is reported too
    shutil.rmtree(_context_dir(c, good))
    out = c.post("/v1/admin/fsck", params={"mark": "false"}).json()
    assert sorted((d["id"], d["code"], d["marked"]) for d in out["damaged"]) == sorted(
        [(bad, "artifact_corrupt", False), (good, "artifact_missing", False)])
    assert c.get(f"/v1/contexts/{good}").json()["status"] == "ready"  # mark=false changes nothing
