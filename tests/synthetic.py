"""Synthetic stand-ins for the real model, for GPU tests and benchmarks that run where the model's
weights cannot travel (the device tool carries at most 64 MiB): model shapes without weights,
structured random captures, and a SAAP model written in its on-disk format.

Structured, not plain Gaussian: per KV head, de-RoPE'd keys and queries are an offset + one of
`comps` mixture centres (Zipf(0.8) weights) + noise, RoPE'd at their positions (what a capture
holds), so queries prefer the keys of their centre, k-means buckets have unequal sizes and sparse
selections mean something. Values are Gaussian."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from decoder.model import ModelSpec
from indexer.rope import apply_rope, undo_rope
from indexer.base import KVView, PrefillCapture


def model_spec(layers: int, heads: int, kv_heads: int, head_dim: int, theta: float, name: str) -> ModelSpec:
    return ModelSpec(name=name, fingerprint=hashlib.sha256(f"synthetic:{name}".encode()).hexdigest(),
                     tokenizer_fingerprint="-", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, max_positions=1 << 21, rope_theta=theta, rope_type="default", dtype="float32")


def smollm2_spec(layers: int = 30) -> ModelSpec:
    return model_spec(layers, 9, 3, 64, 100000.0, "synthetic-smollm2-135m")


def llama8b_spec(layers: int = 32) -> ModelSpec:
    return model_spec(layers, 32, 8, 128, 500000.0, "synthetic-llama-3.1-8b")


class Mixture:
    """Per KV head: de-RoPE'd vector = offset + centre[z] + noise, z ~ Zipf(0.8) over `comps` centres."""

    def __init__(self, spec: ModelSpec, device, seed: int = 0, comps: int = 512, noise: float = 0.5):
        g = torch.Generator(device=device).manual_seed(seed)
        kvh, d = spec.num_kv_heads, spec.head_dim
        self.spec, self.device, self.noise = spec, device, noise
        self.offset = torch.randn(kvh, 1, d, device=device, generator=g) * 1.5
        self.centres = torch.randn(kvh, comps, d, device=device, generator=g)
        w = 1.0 / torch.arange(1, comps + 1, device=device, dtype=torch.float64) ** 0.8
        self.weights = (w / w.sum()).float()

    def sample(self, n: int, g: torch.Generator, heads: int | None = None) -> torch.Tensor:
        """[heads, n, D] fp32 de-RoPE'd vectors; `heads` query heads use their KV head's centres."""
        kvh = self.spec.num_kv_heads
        heads = heads or kvh
        z = torch.multinomial(self.weights, heads * n, replacement=True, generator=g).view(heads, n)
        kv_of = torch.arange(heads, device=self.device) // (heads // kvh)
        c = self.centres[kv_of[:, None], z]
        return self.offset[kv_of] + c + self.noise * torch.randn(heads, n, self.spec.head_dim, device=self.device,
                                                                  generator=g)


def structured_capture(spec: ModelSpec, n: int, device, seed: int = 0, dtype=torch.float32,
                       mixture: Mixture | None = None) -> PrefillCapture:
    """A capture of every layer of `spec` over n tokens (each layer drawn independently)."""
    mix = mixture or Mixture(spec, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    pos = torch.arange(n, device=device)
    th = spec.rope_theta
    q = torch.stack([apply_rope(mix.sample(n, g, spec.num_heads), pos, th) for _ in range(spec.num_layers)])
    k = torch.stack([apply_rope(mix.sample(n, g), pos, th) for _ in range(spec.num_layers)])
    v = torch.randn(spec.num_layers, spec.num_kv_heads, n, spec.head_dim, device=device, generator=g)
    return PrefillCapture(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), positions=pos, spec=spec)


def write_saap_model(model_dir: Path, spec: ModelSpec, mixture: Mixture, layers: list[int], clusters: int = 64,
                     hidden: int = 128, sample: int = 8192) -> Path:
    """A SAAP model in `indexer/saap_model.py`'s format for `spec`, 'trained' on `layers`: k-means
    (`kmeans_torch`, 10 iterations) on de-RoPE'd keys of the mixture, the classifier at its random
    init (its outputs are arbitrary: this model is for shapes, syncs and timing, not quality)."""
    from safetensors.torch import save_file

    from indexer.clustering import kmeans_torch
    from indexer.saap_model import MANIFEST, MODEL_FORMAT, model_digest, sha256_file, tensors_sha256
    from training.classifier import StackedMLP

    model_dir.mkdir(parents=True, exist_ok=True)
    dev = mixture.device
    g = torch.Generator(device=dev).manual_seed(7)
    kvh, d = spec.num_kv_heads, spec.head_dim
    entries = {}
    for layer in layers:
        pos = torch.arange(sample, device=dev)
        kd = undo_rope(apply_rope(mixture.sample(sample, g), pos, spec.rope_theta), pos, spec.rope_theta)
        cent = torch.stack([kmeans_torch(kd[h], clusters, 10, 1000 * layer + h) for h in range(kvh)])
        mlp = StackedMLP(kvh, d, hidden, clusters, torch.Generator().manual_seed(layer))
        tensors = {"centroids": cent.cpu().contiguous(), **mlp.export(), "centroid_scale": torch.full((kvh,), d ** -0.5)}
        path = model_dir / f"layer_{layer:02d}.safetensors"
        save_file(tensors, str(path), metadata={"format": MODEL_FORMAT, "layer": str(layer)})
        entries[str(layer)] = {"file": path.name, "sha256": sha256_file(path), "content_sha256": tensors_sha256(tensors)}
    settings = {"clusters": clusters, "hidden": hidden, "kmeans_iters": 10, "layers": layers,
                "note": "tests/synthetic.py: k-means on synthetic keys, classifier at random init"}
    s_hash = hashlib.sha256(json.dumps({"format": MODEL_FORMAT, "settings": settings}, sort_keys=True).encode()).hexdigest()
    manifest = {
        "format": MODEL_FORMAT, "created_at": time.time(),
        "model": {"name": spec.name, "fingerprint": spec.fingerprint, "tokenizer_fingerprint": None,
                  "num_layers": spec.num_layers, "num_heads": spec.num_heads, "num_kv_heads": kvh, "head_dim": d,
                  "rope_theta": spec.rope_theta, "rope_type": "default"},
        "settings": settings, "settings_hash": s_hash, "layers": entries,
        "digest": model_digest(s_hash, spec.fingerprint, {k: v["content_sha256"] for k, v in entries.items()}),
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return model_dir


def decode_steps(seed: int, kvh: int, g: int, d: int, n: int, ts, ctx, device, *, m_cap: int = 16,
                 dtype=torch.float32, past: int = 0):
    """Random decode steps of one request over a context ctx = (keys, values) [KVH, N, D]: t query
    tokens per step (the last t of the request's m tokens so far), request-local rows in m_cap slots
    (slots past the request's tokens hold NaN: garbage a planner must not read). `past` > 0: the
    request is that much longer than its slots (every slot visible). Yields (q [KVH, G, t, D], KVView)."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    m = past
    for t in ts:
        m += t
        loc_k = torch.randn(kvh, m_cap, d, generator=gen).to(dtype)
        loc_v = torch.randn(kvh, m_cap, d, generator=gen).to(dtype)
        loc_k[:, m:] = float("nan")
        q = (torch.randn(kvh, g, t, d, generator=gen) * 1.5).to(dtype)
        ck, cv = ctx
        kv = KVView(ck.to(device), cv.to(device), loc_k.to(device), loc_v.to(device),
                    torch.arange(n + m - t, n + m, device=device))
        yield q.to(device), kv
