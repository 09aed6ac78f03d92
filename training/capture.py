"""From a corpus to the first layers' Q/K of every training window, cached on disk.

1. corpus -> token windows (`token_windows`): the built-in seeded corpus (`training/corpus.py`) or
   every `*.txt` of `--corpus DIR`, tokenized like a registered context (chat prefix), cut into
   windows of `doc_tokens`, at most `n_docs` of them.
2. capture (`capture_corpus`): each window is prefilled once (`decoder.prefill`) through the first
   max(layers) + 1 layers only (later layers cannot change earlier ones' Q/K), and its post-RoPE
   Q/K are cached (`<out>/.captures/window_XXXX.safetensors`, `capture_dtype`), keyed by the
   model's fingerprint, the window's token ids and the dtype, so an interrupted run does not
   prefill again. `load_layer` reads one layer of one window back.

The capture runs wherever the model already is: training never moves a model (a server may be
decoding with it). It truncates the model by changing its config (`first_layers`), so it must run
on a model object of its own: the service's train worker loads its own copy of the weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from decoder.prefill import prefill
from indexer.base import PrefillCapture
from training.checkpoints import atomic_save, read_metadata


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
    with first_layers(lm.model, n_layers):
        cap = prefill(lm, ids)
    return PrefillCapture(q=cap.q[:n_layers].clone(), k=cap.k[:n_layers].clone(), v=cap.v[:n_layers].clone(),
                          positions=cap.positions, spec=cap.spec)


def ids_sha256(windows: list[list[int]]) -> str:
    """sha256 of token windows (int64 little-endian ids, a separator after each window)."""
    h = hashlib.sha256()
    for w in windows:
        h.update(np.asarray(w, dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def capture_corpus(lm, windows: list[list[int]], n_layers: int, cache: Path, dtype: str,
                   progress: bool = True, stop: Callable[[], None] = lambda: None) -> list[Path]:
    """Prefill every window (first `n_layers` layers) once; cache q [nl, H, N, D], k [nl, KVH, N, D].
    Returns the cache file of each window; `stop()` is called before each window (it raises to cancel)."""
    from tqdm import tqdm

    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    fp = lm.spec.fingerprint
    for i, ids in enumerate(tqdm(windows, desc="saap: capture corpus", unit="window", disable=not progress)):
        stop()
        path = cache / f"window_{i:04d}.safetensors"
        key = {"fingerprint": fp, "ids_sha": ids_sha256([ids]), "dtype": dtype}
        meta = read_metadata(path) if path.exists() else None
        if not (meta and all(meta.get(k) == v for k, v in key.items()) and int(meta.get("n_layers", 0)) >= n_layers):
            cap = capture_first_layers(lm, ids, n_layers)
            dt = getattr(torch, dtype)
            atomic_save({"q": cap.q.to(dt), "k": cap.k.to(dt)}, path, {**key, "n_layers": str(n_layers)})
        paths.append(path)
    return paths


def load_layer(path: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of a cached window, as fp32: q [H, N, D], k [KVH, N, D] (post-RoPE)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_slice("q")[layer].float(), f.get_slice("k")[layer].float()
