"""SAAP's offline training, once per LLM: `train_saap` (`ctxcache train saap`, the service's train worker).

The method and the trained-model format live in `indexer/saap.py`; this package sits above the
decoder because training prefills its corpus through it. The run, step by step:
  1. corpus -> token windows -> the first layers' post-RoPE Q/K, cached on disk
     (`training/corpus.py`, `training/capture.py`);
  2. per layer (layer 0 is never trained: full attention) and KV head:
     * k-means (`indexer/clustering.py`: faiss's algorithm, L2, `kmeans_iters` iterations, seeded
       by `seed`, layer and head) over the de-RoPE'd keys of every window, the attention sink(s)
       (`sink_exclude` first tokens) left out;
     * f_q trained on the long-range targets (`training/classifier.py`; `_train_layer`): each step
       samples `batch` queries of one random window; every KV head of a layer is trained at once,
       deterministic in `seed` (per-layer generators, so a resumed run equals an uninterrupted one);
     each finished layer is checkpointed (`layer_XX.safetensors`, written to a temp name and
     renamed, `training/checkpoints.py`; its metadata holds the settings hash); a rerun with the
     same settings skips finished layers;
  3. `manifest.json` is written last (atomically): a model without it is "not trained".
Cancellation: `should_stop()` is asked before each corpus window, before each layer and every
`_PLAN_STEPS` Adam steps; True raises `TrainingCancelled` (finished layers stay checkpointed).
Settings, presets and the deviations from the paper: `training/settings.py`.

Device (`TrainSettings.device`, resolved by `training.settings.resolve_device`):
  * the corpus capture runs where `lm.model` already is: training never moves a model.
    `ctxcache train saap` loads the model on the training device; the service's train worker
    loads its own copy of the weights on the service's `device` setting;
  * each layer's captured Q/K are de-RoPE'd on the host (the CPU run's bytes) and moved to the
    device, where the k-means, the bucket assignment, the targets and the classifier's Adam steps
    (torch's fused Adam on a GPU) run. The initialization and the sampled positions come from CPU
    generators, drawn `_PLAN_STEPS` steps at a time in the order of a one-step loop: the same on
    every device and for any plan size;
  * k-means: faiss-cpu on the CPU; on a GPU, faiss-gpu when installed, else faiss's algorithm in
    torch (`indexer.clustering.backend`);
  * the per-layer target table may take `_TABLE_BYTES_CUDA` (at most half the free memory) on a
    GPU against `_TABLE_BYTES` of host memory, so the full preset's table is computed once per
    layer there, and per step on the CPU (both give the same targets up to float rounding);
  * losses are read back every `_PLAN_STEPS` steps (no synchronization per step).
  The device is not part of the trained model's identity, so a resumed run may mix layers trained
  on either. A GPU run gives the CPU run's model up to float rounding (GPU prefill, summation
  order, CUDA atomics), not its bytes, and two GPU runs may differ in the same way
  (tests/test_saap_device.py checks bucket and classifier agreement on a tiny model; measured:
  benchmarks/RESULTS_saap.md, "Training on a GPU"). The manifest's `trained_on` records the device,
  the capture device, the k-means backend and versions. On the CPU the device plumbing changes
  nothing: the same bytes (digests) as before it.
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
from pathlib import Path

import torch

from indexer.rope import undo_rope
from indexer import clustering
from indexer.saap_model import MANIFEST, MODEL_FORMAT, default_model_dir, model_digest, sha256_file, tensors_sha256
from indexer.selection import nearest_centroid
from training import corpus as corpus_mod
from training.capture import capture_corpus, ids_sha256, load_layer, token_windows
from training.checkpoints import atomic_save, read_metadata
from training.classifier import StackedMLP, far_top1, gather_queries, long_range_target, target_table
from training.settings import TrainSettings, resolve_device

log = logging.getLogger("ctxcache.saap")

_TABLE_BYTES = 1 << 30  # f_q targets are precomputed per layer up to this size (see `_train_layer`), host memory
_TABLE_BYTES_CUDA = 16 << 30  # the same on a GPU (also at most half its free memory): the full preset's table fits
_PLAN_STEPS = 256  # steps whose samples are drawn at once (one host-to-device copy, one loss read-back)


# ---------------------------------------------------------------------------------------------
# One layer's classifier


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
            tables = [target_table(qs[i], ks[i], assign[i], eligible[i], c, min_dist, s.sink_exclude, group, s.target)
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
            x = gather_queries(qds[w], p, g, group)  # [KVH, B, D] de-RoPE'd: f_q's input
            if tables is not None:
                target = tables[w][:, i, g] if per_query else tables[w][:, i[::group]]
            else:
                with torch.no_grad():
                    target = long_range_target(gather_queries(qs[w], p, g, group), ks[w], assign[w], p, c, min_dist,
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
           "kmeans": clustering.backend(dev)}
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
              "windows": len(windows), "tokens": sum(map(len, windows)), "ids_sha256": ids_sha256(windows)}
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
        meta = read_metadata(path) if path.exists() else None
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
            q, k = load_layer(cp, layer)  # [H, N, D], [KVH, N, D] post-RoPE
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
            cent[h] = clustering.kmeans(x, settings.clusters, settings.kmeans_iters, settings.seed + layer * kvh + h)
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
        atomic_save(tensors, path,
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
