"""SAAP's trained model (`indexer/saap.py`): where it lives, its file format, loading, and the
math on it that the method, its training and the benchmarks share (f_q, bucket scores, the CSR
partition of keys into buckets). Training writes this format, the method reads it.

Trained model (one directory per LLM, default `<data_dir>/saap/<model fingerprint[:16]>/`, where
`data_dir` is the caller's `MethodEnv` (the service passes its `--data-dir`; without one,
`$CTXCACHE_DATA_DIR` or `data`); the `model_dir` parameter overrides it):
  * `manifest.json`: format, the LLM's fingerprint and shape, training settings, corpus provenance,
    per-layer file sha256 (checked at load) and tensor-content sha256, and `digest` = sha256 over
    (settings hash, fingerprint, per-layer content sha256): equal for equal training results.
    The digest is the trained model's identity. It is part of the index identity
    (`index_id(params, spec, env)`, as the service calls it): registering a context again after a
    retrain builds a new index, and asking with the old one answers 409 method_not_built. Every
    index also records the digest it was built with (`model_id`), and `open` refuses a trained model
    with another digest (409 method_unavailable), so an index is never read with a classifier other
    than the one whose centroids built it, even when the model changes between registration and build.
  * `layer_XX.safetensors` per trained layer (no pickle): `centroids` [KVH, C, D] fp32 and the
    classifier of every KV head, stacked: `w1` [KVH, Hd, D], `b1`, `bn_mean`, `bn_var`,
    `bn_weight`, `bn_bias` [KVH, Hd], `w2` [KVH, C, Hd], `b2` [KVH, C]
    (Linear -> BatchNorm -> ReLU -> Linear; batch norm is folded into an affine map at load), and
    `centroid_scale` [KVH]: f_q's logits are MLP(q') + centroid_scale · q'·c (format 2; the
    residual f_q of `training.classifier`, whose scale is 1/sqrt(D); 0 = the paper's plain MLP, which is
    also how a format-1 file, without the tensor, is read).
  * Layer 0 is never trained (full attention, paper §3); a model may also cover only some layers
    (`--layers`, used by the tests): every untrained layer runs full attention.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import torch

from indexer.base import MethodEnv

MODEL_FORMAT = "ctxcache-saap-model/2"
READABLE_FORMATS = (MODEL_FORMAT, "ctxcache-saap-model/1")  # 1: no `centroid_scale` (read as 0)
MANIFEST = "manifest.json"
BN_EPS = 1e-5



def default_model_dir(fingerprint: str, data_dir: Path | str | None = None) -> Path:
    """`<data_dir>/saap/<fingerprint[:16]>`; data_dir defaults like the service's (`MethodEnv.default()`)."""
    root = Path(data_dir) if data_dir is not None else MethodEnv.default().data_dir
    return root / "saap" / fingerprint[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, shapes, dtypes and bytes (a safetensors file's bytes are not deterministic:
    its metadata map is written in hash order)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_digest(settings_hash: str, fingerprint: str, layer_sha: dict[str, str]) -> str:
    blob = json.dumps({"format": MODEL_FORMAT, "settings": settings_hash, "fingerprint": fingerprint, "layers": layer_sha},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_manifest(model_dir: Path) -> dict | None:
    """The trained model's manifest, or None when there is none (untrained / training unfinished)."""
    try:
        m = json.loads((Path(model_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if m.get("format") in READABLE_FORMATS else None


class SaapModel:
    """A trained SAAP model, read only. Layers are loaded (and their sha256 checked) on first use."""

    def __init__(self, model_dir: Path, manifest: dict):
        self.dir = Path(model_dir)
        self.manifest = manifest
        self.digest: str = manifest["digest"]
        self.fingerprint: str = manifest["model"]["fingerprint"]
        self.rope_theta = float(manifest["model"]["rope_theta"])
        self.n_clusters = int(manifest["settings"]["clusters"])
        self.layers = frozenset(int(x) for x in manifest["layers"])
        self._cache: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, model_dir: Path) -> "SaapModel":
        m = read_manifest(model_dir)
        if m is None:
            raise FileNotFoundError(f"no trained SAAP model under {model_dir}")
        return cached_model(str(Path(model_dir).resolve()), m["digest"], m)

    @property
    def head_dim(self) -> int:
        return int(self.manifest["model"]["head_dim"])

    def _read(self, layer: int) -> dict[str, torch.Tensor]:
        """One layer's file (sha256-checked), batch norm folded; fp32 on the CPU, not cached."""
        from safetensors.torch import load_file

        entry = self.manifest["layers"][str(layer)]
        path = self.dir / entry["file"]
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path}: sha256 differs from the SAAP manifest (file changed after training?)")
        t = load_file(str(path))
        scale = t["bn_weight"] / torch.sqrt(t["bn_var"] + BN_EPS)
        got = {
            "centroids": t["centroids"],
            "c_sq": (t["centroids"] * t["centroids"]).sum(-1),
            "w1": t["w1"],
            "scale": scale,
            "shift": (t["b1"] - t["bn_mean"]) * scale + t["bn_bias"],
            "w2": t["w2"],
            "b2": t["b2"],
            "centroid_scale": t.get("centroid_scale", torch.zeros(t["centroids"].shape[0])),
        }
        return {k: v.float().contiguous() for k, v in got.items()}

    def layer(self, layer: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """centroids [KVH, C, D], c_sq [KVH, C], w1 [KVH, Hd, D], scale/shift [KVH, Hd] (b1 + batch
        norm folded), w2 [KVH, C, Hd], b2 [KVH, C], centroid_scale [KVH]; fp32 on `device`."""
        key = (layer, str(device))
        with self._lock:
            got = self._cache.get(key)
            if got is None:
                got = self._cache[key] = {k: v.to(device) for k, v in self._read(layer).items()}
            return got

    def kernel_layer(self, layer: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16
                     ) -> dict[str, torch.Tensor]:
        """The weights as the GPU plan's kernels read them (`indexer.kernels.saap.kernel_weights`):
        w1, w2 and centroids in `dtype` (round to nearest), the vectors fp32; on `device`, cached."""
        from indexer.kernels.saap import kernel_weights

        key = (layer, str(device), "kernel", dtype)
        with self._lock:
            got = self._cache.get(key)
            if got is None:
                got = self._cache[key] = {k: v.to(device) for k, v in kernel_weights(self._read(layer), dtype).items()}
            return got


_MODELS: dict[tuple[str, str], SaapModel] = {}
_MODELS_LOCK = threading.Lock()


def cached_model(path: str, digest: str, manifest: dict) -> SaapModel:
    with _MODELS_LOCK:
        m = _MODELS.get((path, digest))
        if m is None:
            m = _MODELS[(path, digest)] = SaapModel(Path(path), manifest)
        return m


# ---------------------------------------------------------------------------------------------
# Shared math (also used by training and the benchmark)


def classify(qd: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """f_q in eval mode. qd [KVH, G, T, D] de-RoPE'd queries -> probabilities [KVH, G, T, C]."""
    h = torch.einsum("hgtd,hkd->hgtk", qd.float(), w["w1"])
    h = torch.relu(h * w["scale"][:, None, None, :] + w["shift"][:, None, None, :])
    logits = torch.einsum("hgtk,hck->hgtc", h, w["w2"]) + w["b2"][:, None, None, :]
    sim = torch.einsum("hgtd,hcd->hgtc", qd.float(), w["centroids"])  # residual f_q: + centroid similarity
    logits = logits + w["centroid_scale"][:, None, None, None] * sim
    return torch.softmax(logits, dim=-1)


def bucket_scores(qd: torch.Tensor, w: dict[str, torch.Tensor], probe: str) -> torch.Tensor:
    """qd [KVH, G, T, D] -> [KVH, T, C] group-summed bucket scores (classifier or centroid probe)."""
    if probe == "classifier":
        return classify(qd, w).sum(1)
    s = torch.einsum("hgtd,hcd->hgtc", qd.float(), w["centroids"]) * qd.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1).sum(1)


def csr_partition(assign: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """assign [KVH, N] bucket ids -> (order [KVH, N], offsets [KVH, C + 1]), int64."""
    order = torch.argsort(assign, dim=-1, stable=True)
    counts = torch.zeros(assign.shape[0], c, dtype=torch.int64, device=assign.device)
    counts.scatter_add_(1, assign, torch.ones_like(assign))
    offsets = torch.zeros(assign.shape[0], c + 1, dtype=torch.int64, device=assign.device)
    offsets[:, 1:] = counts.cumsum(-1)
    return order, offsets
