"""decoder/pipeline.py: the build/open path the workers and the eval harness share, and the tiers
it reads through (storage/tier.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import natural_document
from decoder.generate import generate
from decoder.pipeline import ContextTiers, build_context, open_context
from indexer.base import get_method
from storage.artifacts import ContextStore
from storage.keys import IndexId, PromptHash

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def stored(lm, tmp_path_factory):
    """A 300-token context published with a kivf index, through build_context."""
    store = ContextStore(tmp_path_factory.mktemp("pipe") / "contexts")
    ids = lm.context_ids(natural_document(260))[:300]
    key = PromptHash.compute(lm.spec.fingerprint, lm.spec.tokenizer_fingerprint, ids)
    kivf = get_method("kivf")
    params = kivf.Params()
    index_id = kivf.index_id(params, lm.spec)
    res = build_context(lm, store, key, ids, {index_id: (kivf, params)}, manifest_extra={"display_name": "t"})
    assert index_id in res.manifest["indexes"] and res.manifest["n_tokens"] == 300 and set(res.built) == {index_id}
    return store, key, ids, index_id


def test_build_context_adds_indexes_to_a_published_context(stored, lm):
    store, key, ids, index_id = stored
    csattn = get_method("csattn")
    params = csattn.Params()
    cs_id = csattn.index_id(params, lm.spec)
    res = build_context(lm, store, key, ids, {cs_id: (csattn, params)})
    assert set(res.manifest["indexes"]) >= {index_id, cs_id}
    assert store.read_manifest(lm.spec.slug, key)["display_name"] == "t"  # the published manifest kept, extended


def test_build_context_keep_going_records_a_failing_index(lm, tmp_path):
    store = ContextStore(tmp_path / "contexts")
    ids = lm.context_ids(natural_document(60))[:64]
    key = PromptHash.compute(lm.spec.fingerprint, lm.spec.tokenizer_fingerprint, ids)
    bad = get_method("csattn")
    params = bad.Params(m=7)  # 7 does not divide head_dim 64: build raises
    res = build_context(lm, store, key, ids, {"csattn-x": (bad, params)}, keep_going=True)
    assert "csattn-x" in res.failed and store.exists(lm.spec.slug, key)
    with pytest.raises(ValueError):
        build_context(lm, ContextStore(tmp_path / "other"), key, ids, {"csattn-x": (bad, params)})


def test_open_context_reads_through_the_tiers_once(stored, lm):
    """Two requests on one context: the first loads every array from disk into the DRAM tier, the
    second is served by the tier (same tensor objects: nothing is copied per request or per step);
    index arrays come from the index the caller named."""
    store, key, ids, index_id = stored
    art = store.open(lm.spec.slug, key)
    tiers = ContextTiers(1 << 30)
    kivf = get_method("kivf")
    params = kivf.Params()
    q = lm.question_ids("Who validates the manifest?")
    seen = []
    for _ in range(2):
        o = open_context(art, key.hex, kivf, params, index_id, tiers=tiers, spec=lm.spec, max_local=len(q) + 4)
        assert o.backend.name == "torch_ref" and o.resident == torch.device("cpu")
        res = generate(lm, o.kv, o.planner, params, q, backend=o.backend, max_tokens=4)
        seen.append((o.loads, o.kv.layer(3)[0], res.token_ids))
    (first, k1, t1), (second, k2, t2) = seen
    assert first.misses.get("dram", 0) > 0 and not second.misses and second.hits["dram"] > 0
    assert k1 is k2 and t1 == t2
    snap = {t["tier"]: t for t in tiers.snapshot()}
    assert set(snap) == {"dram"} and snap["dram"]["bytes"] > 0 and snap["dram"]["hits"] >= second.hits["dram"]
    tiers.drop(key.hex)
    assert tiers.dram.nbytes == 0


def test_offload_backend_keeps_the_context_on_the_host(stored, lm):
    store, key, ids, index_id = stored
    art = store.open(lm.spec.slug, key)
    topk = get_method("topk")
    o = open_context(art, key.hex, topk, topk.Params(), None, tiers=ContextTiers(1 << 30), spec=lm.spec,
                     backend="offload")
    assert o.backend.host_arrays == {"kv/k", "kv/v"} and o.resident == torch.device("cpu") and o.kv_device == "cpu"


def _stored_psa_context(tmp_path):
    """(artifacts, key, psa, params, index_id, spec) of a synthetic 512-token context with a psa
    index (the model's weights do not travel to the GPU machine)."""
    from synthetic import smollm2_spec, structured_capture

    spec = smollm2_spec(layers=4)
    cap = structured_capture(spec, 512, "cpu")
    store = ContextStore(tmp_path / "contexts")
    ids = list(range(512))
    key = PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, ids)
    psa = get_method("psa")
    params = psa.Params()
    index_id = psa.index_id(params, spec)
    from storage.artifacts import IndexArrays

    arrays = psa.build(cap, params)
    store.publish(key, spec, ids, cap.k, cap.v,
                  [IndexArrays("psa", psa.version, params.build_params(), IndexId.from_string(index_id).params_hash, arrays)], {})
    return store.open(spec.slug, key), key, psa, params, index_id, spec


@pytest.mark.gpu
def test_gpu_tier_keeps_the_context_resident(tmp_path):
    """On a GPU worker the context's K/V and index arrays are copied to the device once: a second
    request reads them from the GPU tier (no DRAM or disk access), the same device tensors."""
    art, key, psa, params, index_id, spec = _stored_psa_context(tmp_path)
    tiers = ContextTiers(1 << 30, 1 << 30, "cuda")
    opened = [open_context(art, key.hex, psa, params, index_id, tiers=tiers, spec=spec) for _ in range(2)]
    k_a, k_b = opened[0].kv.layer(2)[0], opened[1].kv.layer(2)[0]
    assert k_a.is_cuda and k_a is k_b
    assert opened[1].loads.hits.get("gpu", 0) == 2 and not opened[1].loads.misses  # K and V of layer 2
    assert opened[1].resident.type == "cuda"
    assert opened[1].load(f"indexes/{index_id}/block_meta", 2).is_cuda  # index arrays: the GPU tier too


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["offload", "offload_v"])
def test_gpu_offload_maps_the_pinned_dram_copy(tmp_path, backend):
    """The offload backends on a GPU worker: the context arrays they keep in host memory come back
    as CUDA views of the DRAM tier's pinned tensors (same bytes, nothing copied, nothing in the GPU
    tier), the rest (index arrays; offload_v's keys) from the GPU tier; a second request maps the
    same DRAM copy."""
    art, key, psa, params, index_id, spec = _stored_psa_context(tmp_path)
    tiers = ContextTiers(1 << 30, 1 << 30, "cuda")
    opened = [open_context(art, key.hex, psa, params, index_id, tiers=tiers, spec=spec, backend=backend)
              for _ in range(2)]
    host = opened[0].backend.host_arrays
    for name, t in zip(("kv/k", "kv/v"), opened[0].kv.layer(2)):
        assert t.is_cuda
        held, hit = tiers.dram.get((key.hex, name, 2), lambda: pytest.fail("not in the DRAM tier"))
        if name in host:
            assert held.is_pinned() and t.data_ptr() == held.data_ptr()
            torch.testing.assert_close(t.cpu(), art.read(name, 2))
        else:
            assert tiers.gpu.get((key.hex, name, 2), lambda: pytest.fail("not in the GPU tier"))[0] is t
    assert opened[1].kv.layer(2)[1].data_ptr() == opened[0].kv.layer(2)[1].data_ptr()
    assert opened[0].load(f"indexes/{index_id}/block_meta", 2).is_cuda
    assert opened[0].kv_device == ("cpu" if backend == "offload" else f"{tiers.device} (values: cpu)")
