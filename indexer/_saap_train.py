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
     * k-means (faiss.Kmeans, L2, `kmeans_iters` [10] iterations, seeded; on a GPU see "Device")
       over the de-RoPE'd keys of every window, the attention sink(s) (`sink_exclude` first tokens)
       left out;
     * f_q: Linear(D, hidden) -> BatchNorm -> ReLU -> Linear(hidden, C), plus (`residual`, default)
       the centroid-similarity logits q'·c / sqrt(D), trained with Adam on KL(target || f_q(Q)) --
       torch's `KLDiv(input=log f_q(Q), target)`, the paper's Eq. 1 in torch's argument order. The
       classifier's input q' is the de-RoPE'd query. Only long-range pairs count: keys j in
       [sink_exclude, p - min_distance] for a query at position p (the pairs closer than that are
       the decode's dense part), so only positions p >= sink_exclude + min_distance are sampled,
       and only long-range *queries* (`query_filter="far_top1"`, the paper's §4: "we discard all
       queries whose distance to the top-1 matching key is less than 1024 tokens"; `far_top1`):
       a query whose largest q·k over keys sink..p lies at least min_distance back. With group
       targets a (KV head, position) row counts when one of the group's queries is long-range;
       positions with none in any KV head are not sampled, the others' rows are weighted 0/1 in
       the loss. The share kept is recorded per layer (`long_range_rows`; small preset 0.01-0.98).
       Each step samples `batch` queries of one random window (`long_range_target` has the targets;
       `_train_layer` computes them once per layer when they fit in memory).
     * every KV head of a layer is trained at once (stacked weights, `bmm`), deterministic in `seed`
       (per-layer generators, so a resumed run equals an uninterrupted one).
     Each finished layer is checkpointed (`layer_XX.safetensors`, written to a temp name and renamed;
     its metadata holds the settings hash); a rerun with the same settings skips finished layers.
  4. `manifest.json` is written last (atomically): a model without it is "not trained".

Deviations from the paper (defaults; `settings_from(preset, **PAPER)` trains the paper's form:
`target="query_mass", residual=False`, with its query filter). They came from measuring why the
paper's form lost to plain centroid probing in layers 12-29 of SmolLM2-135M, then why a model that
won on attention mass missed the passkey (benchmarks/RESULTS_saap.md):
  * `target="group_mass"` instead of Eq. 1's per-query mass (`query_mass`, see
    `long_range_target`). (a) The decode ranks buckets by the *sum over the GQA group* of f_q's
    outputs (paper §5), but Eq. 1 trains each head on its own attention normalized over the
    long-range keys, so a head that puts 1% of its attention there (deep layers have many sink /
    local heads next to retrieval heads in one group) counts as much as one that puts 90%. The
    group targets use each head's attention over all visible keys (its long-range part only) and
    average over the group, and the loss is taken on the group's mean output: what the decode
    ranks. `group_density` (the default until the passkey check) also divides each bucket's mass by
    its number of long-range keys, so f_q predicts attention *per key* and top-ℓ reads fewer keys
    for the same mass: it wins more on held-out prose (ℓ = 2: 27/29 layers vs 25/29) but misses
    the passkey at every ℓ up to 8 (the needle's ~10 digit tokens share buckets with filler, whose
    density is low); `group_mass` with the query filter finds 6/6 at ℓ = 4.
  * `residual`: f_q's logits = q'·c / sqrt(D) + MLP(q'), the MLP's output layer initialized to 0,
    so the untrained classifier *is* centroid probing and training moves away from it only where
    the corpus says so. (The paper's App. E.1 found a residual *MLP* no better; this is a
    different residual: onto the k-means baseline.) Stored as the layer's `centroid_scale`.
  * `min_distance` (None) = the decode's dense part for a context of one window
    (`SaapParams.recent_for(doc_tokens)`: 32 for windows up to 2K tokens, 64 at 4K, 128 at 8K).
    Keys between the dense part and min_distance are probed through buckets at decode, so training
    must cover them (on the held-out document, 20-57% of the attention mass beyond a 32-token dense
    part lay 32-128 tokens back in the sampled layers 12-29: the former min_distance of 128 never
    trained on it). The `full` preset keeps the paper's 1024.

Settings (`PRESETS`):
  * `full` (the paper's sizes, adapted to this model): C = 1024 clusters, hidden 1024, 40,000 Adam
    steps of 1,000 queries at lr 1e-5, windows of 8,192 tokens (SmolLM2's maximum; the paper used
    40 prompts of 500K tokens), 40 windows, min_distance 1024, fp16 capture cache (~0.4 GB/window).
    Meant for a GPU: ~0.9 h on one H100 (SmolLM2-135M's shape; capture, 1 layer with every step and
    3 with 4,000 measured, 29 layers extrapolated), ~36 h on that machine's 16 CPU cores and
    ~385 h on 2 (estimates; benchmarks/RESULTS_saap.md, "Training on a GPU").
  * `small` (a few minutes at 1 CPU thread): C = 32, hidden 128, 300 steps of 256 queries
    (85 positions x 3 heads) at lr 1e-3, 4 windows of 2,048 tokens, min_distance 32, fp32 capture
    cache. With C = 32 the paper's ℓ = 32 probes every bucket: pass `nprobe` (e.g. 1-4) with such
    a model.

Device (`TrainSettings.device`: "auto" [default] = cuda when torch sees a GPU, else cpu; "cpu";
"cuda" or "cuda:N"; `ctxcache train saap --device`):
  * the corpus capture runs where `lm.model` already is: training never moves a model (a server may
    be decoding with it). `ctxcache train saap` loads the model on the training device; the
    service's train worker loads its own copy of the weights on the service's `device` setting;
  * each layer's captured Q/K are de-RoPE'd on the host (the CPU run's bytes) and moved to the
    device, where the k-means, the bucket assignment, the targets and the classifier's Adam steps
    (torch's fused Adam on a GPU) run. The initialization and the sampled positions come from CPU
    generators, drawn `_PLAN_STEPS` steps at a time in the order of the former one-step loop: the
    same on every device and for any plan size;
  * k-means: faiss-cpu on the CPU; on a GPU, faiss.Kmeans(gpu=True) when faiss has GPU support
    (faiss-gpu), else `kmeans_torch`, faiss's algorithm in torch with faiss's own random numbers
    (faiss-gpu wheels need CUDA 12 libraries, which a CUDA 13 torch does not bring);
  * the per-layer target table may take `_TABLE_BYTES_CUDA` (16 GiB, at most half the free memory)
    on a GPU against 1 GiB of host memory, so the full preset's ~3.5 GB table is computed once per
    layer there, and per step on the CPU (both give the same targets up to float rounding);
  * losses are read back every `_PLAN_STEPS` steps (no synchronization per step).
  The device is not part of the trained model's identity: `exclude=True` keeps it out of the
  settings hash, of the manifest's settings and of the REST job id, so a resumed run may mix layers
  trained on either. A GPU run gives the CPU run's model up to float rounding (GPU prefill,
  summation order, CUDA atomics), not its bytes, and two GPU runs may differ in the same way
  (tests/test_saap_device.py: bucket and classifier agreement on a tiny model; measured 1.0). The
  manifest's `trained_on` records the device, the capture device, the k-means backend and versions.
  On the CPU the device plumbing changes nothing: the same bytes (digests) as before it.
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

from indexer.rope import undo_rope
from indexer import _saap_corpus as corpus_mod
from indexer.saap import SaapParams
from indexer.saap_model import (
    BN_EPS,
    MANIFEST,
    MODEL_FORMAT,
    SaapModel,
    bucket_scores,
    default_model_dir,
    model_digest,
    sha256_file,
    tensors_sha256,
)
from indexer.selection import nearest_centroid

log = logging.getLogger("ctxcache.saap")

_FAISS_SERIAL_BELOW = 1 << 16  # as in indexer/kivf.py: OpenMP start-up costs more than a small k-means
_TABLE_BYTES = 1 << 30  # f_q targets are precomputed per layer up to this size (see `_train_layer`), host memory
_TABLE_BYTES_CUDA = 16 << 30  # the same on a GPU (also at most half its free memory): the full preset's ~3.5 GB fits
_PLAN_STEPS = 256  # steps whose samples are drawn at once (one host-to-device copy, one loss read-back)
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"  # as the service's `device` setting


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    clusters: int = Field(1024, ge=2, le=65536, description="C: k-means buckets per layer and KV head")
    kmeans_iters: int = Field(10, ge=1, le=200)
    hidden: int = Field(1024, ge=4, le=16384, description="f_q hidden width")
    steps: int = Field(40000, ge=1, le=10_000_000, description="Adam steps per layer")
    batch: int = Field(1000, ge=2, le=65536, description="queries per step (one window per step; group targets: "
                                                       "batch // G positions x the G heads of each group)")
    lr: float = Field(1e-5, gt=0, le=1.0)
    doc_tokens: int = Field(8192, ge=64, le=1 << 20, description="tokens per training window (capped at the model's positions)")
    n_docs: int = Field(40, ge=1, le=100_000, description="training windows (at most)")
    min_distance: int | None = Field(
        None, ge=1, description="long-range pair distance; None = the decode's dense part (SaapParams.recent_for) "
                                "for a context of one window: min(2047, max(32, doc_tokens // 64))")
    sink_exclude: int = Field(1, ge=0, le=64, description="first tokens left out of k-means and targets (attention sinks)")
    layers: tuple[int, ...] | None = Field(None, description="layers to train (>= 1); None = 1..L-1")
    capture_dtype: Literal["float32", "float16"] = "float16"
    seed: int = Field(0, ge=0, le=2**31 - 1)
    target: Literal["group_mass", "group_density", "query_mass"] = Field(
        "group_mass", description="f_q's training target; `query_mass` is the paper's Eq. 1 (see the module docstring)")
    query_filter: Literal["far_top1", "all"] = Field(
        "far_top1", description="queries f_q trains on: `far_top1` = the paper's long-range queries (top-1 key at "
                                "least min_distance back; for group targets, one of the group's), `all` = every position")
    residual: bool = Field(
        True, description="f_q's logits = centroid similarity q'·c / sqrt(D) + MLP(q') (an untrained f_q is centroid "
                          "probing); False = the paper's plain MLP")
    # Where training computes; not part of the trained model's identity: `exclude=True` keeps it out
    # of model_dump(), so out of the settings hash, the manifest's settings and the REST job id (see
    # the module docstring, "Device").
    device: str = Field("auto", pattern=DEVICE_PATTERN, exclude=True,
                        description="auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")

    def min_distance_for(self, doc_tokens: int) -> int:
        return self.min_distance if self.min_distance is not None else SaapParams().recent_for(doc_tokens)


PRESETS: dict[str, dict] = {
    "full": {"min_distance": 1024},
    "small": {"clusters": 32, "hidden": 128, "steps": 300, "batch": 256, "lr": 1e-3, "doc_tokens": 2048, "n_docs": 4,
              "capture_dtype": "float32"},
}
PAPER = {"target": "query_mass", "residual": False}  # settings_from(preset, **PAPER): the paper's f_q and Eq. 1


def resolve_device(device: str) -> torch.device:
    """A TrainSettings.device -> the torch device training computes on ("auto": cuda when available;
    "cuda" names the current CUDA device, with its index)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"training device {device!r}: torch sees no CUDA device here (use 'auto' or 'cpu')")
    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


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
                   progress: bool = True, stop: Callable[[], None] = lambda: None) -> list[Path]:
    """Prefill every window (first `n_layers` layers) once; cache q [nl, H, N, D], k [nl, KVH, N, D]."""
    from tqdm import tqdm

    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    fp = lm.spec.fingerprint
    for i, ids in enumerate(tqdm(windows, desc="saap: capture corpus", unit="window", disable=not progress)):
        stop()
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
    """x [n, D] -> centroids [C, D] fp32 on x's device (L2, no subsampling, seeded).

    * x on the CPU: faiss.Kmeans on the CPU (the reference; the only path before GPU training).
    * x on a GPU and faiss built with GPU support (faiss-gpu: `faiss.get_num_gpus() > 0`):
      faiss.Kmeans(gpu=True), the same algorithm with its distance search on the GPU(s).
    * x on a GPU and faiss-cpu: `kmeans_torch`, faiss's algorithm in torch on that GPU (faiss-gpu
      wheels need CUDA 12 libraries; a torch built for another CUDA cannot share them).
    """
    import faiss

    if x.device.type == "cuda" and faiss.get_num_gpus() == 0:
        return kmeans_torch(x, c, iters, seed)
    a = np.ascontiguousarray(x.float().cpu().numpy())
    gpu = x.device.type == "cuda"
    km = faiss.Kmeans(a.shape[1], c, niter=iters, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=1 << 30, **({"gpu": True} if gpu else {}))
    threads = faiss.omp_get_max_threads()
    if a.shape[0] < _FAISS_SERIAL_BELOW:
        faiss.omp_set_num_threads(1)
    try:
        km.train(a)
    finally:
        faiss.omp_set_num_threads(threads)
    return torch.from_numpy(km.centroids.copy()).to(x.device)


def kmeans_torch(x: torch.Tensor, c: int, iters: int, seed: int, chunk: int = 1 << 16) -> torch.Tensor:
    """faiss.Kmeans's algorithm (faiss/Clustering.cpp: `Clustering::train`, nredo 1, no subsampling)
    in torch, on x's device: x [n, D] -> centroids [C, D] fp32.

    Hand-written because faiss-cpu has no GPU code and faiss-gpu cannot be installed next to a torch
    built for another CUDA. It follows faiss step by step, with faiss's own random numbers:
      * init: the points perm[:C] of faiss's `rand_perm(n, seed + 1)` (called through faiss);
      * `iters` Lloyd iterations: each point to its nearest centroid in L2 (lowest index on ties),
        then each centroid = the mean of its points (sum x 1/count, as faiss);
      * empty clusters: faiss's `split_clusters`, with its `RandomGenerator(1234)` (through faiss):
        an empty cluster takes a copy of a large one drawn with probability (count - 1) / (n - C),
        the two pulled apart by a 1/1024 relative perturbation, and the count split in two.
    The same init and the same steps; the distances are faiss's formula for large inputs (its BLAS
    path ranks by |c|^2 - 2 x·c), summed in another order, so a point within float rounding of a
    tie between two centroids can take the other one (split pairs, or duplicated points, make such
    ties) and the runs drift apart from there. Measured (tests/test_saap_device.py, CPU): on real
    keys of the default model and on Gaussian data, faiss's centroids bit for bit; on a mixture with
    near-ties, 0.998 of the points in the same bucket, inertia +1.1e-5. On an H100 against faiss-cpu
    at the full preset's size (312,930 keys, C = 1024, benchmarks/gpu_saap_train.py): inertia
    within 5.6e-7, 40x faster than faiss on 16 cores.
    """
    import faiss

    n, d = x.shape
    if n < c:
        raise ValueError(f"k-means: {n} points for {c} clusters")
    x = x.float().contiguous()
    if n == c:  # faiss's corner case: the points are the centroids
        return x.clone()
    perm = np.empty(n, dtype=np.int32)
    faiss.rand_perm(faiss.swig_ptr(perm), n, seed + 1)
    cent = x[torch.from_numpy(perm[:c].astype(np.int64)).to(x.device)].clone()  # [C, D]
    assign = torch.empty(n, dtype=torch.long, device=x.device)
    for _ in range(iters):
        c_sq = (cent * cent).sum(1)
        for s0 in range(0, n, chunk):  # argmin_c |x - c|^2 = argmin_c |c|^2 - 2 x·c, [chunk, C] at a time
            assign[s0:s0 + chunk] = torch.addmm(c_sq[None], x[s0:s0 + chunk], cent.T, alpha=-2).argmin(1)
        count = torch.bincount(assign, minlength=c).float()  # faiss's `hassign`
        norm = torch.where(count > 0, 1 / count.clamp_min(1), 0.0)
        cent = torch.zeros(c, d, device=x.device).index_add_(0, assign, x) * norm[:, None]
        if bool((count == 0).any()):
            cent = _split_clusters(cent, count, n)
    return cent


def _split_clusters(cent: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """faiss's `split_clusters` (Clustering.cpp) on the host, float32 as there: a new centroid for
    every empty cluster, split off a large one. cent [C, D], count [C] -> cent."""
    import faiss

    cen = cent.cpu().numpy().copy()
    h = count.cpu().numpy().astype(np.float32)
    k, d = cen.shape
    rng = faiss.RandomGenerator(1234)
    eps = np.float32(1 / 1024)
    sign = np.where(np.arange(d) % 2 == 0, np.float32(1), np.float32(-1))
    grow, shrink = np.float32(1) + eps * sign, np.float32(1) - eps * sign  # even dims: ci up, cj down
    denom = float(np.float32(n - k))
    for ci in range(k):
        if h[ci] != 0:
            continue
        cj = 0
        while True:  # faiss: p = (hassign[cj] - 1.0) / (float)(n - k) in double, stored as a float
            p = np.float32((float(h[cj]) - 1.0) / denom)
            if np.float32(rng.rand_float()) < p:
                break
            cj = (cj + 1) % k
        cen[ci] = cen[cj]
        cen[ci] *= grow
        cen[cj] *= shrink
        h[ci] = h[cj] / np.float32(2)
        h[cj] -= h[ci]
    return torch.from_numpy(cen).to(cent.device)


# ---------------------------------------------------------------------------------------------
# The query classifier, one per KV head, all heads of a layer trained together


class StackedMLP(torch.nn.Module):
    """M independent f_q: Linear(D, Hd) -> BatchNorm1d(Hd) -> ReLU -> Linear(Hd, C), as stacked weights."""

    def __init__(self, m: int, d: int, hidden: int, c: int, gen: torch.Generator, zero_out: bool = False):
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
        if zero_out:  # residual f_q: starts as exactly its centroid-similarity term
            with torch.no_grad():
                self.w2.zero_()
                self.b2.zero_()

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
        """Weights and running statistics, copied to the CPU (fp32)."""
        return {k: v.detach().cpu().clone()
                for k, v in {**dict(self.named_parameters()), **dict(self.named_buffers())}.items()}


def long_range_target(q_post: torch.Tensor, k: torch.Tensor, assign: torch.Tensor, p: torch.Tensor, c: int,
                      min_dist: int, sink: int, group: int, target: str) -> torch.Tensor:
    """What f_q is trained to output, for queries q_post [KVH, B, D] (post-RoPE) at positions p [B] of
    one window with keys k [KVH, N, D] in buckets assign [KVH, N]. Long-range keys of position p:
    j in [sink, p - min_dist]. Returns [KVH, B, C] (`query_mass`) or [KVH, B // G, C] (group targets:
    the batch holds the G heads of each group at each position, consecutively), rows summing to 1.

    * `query_mass` (paper Eq. 1): the query's softmax over its long-range keys, summed per bucket.
    * `group_mass`: each head's softmax over every visible key (sink and recent keys included), its
      long-range part summed per bucket and averaged over the group's heads, normalized: a head that
      mostly attends to the sink or to recent tokens weighs little, as in the decode's attention.
    * `group_density`: `group_mass` per long-range key of the bucket (divided by its number of
      long-range keys): the mass a probe gains per key read, so top-ℓ picks the buckets that give
      the most attention per key visited instead of the largest ones.
    """
    kvh, b, d = q_post.shape
    n = k.shape[1]
    dev = k.device
    j = torch.arange(n, device=dev)
    far = (j[None, :] >= sink) & (j[None, :] <= p[:, None] - min_dist)  # [B, N] long-range pairs
    logit = torch.bmm(q_post, k.transpose(1, 2)) * d ** -0.5  # [KVH, B, N]
    idx = assign[:, None, :].expand(kvh, b, n)
    if target == "query_mass":
        attn = torch.softmax(logit.masked_fill(~far[None], float("-inf")), dim=-1)
        return torch.zeros(kvh, b, c, device=dev).scatter_add_(2, idx, attn)
    attn = torch.softmax(logit.masked_fill(j[None, None, :] > p[None, :, None], float("-inf")), dim=-1) * far[None]
    mass = torch.zeros(kvh, b, c, device=dev).scatter_add_(2, idx, attn)
    mass = mass.view(kvh, b // group, group, c).mean(2)  # [KVH, B/G, C]
    if target == "group_density":
        one = far[None, ::group].expand(kvh, -1, -1).float()  # [KVH, B/G, N]: one row per position
        size = torch.zeros(kvh, b // group, c, device=dev).scatter_add_(2, idx[:, ::group], one)
        mass = mass / size.clamp_min(1)
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def _gather(qs: torch.Tensor, p: torch.Tensor, g: torch.Tensor, group: int) -> torch.Tensor:
    """qs [H, N, D], positions p [B], group members g [B] -> [KVH, B, D] (query head kvh * G + g)."""
    kvh = qs.shape[0] // group
    qh = torch.arange(kvh, device=qs.device)[:, None] * group + g[None, :]
    return qs[qh, p[None, :].expand(kvh, -1)]


def _target_table(q: torch.Tensor, k: torch.Tensor, assign: torch.Tensor, e: torch.Tensor, c: int, min_dist: int,
                  sink: int, group: int, target: str, chunk: int = 128) -> torch.Tensor:
    """`long_range_target` of every position e [P] of one window, computed once: [KVH, P, C] (group
    targets) or [KVH, P, G, C] (`query_mass`). Chunks of positions only read the keys up to their last
    position (the later ones are masked anyway)."""
    out = []
    for s0 in range(0, len(e), chunk):
        p = e[s0:s0 + chunk].repeat_interleave(group)
        g = torch.arange(group, device=p.device).repeat(len(p) // group)
        top = int(p.max()) + 1
        t = long_range_target(_gather(q, p, g, group), k[:, :top], assign[:, :top], p, c, min_dist, sink, group, target)
        out.append(t if target != "query_mass" else t.view(t.shape[0], -1, group, c))
    return torch.cat(out, dim=1)


def far_top1(q: torch.Tensor, k: torch.Tensor, e: torch.Tensor, min_dist: int, sink: int, group: int,
             chunk: int = 128) -> torch.Tensor:
    """The paper's long-range queries (§4: "we discard all queries whose distance to the top-1
    matching key is less than 1024 tokens"): for queries q [H, N, D] and keys k [KVH, N, D]
    (post-RoPE, one window) at positions e [P], whether query head g of KV head h has its top-1 key
    (largest q·k over j in [sink, p]: the sinks are the decode's dense part) at distance >= min_dist.
    Returns [KVH, P, G] bool."""
    kvh, _, d = k.shape
    out = []
    for s0 in range(0, len(e), chunk):
        p = e[s0:s0 + chunk]
        top = int(p.max()) + 1
        logit = torch.einsum("hgbd,hnd->hgbn", q[:, p].view(kvh, group, len(p), d), k[:, :top])
        j = torch.arange(top, device=k.device)
        logit = logit.masked_fill((j[None, :] > p[:, None]) | (j[None, :] < sink), float("-inf"))
        out.append((logit.argmax(-1) <= (p - min_dist)[None, None, :]).permute(0, 2, 1))
    return torch.cat(out, dim=1)


def _sample_plan(gen: torch.Generator, steps: int, usable: list[int], n_eligible: list[int], per_query: bool,
                 batch: int, nb: int, group: int) -> tuple[list[int], torch.Tensor]:
    """The windows and raw picks of the next `steps` steps, drawn from `gen` in the order the
    training loop has always drawn them (so a model does not depend on how steps are batched):
    per step, the window, then `batch` picks in [0, G * |eligible|) (`query_mass`) or `nb` in
    [0, |eligible|) (group targets). Returns (window per step, picks [steps, batch or nb])."""
    ws, picks = [], []
    for _ in range(steps):
        w = usable[int(torch.randint(len(usable), (1,), generator=gen))]
        ws.append(w)
        if per_query:
            picks.append(torch.randint(group * n_eligible[w], (batch,), generator=gen))
        else:
            picks.append(torch.randint(n_eligible[w], (nb,), generator=gen))
    return ws, torch.stack(picks)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _table_budget(device: torch.device) -> int:
    """Bytes the per-layer target table may take: `_TABLE_BYTES` of host memory, or on a GPU
    `_TABLE_BYTES_CUDA`, at most half of its free memory."""
    if device.type != "cuda":
        return _TABLE_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return min(_TABLE_BYTES_CUDA, free // 2)


def _train_layer(qs, ks, kds, qds, cent, s: TrainSettings, min_dist: int, group: int, gen: torch.Generator,
                 on_step: Callable[[int, float], None] | None = None,
                 timings: dict | None = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train the stacked f_q of one layer. qs/qds: per window [H, N, D] post-RoPE / de-RoPE'd
    queries; ks/kds: [KVH, N, D]; cent [KVH, C, D]; all on the training device (that of `cent`).
    `gen` is a CPU generator: the initialization and the sampled positions are the same on every
    device. Returns (weights on the CPU, loss per step); fills `timings` (seconds: `assign_s`,
    `targets_s`, `steps_s`, and `table`: whether the target table was used) when given.

    The targets of every eligible position are computed once per layer when they fit in
    `_table_budget` (the small preset: 4 x 2K positions, each then sampled ~3 times; the full
    preset's ~3.5 GB on a GPU), else at each step for its batch only (the full preset on the CPU);
    both sample the same positions. Losses are read back (and `on_step` called) every
    `_PLAN_STEPS` steps, so a GPU is not synchronized at each step."""
    dev = cent.device
    kvh, c, d = cent.shape
    t0 = time.perf_counter()
    assign = []
    for kd in kds:
        assign.append(nearest_centroid(kd, cent))  # [KVH, N]
    eligible = [torch.arange(s.sink_exclude + min_dist, k.shape[1], device=dev) for k in ks]
    if not any(len(e) for e in eligible):
        raise ValueError(f"no window is longer than sink_exclude + min_distance = {s.sink_exclude + min_dist} tokens")
    per_query = s.target == "query_mass"
    row_weight = None  # query_filter "far_top1": per training row, 1 = long-range query (or group), 0 = left out
    n_rows = sum(len(e) for e in eligible) * kvh * (group if per_query else 1)
    if s.query_filter == "far_top1":
        with torch.no_grad():
            far = [far_top1(qs[i], ks[i], eligible[i], min_dist, s.sink_exclude, group) for i in range(len(ks))]
        keep = [f.any(2).any(0) for f in far]  # positions where some query of some KV head is long-range
        eligible = [e[m] for e, m in zip(eligible, keep)]
        # group targets: a (KV head, position) row counts when one of the group's queries is long-range
        row_weight = [(f[:, m] if per_query else f[:, m].any(2)).float() for f, m in zip(far, keep)]
    usable = [i for i, e in enumerate(eligible) if len(e) > 0]
    kept = sum(float(w.sum()) for w in row_weight) / n_rows if row_weight is not None else 1.0
    _sync(dev)
    t1 = time.perf_counter()
    table_bytes = sum(len(e) for e in eligible) * kvh * c * (group if per_query else 1) * 4
    tables = None
    if table_bytes <= _table_budget(dev):
        with torch.no_grad():
            tables = [_target_table(qs[i], ks[i], assign[i], eligible[i], c, min_dist, s.sink_exclude, group, s.target)
                      if i in usable else None for i in range(len(ks))]
    _sync(dev)
    t2 = time.perf_counter()
    mlp = StackedMLP(kvh, d, s.hidden, c, gen, zero_out=s.residual).to(dev)
    # one fused kernel for all parameters on a GPU; on the CPU torch's default (as before GPU training)
    opt = torch.optim.Adam(mlp.parameters(), lr=s.lr, **({"fused": True} if dev.type == "cuda" else {}))
    c_scale = d ** -0.5 if s.residual else 0.0  # weight of the centroid-similarity term in f_q's logits
    nb = max(1, s.batch // group)  # group targets: positions per step
    n_eligible = [len(e) for e in eligible]
    members = torch.arange(group, device=dev).repeat(nb)  # group targets: [0..G-1] at each position
    losses: list[float] = []
    # no long-range query at all in this layer's windows: f_q stays at its initialization (with
    # `residual`, centroid probing) and no step is taken
    for s0 in range(0, s.steps if usable else 0, _PLAN_STEPS):
        n_plan = min(_PLAN_STEPS, s.steps - s0)
        ws, picks = _sample_plan(gen, n_plan, usable, n_eligible, per_query, s.batch, nb, group)
        picks = picks.to(dev)
        loss_buf = torch.empty(n_plan, device=dev)
        for j, w in enumerate(ws):
            e = eligible[w]
            if per_query:
                g, i = picks[j] // len(e), picks[j] % len(e)  # [B] group member, index into e
            else:  # every head of the group at each sampled position: [p0 x G, p1 x G, ...]
                i, g = picks[j].repeat_interleave(group), members
            p = e[i]  # [B] positions
            x = _gather(qds[w], p, g, group)  # [KVH, B, D] de-RoPE'd: f_q's input
            if tables is not None:
                target = tables[w][:, i, g] if per_query else tables[w][:, i[::group]]
            else:
                with torch.no_grad():
                    target = long_range_target(_gather(qs[w], p, g, group), ks[w], assign[w], p, c, min_dist,
                                               s.sink_exclude, group, s.target)
            logits = mlp(x)  # [KVH, B, C]
            if c_scale:
                logits = logits + torch.einsum("hbd,hcd->hbc", x, cent) * c_scale
            logp = torch.log_softmax(logits, dim=-1)
            if not per_query:  # the group's f_q as the decode ranks it: the mean of its heads' outputs
                logp = torch.logsumexp(logp.view(kvh, nb, group, c), dim=2) - math.log(group)
            # KL(target || f_q) per row (torch's kl_div(input=log f_q, target)), mean over the batch
            # (over its long-range rows with the filter), summed over heads
            kl = torch.nn.functional.kl_div(logp, target, reduction="none").sum(-1)  # [KVH, B or nb]
            if row_weight is None:
                loss = kl.mean(-1).sum()
            else:
                wt = row_weight[w][:, i, g] if per_query else row_weight[w][:, i[::group]]
                loss = ((kl * wt).sum(-1) / wt.sum(-1).clamp_min(1)).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_buf[j] = loss.detach()
        for j, v in enumerate(loss_buf.tolist()):
            losses.append(v / kvh)
            if on_step is not None:
                on_step(s0 + j, losses[-1])
    if timings is not None:
        timings.update(assign_s=t1 - t0, targets_s=t2 - t1, steps_s=time.perf_counter() - t2, table=tables is not None,
                       long_range=kept)
    return {**mlp.export(), "centroid_scale": torch.full((kvh,), c_scale)}, losses


# ---------------------------------------------------------------------------------------------
# Orchestration


def _where(dev: torch.device, capture_dev: torch.device | None) -> dict:
    import faiss

    out = {"device": str(dev), "capture_device": str(capture_dev) if capture_dev is not None else None,
           "torch": torch.__version__,
           "faiss": faiss.__version__,
           "kmeans": "faiss-cpu" if dev.type != "cuda" else "faiss-gpu" if faiss.get_num_gpus() > 0 else "torch"}
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
    return out


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class TrainingCancelled(Exception):
    """`train_saap`'s `should_stop` said stop (a cancelled training job)."""


def _stopper(should_stop: Callable[[], bool] | None) -> Callable[[], None]:
    def stop() -> None:
        if should_stop is not None and should_stop():
            raise TrainingCancelled("training cancelled")
    return stop


def _on_step(i: int, loss: float, bar, layer: int, stop: Callable[[], None]) -> None:
    if bar is not None and i % 25 == 0:
        bar.set_postfix(layer=layer, step=i, kl=f"{loss:.3f}")
    if (i + 1) % _PLAN_STEPS == 0:  # losses arrive once per plan: ask once per plan
        stop()


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
    should_stop: Callable[[], bool] | None = None,
) -> Path:
    """Train (or resume training) a SAAP model for `lm`; return the directory holding its manifest.

    `on_progress(event)` is called after the corpus capture and after each layer, with `phase`
    ("capture" / "layer"), `layers_done`, `layers_total` and, for a layer, `layer` and its stats (the
    service's training jobs report these). `should_stop()` is asked before each corpus window, before
    each layer and every `_PLAN_STEPS` Adam steps; True raises `TrainingCancelled` (finished layers
    stay checkpointed: the same run started again resumes from them).

    Training computes on `settings.device` (resolved by `resolve_device`); the corpus capture runs
    wherever `lm.model` already is (this never moves a model: the CLI loads it on the training device)."""
    report = on_progress or (lambda event: None)
    from tqdm import tqdm

    spec = lm.spec
    dev = resolve_device(settings.device)
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
    capture_dev = next(lm.model.parameters()).device if lm.model is not None else None
    if capture_dev is not None and capture_dev != dev:
        log.info("saap: the model is on %s: the corpus capture runs there, training on %s", capture_dev, dev)
    stop = _stopper(should_stop)
    captures = capture_corpus(lm, windows, max(layers) + 1, cache, settings.capture_dtype, progress, stop)
    capture_s = time.perf_counter() - t0
    report({"phase": "capture", "windows": len(windows), "layers_done": 0, "layers_total": len(layers)})

    d, kvh, group = spec.head_dim, spec.num_kv_heads, spec.group_size
    layer_meta: dict[str, dict] = {}
    bar = tqdm(layers, desc="saap: train layers", unit="layer", disable=not progress)
    for layer in bar:
        stop()
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
            # de-RoPE on the host (a GPU run starts from a CPU run's bytes); then every tensor of
            # the layer goes to the device
            qs.append(q.to(dev))
            ks.append(k.to(dev))
            qds.append(undo_rope(q, pos, spec.rope_theta).to(dev))
            kds.append(undo_rope(k, pos, spec.rope_theta).to(dev))
        _sync(dev)
        load_s = time.perf_counter() - t_layer
        cent = torch.empty(kvh, settings.clusters, d, device=dev)
        balance = []
        for h in range(kvh):
            x = torch.cat([kd[h, settings.sink_exclude:] for kd in kds])
            if x.shape[0] < settings.clusters:
                raise ValueError(f"{x.shape[0]} training keys for {settings.clusters} clusters: use a larger corpus")
            cent[h] = kmeans(x, settings.clusters, settings.kmeans_iters, settings.seed + layer * kvh + h)
            sizes = torch.bincount(nearest_centroid(x[None], cent[h:h + 1])[0], minlength=settings.clusters).float()
            balance.append(round(float(sizes.max() / sizes.mean()), 3))
        _sync(dev)
        kmeans_s = time.perf_counter() - t_layer  # loading and de-RoPE included
        gen = torch.Generator().manual_seed(settings.seed * 1_000_003 + layer)
        parts: dict = {}
        weights, losses = _train_layer(
            qs, ks, kds, qds, cent, settings, min_dist, group, gen,
            on_step=lambda i, v: _on_step(i, v, bar if progress else None, layer, stop),
            timings=parts,
        )
        cent = cent.cpu()
        head = max(1, min(20, len(losses) // 10))
        # only deterministic facts go into the file (its sha256 enters the digest); timings go to the manifest
        stats = {"kl_first": round(sum(losses[:head]) / head, 5), "kl_last": round(sum(losses[-head:]) / head, 5),
                 "balance_train": balance, "long_range_rows": round(parts["long_range"], 4)}
        tensors = {"centroids": cent, **weights}
        _atomic_save(tensors, path,
                     {"format": MODEL_FORMAT, "layer": str(layer), "settings_hash": s_hash, "stats": json.dumps(stats)})
        layer_meta[str(layer)] = {**stats, "load_s": round(load_s, 3), "kmeans_s": round(kmeans_s, 3),
                                  "train_s": round(time.perf_counter() - t_layer - kmeans_s, 3),
                                  "targets_s": round(parts["targets_s"], 3), "steps_s": round(parts["steps_s"], 3),
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
        # where it ran: not part of the model's identity (a GPU run equals a CPU run up to float noise)
        "trained_on": _where(dev, capture_dev),
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
