"""SAAP training's device choice (training/: `TrainSettings.device`; indexer/clustering.py: `kmeans_torch`).

The CPU tests run in CI; the GPU tests are marked `gpu` (skipped without CUDA, see conftest.py) and
run on the device tool (benchmarks/gpu_saap_train.py runs them there). The GPU decode test checks the
planner's CPU/GPU agreement and that its steps make no host sync. Training here uses a tiny
random-weight Llama (`random_lm`, a byte tokenizer): it needs no model download, so the same test
runs on a GPU machine that has no converted default model. k-means is compared with faiss on real
keys of the default model (`captured_2k`) and on synthetic data.
"""

from __future__ import annotations

import hashlib
import json

import pydantic
import pytest
import torch

from indexer.clustering import kmeans, kmeans_torch
from indexer.saap_model import SaapModel, bucket_scores
from indexer.selection import nearest_centroid
from training.capture import capture_first_layers
from training import loop
from training.loop import train_saap
from training.settings import TrainSettings, resolve_device, settings_from


class ByteTokenizer:
    """Text -> its UTF-8 bytes as token ids (vocab 256): enough for `LoadedModel.context_ids`."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode())}


def random_lm(*, layers: int = 4, hidden: int = 96, heads: int = 6, kv_heads: int = 2, head_dim: int = 16,
              intermediate: int = 128, vocab: int = 256, max_positions: int = 2048, rope_theta: float = 1e4,
              seed: int = 0, device: str = "cpu"):
    """A random-weight LlamaForCausalLM (fp32, the `ctxcache` attention that prefill captures
    through) wrapped as `decoder.model.LoadedModel`, with a byte tokenizer. Deterministic in `seed`
    (weights drawn on the CPU, then moved). benchmarks/gpu_saap_train.py builds SmolLM2-135M's
    shape with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention
    from decoder.model import LoadedModel, ModelSpec

    register_attention()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_positions, rope_theta=rope_theta, tie_word_embeddings=True)
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    model.to(device)
    fp = hashlib.sha256(json.dumps({"config": cfg.to_dict(), "seed": seed}, sort_keys=True, default=str).encode())
    spec = ModelSpec(name=f"random-llama-{layers}x{hidden}", fingerprint=fp.hexdigest(),
                     tokenizer_fingerprint="bytes", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, max_positions=max_positions, rope_theta=float(rope_theta), rope_type="default",
                     dtype="float32")
    return LoadedModel(spec=spec, tokenizer=ByteTokenizer(), model=model)


# 3 layers x 2 windows of 512 tokens x 60 steps: a few seconds on one CPU thread
TINY = {"layers": (1, 2, 3), "n_docs": 2, "doc_tokens": 512, "steps": 60, "clusters": 16, "hidden": 32, "batch": 96}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()  # 2 shared cores: 1 thread is the fastest (tests/test_saap.py)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _inertia(x: torch.Tensor, cent: torch.Tensor) -> float:
    return float(torch.cdist(x.double(), cent.double()).min(1).values.pow(2).sum())


# ---------------------------------------------------------------------------------------------


def test_device_setting_is_validated_and_not_part_of_the_identity(monkeypatch):
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert TrainSettings(device=good).device == good
    for bad in ("gpu", "CUDA", "cuda:", "cuda:x", "mps", ""):
        with pytest.raises(pydantic.ValidationError):
            TrainSettings(device=bad)
    with pytest.raises(pydantic.ValidationError):
        settings_from("small", device="tpu")
    # out of model_dump: the settings hash, the manifest's settings and the REST job id ignore it
    assert "device" not in settings_from("small", device="cpu").model_dump()
    assert settings_from("small", device="cpu").model_dump() == settings_from("small").model_dump()
    assert settings_from("small").device == "auto"
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda:0")


def test_cli_refuses_a_bad_device_before_loading_a_model(tmp_path):
    from typer.testing import CliRunner

    from service.cli import app

    res = CliRunner().invoke(app, ["train", "saap", "--preset", "small", "--device", "tpu", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "invalid settings" in res.output and "device" in res.output
    assert "--device" in CliRunner().invoke(app, ["train", "saap", "--help"]).output


def test_cpu_training_does_not_depend_on_step_batching_or_the_device_argument(tmp_path, monkeypatch):
    """Sampling is drawn `_PLAN_STEPS` steps at a time (one host-to-device copy per plan on a
    GPU): any plan size gives the model of the former one-step-at-a-time loop, bit for bit, and
    device="cpu" names the same model as the default (the device is no part of its settings hash).
    Both target paths (per-layer table, per-step targets) are covered."""
    lm = random_lm()
    digests = {}
    for table in (True, False):
        if not table:
            monkeypatch.setattr(loop, "_TABLE_BYTES", 0)
        for plan in (1, 7, 256):
            monkeypatch.setattr(loop, "_PLAN_STEPS", plan)
            out = train_saap(lm, settings_from("small", device="cpu", **TINY), out_dir=tmp_path / f"{table}-{plan}",
                             progress=False)
            m = json.loads((out / "manifest.json").read_text())
            assert m["trained_on"]["device"] == "cpu" and m["trained_on"]["kmeans"] == "faiss-cpu"
            assert "device" not in m["settings"] and m["layers"]["1"]["steps_s"] > 0
            digests[(table, plan)] = (m["digest"], m["settings_hash"])
        assert len({digests[(table, p)] for p in (1, 7, 256)}) == 1, digests
    # the two target paths agree to float noise, not bit for bit: same settings hash, other bytes
    assert digests[(True, 1)][1] == digests[(False, 1)][1]
    monkeypatch.setattr(loop, "_PLAN_STEPS", 256)
    if not torch.cuda.is_available():  # "auto" is the CPU here (_TABLE_BYTES is still 0: per-step targets)
        out = train_saap(lm, settings_from("small", **TINY), out_dir=tmp_path / "auto", progress=False)
        assert json.loads((out / "manifest.json").read_text())["digest"] == digests[(False, 1)][0]


def test_kmeans_torch_is_faiss_kmeans_on_cpu(captured_2k):
    """`kmeans_torch` (the GPU k-means when faiss has no GPU support) vs faiss.Kmeans, CPU, same
    seed: the same init and Lloyd steps. Measured here: on real de-RoPE'd keys of the default
    model (3 heads of layers 5 and 20, 2,047 keys each, C = 32) and on Gaussian data the centroids
    equal faiss's bit for bit; on a mixture with near-ties 0.998 of the points keep their bucket,
    inertia within 1.1e-5. Asserted: inertia within 1e-3, >= 99% same bucket."""
    from indexer.rope import undo_rope

    data = []
    for layer in (5, 20):
        kd = undo_rope(captured_2k.k[layer].float(), captured_2k.positions, captured_2k.spec.rope_theta)
        data += [(f"keys layer {layer} head {h}", kd[h, 1:], 32) for h in range(kd.shape[0])]
    g = torch.Generator().manual_seed(0)
    data.append(("gaussian", torch.randn(20000, 16, generator=g) * torch.rand(16, generator=g) * 3, 256))
    centers = torch.randn(64, 16, generator=g) * 5
    mix = centers[torch.randint(64, (20000,), generator=g)] + torch.randn(20000, 16, generator=g) * 0.3
    data.append(("mixture", mix, 256))
    for name, x, c in data:
        ref, got = kmeans(x, c, 10, 3), kmeans_torch(x, c, 10, 3)
        i_ref, i_got = _inertia(x, ref), _inertia(x, got)
        same = float((nearest_centroid(x[None], ref[None]) == nearest_centroid(x[None], got[None])).float().mean())
        print(f"{name}: inertia faiss {i_ref:.6g} torch {i_got:.6g} ({i_got / i_ref - 1:+.2e}), same bucket {same:.4f}, "
              f"equal centroids {torch.equal(ref, got)}")
        assert abs(i_got / i_ref - 1) < 1e-3 and same >= 0.99, name
        assert not torch.equal(ref, kmeans(x, c, 10, 4))  # the seed matters: the comparison is not vacuous


def test_kmeans_torch_splits_empty_clusters_as_faiss():
    """50 distinct points, 64 clusters: the seeded init draws duplicates, whose clusters are empty
    after the first assignment; faiss's `split_clusters` (its RandomGenerator(1234) picks the
    cluster to split, a 1/1024 perturbation pulls the two apart) gives every one a centroid.
    One iteration, where every distance is exact or an exact tie: equal to faiss's, bit for bit."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 8, generator=g)[torch.randint(50, (3000,), generator=g)]
    for seed in (0, 5):
        ref, got = kmeans(x, 64, 1, seed), kmeans_torch(x, 64, 1, seed)
        assert torch.equal(got, ref), seed
        assert len(torch.unique(got, dim=0)) == 64 and (got.abs().sum(1) > 0).all()  # no empty (zero) centroid left
    assert torch.equal(kmeans_torch(x[:64], 64, 5, 0), x[:64])  # n == C: faiss's corner case, the points


# ---------------------------------------------------------------------------------------------
# GPU (skipped on CPU CI with a reason, see conftest.py)


@pytest.mark.gpu
def test_gpu_training_matches_cpu(tmp_path):
    """The tiny model trained on cuda (capture, k-means, targets, Adam all on the GPU) vs on the
    CPU: the same settings hash; per layer, the keys' buckets under the two models' centroids agree
    (>= 0.95), the KL at the end agrees (10% relative), and the classifiers' top bucket for held-out
    queries agrees (>= 0.9). Only float rounding differs (GPU prefill, summation order, atomics).
    Measured on an H100 (2026-11-22, benchmarks/RESULTS_saap.md): agreement 1.0000 and 1.0000 in
    layers 1-3, kl_last equal to 5 decimals."""
    lm_cpu = random_lm()
    lm_gpu = random_lm(device="cuda")
    s = settings_from("small", **TINY)
    cpu = train_saap(lm_cpu, s.model_copy(update={"device": "cpu"}), out_dir=tmp_path / "cpu", progress=False)
    gpu = train_saap(lm_gpu, s.model_copy(update={"device": "cuda"}), out_dir=tmp_path / "gpu", progress=False)
    mc, mg = (json.loads((p / "manifest.json").read_text()) for p in (cpu, gpu))
    assert mc["settings_hash"] == mg["settings_hash"]
    assert mg["trained_on"]["device"].startswith("cuda") and mg["trained_on"]["capture_device"].startswith("cuda")
    assert mg["trained_on"]["kmeans"] in ("torch", "faiss-gpu")
    a, b = SaapModel.open(cpu), SaapModel.open(gpu)
    held = lm_cpu
    ids = held.context_ids("A held-out text about caches, queries and keys. " * 40)[:400]
    cap = capture_first_layers(held, ids, 4)
    from indexer.rope import undo_rope

    pos = torch.arange(len(ids))
    for layer in TINY["layers"]:
        wa, wb = a.layer(layer), b.layer(layer)
        kd = undo_rope(cap.k[layer], pos, held.spec.rope_theta)
        agree = float((nearest_centroid(kd, wa["centroids"]) == nearest_centroid(kd, wb["centroids"])).float().mean())
        qd = undo_rope(cap.q[layer, :, 200:], pos[200:], held.spec.rope_theta).reshape(2, 3, -1, 16)
        top = float((bucket_scores(qd, wa, "classifier").argmax(-1) == bucket_scores(qd, wb, "classifier").argmax(-1))
                    .float().mean())
        kl_c, kl_g = mc["layers"][str(layer)]["kl_last"], mg["layers"][str(layer)]["kl_last"]
        print(f"layer {layer}: bucket agreement {agree:.4f}, classifier top-1 agreement {top:.4f}, "
              f"kl_last cpu {kl_c} gpu {kl_g}")
        assert agree >= 0.95 and top >= 0.9 and abs(kl_g - kl_c) <= 0.1 * kl_c, layer


@pytest.mark.gpu
def test_gpu_decode_plans_like_cpu_without_host_sync(tmp_path):
    """saap's build on a GPU capture gives the CPU build's buckets; its planner with index and K/V
    on cuda (de-RoPE of the queries, f_q, bucket expansion to the fixed width, the selectivity
    table) plans what it plans on the CPU, makes no host sync after the first step (under
    `torch.cuda.set_sync_debug_mode("error")`), and `torch_ref` over the plan agrees: 40 decode
    steps after a 560-token context, every trained layer. f_q's scores differ by float rounding,
    so a near-tie between two buckets may flip: at least 95% of the (step, layer, KV head)
    attended sets equal, the mean Jaccard >= 0.99. The selectivity stats agree (1e-3).
    Before the plan/run redesign the same check (`select` + `merge_selection`, H100, 2026-11-22,
    benchmarks/RESULTS_saap.md) measured equal selections in 100% of (step, layer, KV head) and an
    output within 1.7e-07 of the CPU's; the plan/run form has not run on a GPU yet."""
    from decoder.backends import frame_mask, get_backend
    from evaluation.fidelity import truncate_capture
    from decoder.prefill import prefill
    from indexer.base import DecodeContext, IndexReader, KVView, get_method

    lm = random_lm()
    model_dir = train_saap(lm, settings_from("small", **TINY, device="cpu"), out_dir=tmp_path / "m", progress=False)
    cap = prefill(lm, lm.context_ids("Numbers like 12345 and words in a long line of text. " * 20)[:600])
    n_ctx, steps, kvh, g, d = 560, 40, 2, 3, 16
    m = get_method("saap")
    params = m.Params(nprobe=3, model_dir=str(model_dir))
    sink, window = params.frame(n_ctx)
    ctx = truncate_capture(cap, n_ctx)
    arrays = m.build(ctx, params)
    # the build on a capture that lives on the GPU: the same buckets (float ties aside), host arrays
    on_gpu = m.build(type(ctx)(q=ctx.q.cuda(), k=ctx.k.cuda(), v=ctx.v.cuda(), positions=ctx.positions.cuda(),
                               spec=ctx.spec), params)
    assert all(t.device.type == "cpu" for t in on_gpu.values())
    assert float((on_gpu["assign"] == arrays["assign"]).float().mean()) >= 0.999
    torch.testing.assert_close(on_gpu["balance"], arrays["balance"], atol=0.05, rtol=0)
    backend = get_backend("torch_ref")
    picked, outs, stats = {}, {}, {}
    for dev in ("cpu", "cuda"):
        resident = {name: t.to(dev) for name, t in arrays.items()}  # the decode worker's GPU tier
        index = IndexReader(lambda name, layer, r=resident: r[name][layer], sorted(resident))
        planner = m.open(index, params, DecodeContext(n_ctx, lm.spec, steps))
        k, v, q = cap.k.to(dev), cap.v.to(dev), cap.q.to(dev)
        loc_k = torch.zeros(cap.k.shape[0], kvh, steps, d, device=dev)  # a request buffer of fixed capacity
        loc_v = torch.zeros_like(loc_k)
        for i, pos in enumerate(range(n_ctx, n_ctx + steps)):
            loc_k[:, :, i], loc_v[:, :, i] = k[:, :, pos], v[:, :, pos]
            q_pos = torch.tensor([pos], device=dev)
            for layer in TINY["layers"]:
                qq = q[layer, :, pos:pos + 1].reshape(kvh, g, 1, d)
                kv = KVView(k[layer, :, :n_ctx], v[layer, :, :n_ctx], loc_k[layer], loc_v[layer], q_pos)
                if dev == "cuda" and i > 0:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    plan = planner.plan(layer, qq, kv)
                    out = backend.run(qq, kv, plan, sink, window, d ** -0.5)
                    planner.update(layer, loc_k[layer, :, i:i + 1], loc_v[layer, :, i:i + 1], q_pos)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                seen = frame_mask(plan, kv, sink, window, g).any(1)[:, 0].cpu()  # [KVH, N + M]
                picked[dev, pos, layer] = [set(seen[h].nonzero().flatten().tolist()) for h in range(kvh)]
                outs[dev, pos, layer] = out.cpu()
        planner.close()
        stats[dev] = planner.stats()
    same, jac, err = [], [], []
    for key in [x[1:] for x in picked if x[0] == "cpu"]:
        for a, b in zip(picked[("cpu", *key)], picked[("cuda", *key)]):
            same.append(a == b)
            jac.append(len(a & b) / len(a | b))
        if all(a == b for a, b in zip(picked[("cpu", *key)], picked[("cuda", *key)])):
            x, y = outs[("cuda", *key)], outs[("cpu", *key)]
            err.append(float((x - y).norm() / y.norm()))
    print(f"equal attended sets {sum(same) / len(same):.4f}, mean Jaccard {sum(jac) / len(jac):.4f}, "
          f"max rel. output error where equal {max(err):.2e}, selectivity cpu {stats['cpu']['selectivity_mean']} "
          f"cuda {stats['cuda']['selectivity_mean']}")
    assert sum(same) / len(same) >= 0.95 and sum(jac) / len(jac) >= 0.99 and max(err) < 1e-4
    assert len(stats["cuda"]["selectivity_per_step"]) == steps
    assert abs(stats["cuda"]["selectivity_mean"] - stats["cpu"]["selectivity_mean"]) < 1e-3
    assert 0 < sum(len(s) for s in picked[("cpu", n_ctx, 1)]) < kvh * (n_ctx + 1)  # sparse, not empty
