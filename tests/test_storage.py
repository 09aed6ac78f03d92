"""Storage: exact round trips (bf16 included), atomic publish, missing/corrupt chunk detection, DRAM tier."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from storage.artifacts import ArtifactCorrupt, ArtifactMissing, ContextStore, IndexArrays
from storage.keys import IndexId, PromptHash, TrainJobId, params_hash
from storage.tier import DramTier


@dataclass(frozen=True)
class _Spec:
    slug: str = "tiny-model-0123456789ab"

    def to_dict(self):
        return {"name": "tiny", "slug": self.slug}


def _publish(store, dtype=torch.float32, n=300, with_index=True):
    torch.manual_seed(0)
    k = torch.randn(2, 3, n, 8).to(dtype)
    v = torch.randn(2, 3, n, 8).to(dtype)
    tokens = list(range(n))
    key = PromptHash.compute("m" * 64, "t" * 64, tokens)
    idx = [IndexArrays("demo", 1, {"a": 1}, "0123456789abcdef", {"table": torch.arange(2 * 5).view(2, 5).int()})] if with_index else []
    manifest = store.publish(key, _Spec(), tokens, k, v, idx, {"timings": {"prefill_s": 1.0}})
    return key, k, v, manifest


def test_prompt_hash_is_typed_and_stable():
    a = PromptHash.compute("f" * 64, "t" * 64, [1, 2, 3])
    assert a == PromptHash.compute("f" * 64, "t" * 64, [1, 2, 3])
    assert a != PromptHash.compute("f" * 64, "t" * 64, [1, 2, 4])
    assert a != PromptHash.compute("e" * 64, "t" * 64, [1, 2, 3])
    assert PromptHash.from_string(a.to_string()) == a
    with pytest.raises(ValueError):
        PromptHash.from_string("not-a-hash")
    assert params_hash("x", 1, {"a": 1, "b": 2}) == params_hash("x", 1, {"b": 2, "a": 1})
    assert params_hash("x", 1, {"a": 1}) != params_hash("x", 2, {"a": 1})


@pytest.mark.parametrize("bad", ["", "a" * 63, "a" * 65, "A" * 64, "g" * 64, " " + "a" * 63, "a" * 64 + "\n", None, 7])
def test_ids_parse_only_what_they_print(bad):
    """Ids enter through `from_string` (a URL path, a queued job, a Redis key) and are checked there:
    64 lowercase hex digits, nothing else; `to_string` gives back the very string."""
    for cls in (PromptHash, TrainJobId):
        good = cls.from_string("0123456789abcdef" * 4)
        assert good.to_string() == "0123456789abcdef" * 4 == str(good)
        assert cls.from_string(good.to_string()) == good
        with pytest.raises(ValueError):
            cls.from_string(bad)
    assert PromptHash("a" * 64) != TrainJobId("a" * 64)  # a context id is not a job id


def test_index_id_round_trip_and_rejects_malformed():
    pid = params_hash("psa", 1, {"block_size": 64})
    iid = IndexId.from_string(f"psa-{pid}")
    assert (iid.method, iid.params_hash) == ("psa", pid) and iid.to_string() == f"psa-{pid}"
    assert IndexId.from_string(iid.to_string()) == iid == IndexId("psa", pid)
    for bad in ("psa", f"psa{pid}", f"psa-{pid}0", f"psa-{pid[:-1]}", f"-{pid}", f"Psa-{pid}", f"psa-{pid.upper()}", f"psa-{pid}\n", None):
        with pytest.raises(ValueError):
            IndexId.from_string(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    store = ContextStore(tmp_path)
    key, k, v, manifest = _publish(store, dtype)
    art = store.open(_Spec.slug, key)
    for layer in range(2):
        got_k, got_v = art.read("kv/k", layer), art.read("kv/v", layer)
        assert got_k.dtype == dtype
        assert torch.equal(got_k.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                           k[layer].contiguous().view(torch.uint8 if dtype != torch.float32 else torch.int32))
        assert torch.equal(got_v, v[layer])
    assert manifest["arrays"]["kv/k"]["dtype"] == str(dtype).removeprefix("torch.")
    assert art.read("tokens").tolist() == list(range(300))
    assert torch.equal(art.read("indexes/demo-0123456789abcdef/table", 1), torch.arange(5, 10).int())


def test_crash_during_write_leaves_nothing_published(tmp_path, monkeypatch):
    store = ContextStore(tmp_path)
    real = ContextStore._write_array

    def failing(self, group, name, t, chunks):
        if name == "kv/v":
            raise OSError("disk full (simulated)")
        return real(self, group, name, t, chunks)

    monkeypatch.setattr(ContextStore, "_write_array", failing)
    with pytest.raises(OSError):
        _publish(store)
    tokens = list(range(300))
    key = PromptHash.compute("m" * 64, "t" * 64, tokens)
    assert not store.exists(_Spec.slug, key)
    assert list((tmp_path / _Spec.slug).iterdir()) == []  # temp folder removed too
    with pytest.raises(ArtifactMissing):
        store.open(_Spec.slug, key)
    monkeypatch.setattr(ContextStore, "_write_array", real)
    key2, *_ = _publish(store)  # a retry succeeds
    assert key2 == key and store.exists(_Spec.slug, key)


def test_missing_chunk_is_reported_not_read_as_zeros(tmp_path):
    store = ContextStore(tmp_path)
    key, *_ = _publish(store)
    ctx = store.context_dir(_Spec.slug, key)
    chunk = ctx / "kv" / "k" / "c" / "1" / "2" / "0" / "0"
    assert chunk.exists()
    os.remove(chunk)
    with pytest.raises(ArtifactCorrupt, match="missing"):
        store.open(_Spec.slug, key).read("kv/k", 1)


def test_corrupt_chunk_is_detected(tmp_path):
    store = ContextStore(tmp_path)
    key, *_ = _publish(store)
    chunk = store.context_dir(_Spec.slug, key) / "kv" / "v" / "c" / "0" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(ArtifactCorrupt):
        store.open(_Spec.slug, key).read("kv/v", 0)


def test_corrupt_manifest_and_gc(tmp_path):
    store = ContextStore(tmp_path)
    key, *_ = _publish(store)
    (store.context_dir(_Spec.slug, key) / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactCorrupt):
        store.open(_Spec.slug, key)
    stale = tmp_path / _Spec.slug / ".tmp-deadbeef-00000000"
    stale.mkdir()
    os.utime(stale, (0, 0))
    assert store.gc_temp(older_than_s=60) == 1 and not stale.exists()


def test_add_indexes_and_delete(tmp_path):
    store = ContextStore(tmp_path)
    key, *_ = _publish(store, with_index=False)
    extra = IndexArrays("other", 1, {}, "fedcba9876543210", {"t": torch.ones(2, 4)})
    manifest = store.add_indexes(_Spec.slug, key, [extra])
    assert "other-fedcba9876543210" in manifest["indexes"]
    assert torch.equal(store.open(_Spec.slug, key).read("indexes/other-fedcba9876543210/t", 0), torch.ones(4))
    assert [m["prompt_hash"] for _, m in store.iter_manifests()] == [key.hex]
    assert store.delete(_Spec.slug, key)
    assert not store.context_dir(_Spec.slug, key).exists()
    assert list(store.iter_manifests()) == []


def test_dram_tier_is_lru_by_bytes():
    tier = DramTier(capacity_bytes=3 * 400)  # three 100-float tensors
    loads = []

    def loader(i):
        def f():
            loads.append(i)
            return torch.full((100,), float(i))
        return f

    for i in range(3):
        t, hit = tier.get(("c", "a", i), loader(i))
        assert not hit and t[0] == i
    assert tier.get(("c", "a", 0), loader(0))[1] is True  # 0 is now most recent
    tier.get(("c", "a", 3), loader(3))  # evicts 1 (least recent)
    assert not tier.contains(("c", "a", 1)) and tier.contains(("c", "a", 0))
    assert tier.nbytes <= tier.capacity
    assert tier.drop("c") == tier.capacity and len(tier) == 0
    big, hit = tier.get(("c", "big", 0), lambda: torch.zeros(1000))
    assert not hit and len(tier) == 0  # larger than the whole tier: served, not cached


def test_tier_reservations_shrink_the_room_for_cached_entries():
    """`reserve` counts bytes the tier does not cache (a running request's own GPU buffers): the least
    recent entries are evicted to make room, nothing is cached past the capacity, a key's new
    reservation replaces its old one, and `release` gives the room back."""
    tier = DramTier(capacity_bytes=3 * 400)  # three 100-float tensors
    for i in range(3):
        tier.get(("c", "a", i), lambda i=i: torch.full((100,), float(i)))
    tier.reserve(("request", 1), 400)
    assert not tier.contains(("c", "a", 0)) and tier.contains(("c", "a", 1)) and tier.nbytes == 800
    tier.reserve(("request", 1), 800)  # replaces the 400: 400 + 800 > 1200 evicts one more
    assert len(tier) == 1 and tier.reserved == 800 and tier.snapshot()["reserved_bytes"] == 800
    _, hit = tier.get(("c", "a", 9), lambda: torch.zeros(200))  # 800 B: no room beside the reservation
    assert not hit and not tier.contains(("c", "a", 9)) and tier.nbytes + tier.reserved <= tier.capacity
    tier.reserve(("request", 2), 2000)  # past the capacity: everything cached goes, the reservation stays
    assert len(tier) == 0 and tier.reserved == 2800
    assert tier.get(("c", "a", 1), lambda: torch.ones(100))[1] is False and len(tier) == 0
    tier.release(("request", 2))
    tier.release(("request", 2))  # twice: nothing more
    tier.release(("request", 1))
    assert tier.reserved == 0
    tier.get(("c", "a", 1), lambda: torch.ones(100))
    assert tier.contains(("c", "a", 1))
