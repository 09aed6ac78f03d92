"""Offline SAAP training, once per LLM (`ctxcache train saap`): key k-means + query classifier f_q.

Not a sparse method (the leading underscore keeps method discovery from importing it); the method and
the trained-model format live in `indexer/saap.py`.

Pipeline (papers/saap.txt §4, App. A):
  1. corpus -> token windows: the built-in seeded corpus (`indexer/_saap_corpus.py`, self-generated,
     Apache-2.0) or every `*.txt` of `--corpus DIR`, tokenized like a registered context (chat
     prefix), cut into windows of `doc_tokens`, at most `n_docs` of them.
  2. capture: each window is prefilled once through the first max(layers) + 1 layers only (later
     layers cannot change earlier ones' Q/K), and its post-RoPE Q/K are cached on disk
     (`<out>/.captures/`, safetensors, `capture_dtype`), so an interrupted run does not prefill again.
  3. per layer (layer 0 is never trained: full attention) and KV head:
     * k-means (faiss.Kmeans, L2, `kmeans_iters` [10] iterations, seeded) over the de-RoPE'd keys of
       every window, the attention sink(s) (`sink_exclude` first tokens) left out;
     * f_q: Linear(D, hidden) -> BatchNorm -> ReLU -> Linear(hidden, C), trained with Adam on
       KL(A·H_k || f_q(Q)) -- torch's `KLDiv(input=log f_q(Q), target=A·H_k)`, the paper's Eq. 1 in
       torch's argument order: target A·H_k = the attention mass a query puts on each key bucket.
       Each step samples `batch` queries (any head of the GQA group, any eligible position) of one
       random window. Only long-range pairs count: a query at position p is trained on the softmax
       of its post-RoPE logits over keys j in [sink_exclude, p - min_distance] (the pairs closer
       than that are the decode's dense part), so only positions p >= sink_exclude + min_distance
       are sampled. The classifier's input is the de-RoPE'd query.
       `min_distance` is the paper's 1024 for windows of 8K tokens and more, scaled down for short
       corpora: min(1024, max(32, doc_tokens // 8)) -> 128 for 1K-token windows, 256 for 2K.
     * every KV head of a layer is trained at once (stacked weights, `bmm`), deterministic in `seed`
       (per-layer generators, so a resumed run equals an uninterrupted one).
     Each finished layer is checkpointed (`layer_XX.safetensors`, written to a temp name and renamed;
     its metadata holds the settings hash); a rerun with the same settings skips finished layers.
  4. `manifest.json` is written last (atomically): a model without it is "not trained".

Settings (`PRESETS`):
  * `full` (the paper's, adapted to this model): C = 1024 clusters, hidden 1024, 40,000 Adam steps
    of 1,000 queries at lr 1e-5, windows of 8,192 tokens (SmolLM2's maximum; the paper used 40
    prompts of 500K tokens), 40 windows, min_distance 1024, fp16 capture cache (~0.4 GB/window).
  * `small` (a few minutes on 2 CPU cores): C = 32, hidden 128, 300 steps of 256 queries at
    lr 1e-3, 4 windows of 1,024 tokens, min_distance 128, fp32 capture cache. With C = 32 the
    paper's ℓ = 32 probes every bucket: pass `nprobe` (e.g. 1-4) with such a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from decoder.rope import undo_rope
from indexer import _saap_corpus as corpus_mod
from indexer.saap import (
    BN_EPS,
    MANIFEST,
    MODEL_FORMAT,
    SaapModel,
    bucket_scores,
    default_model_dir,
    model_digest,
    nearest_centroid,
    sha256_file,
    tensors_sha256,
)

log = logging.getLogger("ctxcache.saap")

_FAISS_SERIAL_BELOW = 1 << 16  # as in indexer/kivf.py: OpenMP start-up costs more than a small k-means


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    clusters: int = Field(1024, ge=2, le=65536, description="C: k-means buckets per layer and KV head")
    kmeans_iters: int = Field(10, ge=1, le=200)
    hidden: int = Field(1024, ge=4, le=16384, description="f_q hidden width")
    steps: int = Field(40000, ge=1, le=10_000_000, description="Adam steps per layer")
    batch: int = Field(1000, ge=2, le=65536, description="queries per step (one window per step)")
    lr: float = Field(1e-5, gt=0, le=1.0)
    doc_tokens: int = Field(8192, ge=64, le=1 << 20, description="tokens per training window (capped at the model's positions)")
    n_docs: int = Field(40, ge=1, le=100_000, description="training windows (at most)")
    min_distance: int | None = Field(None, ge=1, description="long-range pair distance; None = min(1024, max(32, doc_tokens // 8))")
    sink_exclude: int = Field(1, ge=0, le=64, description="first tokens left out of k-means and targets (attention sinks)")
    layers: tuple[int, ...] | None = Field(None, description="layers to train (>= 1); None = 1..L-1")
    capture_dtype: Literal["float32", "float16"] = "float16"
    seed: int = Field(0, ge=0, le=2**31 - 1)

    def min_distance_for(self, doc_tokens: int) -> int:
        return self.min_distance if self.min_distance is not None else min(1024, max(32, doc_tokens // 8))


PRESETS: dict[str, dict] = {
    "full": {},
    "small": {"clusters": 32, "hidden": 128, "steps": 300, "batch": 256, "lr": 1e-3, "doc_tokens": 1024, "n_docs": 4,
              "capture_dtype": "float32"},
}


def settings_from(preset: str, **overrides) -> TrainSettings:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return TrainSettings(**{**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}})


# ---------------------------------------------------------------------------------------------
# Corpus -> token windows -> captured Q/K


def token_windows(lm, docs: list[tuple[str, str]], doc_tokens: int, n_docs: int) -> list[list[int]]:
    """Consecutive windows of `doc_tokens` tokens of each document (a last window under half of that
    is dropped), at most `n_docs` in all, in document order."""
    out: list[list[int]] = []
    for _, text in docs:
        ids = lm.context_ids(text)
        for s in range(0, len(ids), doc_tokens):
            w = ids[s:s + doc_tokens]
            if len(w) >= doc_tokens // 2:
                out.append(w)
            if len(out) == n_docs:
                return out
    return out


@contextmanager
def first_layers(model, n: int):
    """Run only the first `n` decoder layers (transformers' Llama loops over
    `layers[:config.num_hidden_layers]`). Mutates the model's config for the duration: training and
    tests own their model object; never use it on a model a server is decoding with."""
    cfg = model.config
    old = cfg.num_hidden_layers
    cfg.num_hidden_layers = n
    try:
        yield
    finally:
        cfg.num_hidden_layers = old


def capture_first_layers(lm, ids: list[int], n_layers: int):
    """Post-RoPE Q/K/V of the first `n_layers` layers: PrefillCapture with q/k/v sliced to them."""
    from decoder.prefill import prefill
    from indexer.base import PrefillCapture

    with first_layers(lm.model, n_layers):
        cap = prefill(lm, ids)
    return PrefillCapture(q=cap.q[:n_layers].clone(), k=cap.k[:n_layers].clone(), v=cap.v[:n_layers].clone(),
                          positions=cap.positions, spec=cap.spec)


def _ids_sha(windows: list[list[int]]) -> str:
    h = hashlib.sha256()
    for w in windows:
        h.update(np.asarray(w, dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _metadata(path: Path) -> dict[str, str] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001 - a torn or foreign file is simply not a valid checkpoint
        return None


def capture_corpus(lm, windows: list[list[int]], n_layers: int, cache: Path, dtype: str,
                   progress: bool = True) -> list[Path]:
    """Prefill every window (first `n_layers` layers) once; cache q [nl, H, N, D], k [nl, KVH, N, D]."""
    from tqdm import tqdm

    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    fp = lm.spec.fingerprint
    for i, ids in enumerate(tqdm(windows, desc="saap: capture corpus", unit="window", disable=not progress)):
        path = cache / f"window_{i:04d}.safetensors"
        key = {"fingerprint": fp, "ids_sha": _ids_sha([ids]), "dtype": dtype}
        meta = _metadata(path) if path.exists() else None
        if not (meta and all(meta.get(k) == v for k, v in key.items()) and int(meta.get("n_layers", 0)) >= n_layers):
            cap = capture_first_layers(lm, ids, n_layers)
            dt = getattr(torch, dtype)
            _atomic_save({"q": cap.q.to(dt), "k": cap.k.to(dt)}, path, {**key, "n_layers": str(n_layers)})
        paths.append(path)
    return paths


def _load_layer(path: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_slice("q")[layer].float(), f.get_slice("k")[layer].float()


# ---------------------------------------------------------------------------------------------
# k-means


def kmeans(x: torch.Tensor, c: int, iters: int, seed: int) -> torch.Tensor:
    """x [n, D] -> centroids [C, D] fp32 (faiss.Kmeans, L2, no subsampling)."""
    import faiss

    a = np.ascontiguousarray(x.float().numpy())
    km = faiss.Kmeans(a.shape[1], c, niter=iters, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=1 << 30)
    threads = faiss.omp_get_max_threads()
    if a.shape[0] < _FAISS_SERIAL_BELOW:
        faiss.omp_set_num_threads(1)
    try:
        km.train(a)
    finally:
        faiss.omp_set_num_threads(threads)
    return torch.from_numpy(km.centroids.copy())


# ---------------------------------------------------------------------------------------------
# The query classifier, one per KV head, all heads of a layer trained together


class StackedMLP(torch.nn.Module):
    """M independent f_q: Linear(D, Hd) -> BatchNorm1d(Hd) -> ReLU -> Linear(Hd, C), as stacked weights."""

    def __init__(self, m: int, d: int, hidden: int, c: int, gen: torch.Generator):
        super().__init__()

        def uniform(*shape, fan_in):  # nn.Linear's default init, from our generator
            bound = 1.0 / math.sqrt(fan_in)
            return torch.nn.Parameter((torch.rand(*shape, generator=gen) * 2 - 1) * bound)

        self.w1, self.b1 = uniform(m, hidden, d, fan_in=d), uniform(m, hidden, fan_in=d)
        self.bn_weight = torch.nn.Parameter(torch.ones(m, hidden))
        self.bn_bias = torch.nn.Parameter(torch.zeros(m, hidden))
        self.register_buffer("bn_mean", torch.zeros(m, hidden))
        self.register_buffer("bn_var", torch.ones(m, hidden))
        self.w2, self.b2 = uniform(m, c, hidden, fan_in=hidden), uniform(m, c, fan_in=hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, B, D] -> logits [M, B, C]; batch statistics (training), running ones updated (momentum 0.1)."""
        z = torch.baddbmm(self.b1[:, None, :], x, self.w1.transpose(1, 2))  # [M, B, Hd]
        mean = z.mean(1)
        var = z.var(1, unbiased=False)
        with torch.no_grad():
            b = z.shape[1]
            self.bn_mean.mul_(0.9).add_(0.1 * mean)
            self.bn_var.mul_(0.9).add_(0.1 * var * b / max(b - 1, 1))
        h = (z - mean[:, None]) / torch.sqrt(var[:, None] + BN_EPS) * self.bn_weight[:, None] + self.bn_bias[:, None]
        return torch.baddbmm(self.b2[:, None, :], torch.relu(h), self.w2.transpose(1, 2))

    def export(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in {**dict(self.named_parameters()), **dict(self.named_buffers())}.items()}


def _train_layer(qs, ks, kds, qds, cent, s: TrainSettings, min_dist: int, group: int, gen: torch.Generator,
                 on_step: Callable[[int, float], None] | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train the stacked f_q of one layer. qs/qds: per window [H, N, D] post-RoPE / de-RoPE'd
    queries; ks/kds: [KVH, N, D]; cent [KVH, C, D]. Returns (weights, loss per step)."""
    kvh, c, d = cent.shape
    assign = []
    for kd in kds:
        assign.append(nearest_centroid(kd, cent))  # [KVH, N]
    eligible = [torch.arange(s.sink_exclude + min_dist, k.shape[1]) for k in ks]
    usable = [i for i, e in enumerate(eligible) if len(e) > 0]
    if not usable:
        raise ValueError(f"no window is longer than sink_exclude + min_distance = {s.sink_exclude + min_dist} tokens")
    mlp = StackedMLP(kvh, d, s.hidden, c, gen)
    opt = torch.optim.Adam(mlp.parameters(), lr=s.lr)
    heads = torch.arange(kvh)[:, None] * group  # [KVH, 1]: first query head of each group
    scale = d ** -0.5
    losses = []
    for step in range(s.steps):
        w = usable[int(torch.randint(len(usable), (1,), generator=gen))]
        e = eligible[w]
        pick = torch.randint(group * len(e), (s.batch,), generator=gen)
        g, p = pick // len(e), e[pick % len(e)]  # [B] group member, position
        qh = heads + g[None, :]  # [KVH, B] query head index
        q_post = qs[w][qh, p[None, :].expand(kvh, -1)]  # [KVH, B, D]
        x = qds[w][qh, p[None, :].expand(kvh, -1)]
        n = ks[w].shape[1]
        with torch.no_grad():
            logit = torch.bmm(q_post, ks[w].transpose(1, 2)) * scale  # [KVH, B, N]
            j = torch.arange(n)
            ok = (j[None, :] >= s.sink_exclude) & (j[None, :] <= (p[:, None] - min_dist))  # [B, N] long-range pairs
            attn = torch.softmax(logit.masked_fill(~ok[None], float("-inf")), dim=-1)
            target = torch.zeros(kvh, s.batch, c).scatter_add_(2, assign[w][:, None, :].expand(kvh, s.batch, n), attn)
        logp = torch.log_softmax(mlp(x), dim=-1)
        # KL(target || f_q) per query (torch's kl_div(input=log f_q, target)), mean over the batch, summed over heads
        loss = torch.nn.functional.kl_div(logp, target, reduction="none").sum(-1).mean(-1).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item() / kvh)
        if on_step is not None:
            on_step(step, losses[-1])
    return mlp.export(), losses


# ---------------------------------------------------------------------------------------------
# Orchestration


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def train_saap(
    lm,
    settings: TrainSettings,
    *,
    out_dir: Path | None = None,
    data_dir: Path | str | None = None,
    corpus_dir: Path | None = None,
    keep_cache: bool = False,
    progress: bool = True,
    on_progress: Callable[[dict], None] | None = None,
) -> Path:
    """Train (or resume training) a SAAP model for `lm`; return the directory holding its manifest.

    `on_progress(event)` is called after the corpus capture and after each layer, with `phase`
    ("capture" / "layer"), `layers_done`, `layers_total` and, for a layer, `layer` and its stats (the
    service's training jobs report these)."""
    report = on_progress or (lambda event: None)
    from tqdm import tqdm

    spec = lm.spec
    t_start = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else default_model_dir(spec.fingerprint, data_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted(set(settings.layers)) if settings.layers else list(range(1, spec.num_layers))
    bad = [x for x in layers if not 1 <= x < spec.num_layers]
    if bad:
        raise ValueError(f"layers must be in [1, {spec.num_layers - 1}] (layer 0 runs full attention); got {bad}")
    doc_tokens = min(settings.doc_tokens, spec.max_positions)
    min_dist = settings.min_distance_for(doc_tokens)

    if corpus_dir is None:
        n_words = math.ceil(doc_tokens * 0.75) + 50  # the generator's prose is ~1.7 tokens per word
        docs = corpus_mod.builtin_corpus(settings.n_docs, n_words)
        source = "builtin"
    else:
        docs = corpus_mod.read_corpus_dir(Path(corpus_dir))
        source = str(Path(corpus_dir).resolve())
    windows = token_windows(lm, docs, doc_tokens, settings.n_docs)
    if not windows:
        raise ValueError(f"the corpus yields no window of at least {doc_tokens // 2} tokens")
    corpus = {**corpus_mod.describe(docs, "builtin" if corpus_dir is None else "directory"), "path": source,
              "windows": len(windows), "tokens": sum(map(len, windows)), "ids_sha256": _ids_sha(windows)}
    resolved = {**settings.model_dump(), "layers": layers, "doc_tokens": doc_tokens, "min_distance": min_dist}
    s_hash = _hash({"format": MODEL_FORMAT, "settings": resolved, "fingerprint": spec.fingerprint,
                    "corpus": corpus["ids_sha256"]})

    old = out / MANIFEST
    if old.exists():
        m = json.loads(old.read_text())
        if m.get("settings_hash") == s_hash:
            log.info("saap: %s is already trained with these settings", out)
            return out
        old.unlink()  # retraining with other settings: the old model stops being "trained" now

    t0 = time.perf_counter()
    cache = out / ".captures"
    captures = capture_corpus(lm, windows, max(layers) + 1, cache, settings.capture_dtype, progress)
    capture_s = time.perf_counter() - t0
    report({"phase": "capture", "windows": len(windows), "layers_done": 0, "layers_total": len(layers)})

    d, kvh, group = spec.head_dim, spec.num_kv_heads, spec.group_size
    layer_meta: dict[str, dict] = {}
    bar = tqdm(layers, desc="saap: train layers", unit="layer", disable=not progress)
    for layer in bar:
        path = out / f"layer_{layer:02d}.safetensors"
        meta = _metadata(path) if path.exists() else None
        if meta and meta.get("settings_hash") == s_hash:
            from safetensors.torch import load_file

            layer_meta[str(layer)] = {**json.loads(meta["stats"]), "file": path.name, "sha256": sha256_file(path),
                                      "content_sha256": tensors_sha256(load_file(str(path))), "resumed": True}
            report({"phase": "layer", "layer": layer, "layers_done": len(layer_meta), "layers_total": len(layers),
                    "resumed": True})
            continue
        t_layer = time.perf_counter()
        qs, ks, qds, kds = [], [], [], []
        for cp in captures:
            q, k = _load_layer(cp, layer)  # [H, N, D], [KVH, N, D] post-RoPE
            pos = torch.arange(k.shape[1])
            qs.append(q)
            ks.append(k)
            qds.append(undo_rope(q, pos, spec.rope_theta))
            kds.append(undo_rope(k, pos, spec.rope_theta))
        cent = torch.empty(kvh, settings.clusters, d)
        balance = []
        for h in range(kvh):
            x = torch.cat([kd[h, settings.sink_exclude:] for kd in kds])
            if x.shape[0] < settings.clusters:
                raise ValueError(f"{x.shape[0]} training keys for {settings.clusters} clusters: use a larger corpus")
            cent[h] = kmeans(x, settings.clusters, settings.kmeans_iters, settings.seed + layer * kvh + h)
            sizes = torch.bincount(nearest_centroid(x[None], cent[h:h + 1])[0], minlength=settings.clusters).float()
            balance.append(round(float(sizes.max() / sizes.mean()), 3))
        kmeans_s = time.perf_counter() - t_layer
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + layer)
        weights, losses = _train_layer(
            qs, ks, kds, qds, cent, settings, min_dist, group, gen,
            on_step=(lambda i, v: i % 25 == 0 and bar.set_postfix(layer=layer, step=i, kl=f"{v:.3f}")) if progress else None,
        )
        head = max(1, min(20, len(losses) // 10))
        # only deterministic facts go into the file (its sha256 enters the digest); timings go to the manifest
        stats = {"kl_first": round(sum(losses[:head]) / head, 5), "kl_last": round(sum(losses[-head:]) / head, 5),
                 "balance_train": balance}
        tensors = {"centroids": cent, **weights}
        _atomic_save(tensors, path,
                     {"format": MODEL_FORMAT, "layer": str(layer), "settings_hash": s_hash, "stats": json.dumps(stats)})
        layer_meta[str(layer)] = {**stats, "kmeans_s": round(kmeans_s, 3),
                                  "train_s": round(time.perf_counter() - t_layer - kmeans_s, 3),
                                  "file": path.name, "sha256": sha256_file(path), "content_sha256": tensors_sha256(tensors)}
        del qs, ks, qds, kds
        report({"phase": "layer", "layer": layer, "layers_done": len(layer_meta), "layers_total": len(layers),
                "kl_first": stats["kl_first"], "kl_last": stats["kl_last"]})

    manifest = {
        "format": MODEL_FORMAT,
        "created_at": time.time(),
        "model": {"name": spec.name, "fingerprint": spec.fingerprint, "tokenizer_fingerprint": spec.tokenizer_fingerprint,
                  "num_layers": spec.num_layers, "num_heads": spec.num_heads, "num_kv_heads": kvh, "head_dim": d,
                  "rope_theta": spec.rope_theta, "rope_type": spec.rope_type},
        "settings": resolved,
        "settings_hash": s_hash,
        "corpus": corpus,
        "layers": layer_meta,
        "timings": {"capture_s": round(capture_s, 3), "total_s": round(time.perf_counter() - t_start, 3)},
        "digest": model_digest(s_hash, spec.fingerprint, {k: v["content_sha256"] for k, v in layer_meta.items()}),
    }
    tmp = out / f".tmp-{MANIFEST}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    if not keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# Evaluation on held-out Q/K: classifier vs centroid probing at the same selectivity


@torch.no_grad()
def bucket_mass_eval(model: SaapModel, layer: int, q: torch.Tensor, k: torch.Tensor, query_pos: torch.Tensor,
                     nprobe: int, recent: int, sink: int = 1) -> dict:
    """Attention mass beyond the dense part captured by the probed buckets, per method.

    q [H, N, D], k [KVH, N, D] post-RoPE (one layer of a held-out capture); query_pos [T].
    Mass = the group's attention (softmax over every visible key, averaged over the group's heads)
    on keys j in [sink, p - recent], normalized to its total there. `classifier`: the top-`nprobe`
    buckets of f_q (summed over the group), visiting V keys; `centroid`: buckets ranked by centroid
    similarity, taken in order until V keys (the last bucket pro rata), so both read the same number
    of keys; `oracle`: the `nprobe` buckets holding the most mass (same ℓ, not same selectivity).
    Returns means over KV heads and queries, and `selectivity` = V / keys in the range.
    """
    w = model.layer(layer)
    kvh, n, d = k.shape
    g = q.shape[0] // kvh
    c = w["centroids"].shape[1]
    l = min(nprobe, c)
    theta = model.rope_theta
    assign = nearest_centroid(undo_rope(k.float(), torch.arange(n), theta), w["centroids"], w["c_sq"])  # [KVH, N]
    qp = q[:, query_pos].float().reshape(kvh, g, len(query_pos), d)  # [KVH, G, T, D]
    t = len(query_pos)
    s = torch.einsum("hgtd,hnd->hgtn", qp, k.float()) * d ** -0.5
    j = torch.arange(n)
    s = s.masked_fill(j[None, None, None, :] > query_pos[None, None, :, None], float("-inf"))
    mass = torch.softmax(s, dim=-1).mean(1)  # [KVH, T, N]
    region = (j[None, :] >= sink) & (j[None, :] <= query_pos[:, None] - recent)  # [T, N]
    mass = mass * region[None]
    idx = assign[:, None, :].expand(kvh, t, n)
    bmass = torch.zeros(kvh, t, c).scatter_add_(2, idx, mass)
    bsize = torch.zeros(kvh, t, c).scatter_add_(2, idx, region[None].expand(kvh, t, n).float())
    total = bmass.sum(-1).clamp_min(1e-30)

    qd = undo_rope(qp, query_pos, theta)
    top = torch.topk(bucket_scores(qd, w, "classifier"), l, dim=-1).indices
    visited = bsize.gather(-1, top).sum(-1)  # [KVH, T]
    m_cls = bmass.gather(-1, top).sum(-1) / total

    order = torch.argsort(bucket_scores(qd, w, "centroid"), dim=-1, descending=True)
    sz, bm = bsize.gather(-1, order), bmass.gather(-1, order)
    cum = sz.cumsum(-1)
    whole = cum <= visited[..., None]
    nxt = whole.sum(-1, keepdim=True).clamp(max=c - 1)  # first bucket not taken whole
    left = (visited[..., None] - (cum - sz).gather(-1, nxt)).clamp_min(0)
    part = bm.gather(-1, nxt) * (left / sz.gather(-1, nxt).clamp_min(1)).clamp(max=1)
    part = torch.where(whole.all(-1, keepdim=True), torch.zeros_like(part), part)
    m_cen = ((bm * whole).sum(-1) + part[..., 0]) / total

    m_orc = torch.topk(bmass, l, dim=-1).values.sum(-1) / total
    valid = region.sum(-1)[None].expand(kvh, t) > 0
    sel = visited / region.sum(-1)[None].clamp_min(1)
    f = lambda x: float(x[valid].mean())  # noqa: E731
    return {"classifier": f(m_cls), "centroid": f(m_cen), "oracle": f(m_orc), "selectivity": f(sel),
            "nprobe": l, "queries": int(valid.sum())}
