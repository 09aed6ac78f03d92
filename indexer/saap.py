"""`saap`: Self-Attention with Asymmetric Partitions (papers/saap.txt §3-5, App. A).

Keys and queries are bucketed by two different functions, both learned offline once per LLM:
keys by their nearest k-means centroid (k-means over *de-RoPE'd* keys: RoPE's rotation is what makes
long-range lookups position-dependent), queries by a classifier f_q that predicts, for a de-RoPE'd
query, how its attention mass spreads over the key buckets. Training lives in
`indexer/_saap_train.py` (`ctxcache train saap`); this module holds the trained-model format, the
per-context build and the decode-time selection.

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
    residual f_q of `_saap_train`, whose scale is 1/sqrt(D); 0 = the paper's plain MLP, which is
    also how a format-1 file, without the tensor, is read).
  * Layer 0 is never trained (full attention, paper §3); a model may also cover only some layers
    (`--layers`, used by the tests): every untrained layer runs full attention.

Build (prefill worker; `build_fields`: `model_dir`)
  per trained layer and KV head, every context key is de-RoPE'd (`decoder.rope.undo_rope`, the
  model's `rope_theta`, positions 0..N-1) and assigned to its nearest (L2) centroid. Stored:
  `assign` [L, KVH, N] int32 bucket id of each key (-1 in untrained layers), `order` [L, KVH, N]
  int32 key ids grouped by bucket (stable: ascending ids inside a bucket), `offsets`
  [L, KVH, C + 1] int32 CSR offsets into `order` (bucket c = order[offsets[c]:offsets[c+1]], the
  paper's Off/Idx, App. F), `balance` [L, KVH] fp32 largest / mean bucket size (0 = untrained;
  a layer's GPU time is set by its largest visited bucket), `model_id` [L, 64] uint8 = the LLM
  fingerprint and the trained digest (raw sha256 bytes), so a decode worker finds and checks the
  trained model without the ModelSpec.

Decode (`select`, per layer and step; KV heads and query tokens batched)
  1. the group's queries are de-RoPE'd at their positions; f_q's softmax outputs are summed over
     the GQA group (paper §5, "batched queries"), the `nprobe` (ℓ, default 32, clamped to C)
     highest buckets are probed. `probe="centroid"` instead ranks buckets by the group sum of
     softmax(q'·c / sqrt(D)) over the centroids: the paper's "K-means (no rope)" baseline, on the
     same partition.
  2. ALL keys of the probed buckets are selected (no top-K, paper §4 "beyond top-k"): the CSR
     slices of the context, plus the request's own keys whose bucket is probed. Request keys are
     assigned (de-RoPE'd at their absolute positions) in the session's private state on `append`
     (or at `select` for this step's keys); the persisted partition is never written.
  3. the dense part: the frame's sink (default 1) and window (default 0), plus SAAP's `recent`
     most recent tokens. The paper's "1+2047" is sized for 100K-500K contexts; here `recent`
     defaults to n_ctx // 64 clamped to [32, 2047] (2047 from 131K tokens on; 32 at 2K, 128 at
     8K), i.e. the paper's ~1.6% of a 128K context.
  Selectivity (the paper's metric: fraction of the visible keys that attention reads, dense part
  included, deduplicated) is recorded per step and layer in the session: `session.selectivity`
  (one float per decode step, mean over the SAAP layers, KV heads and query tokens) and
  `session.selectivity_detail` (per layer: visited fraction, bucket-only fraction of the context,
  largest probed bucket). They are kept as device scalars and read back when asked (the
  completion's stats), so the decode path makes no host sync for them.

Without a trained model for the LLM, `validate_configuration` returns a reason that names the
command that trains one; the service answers 422 `unsupported_configuration` with it at
registration (a context is never queued for a build that cannot run).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from decoder.rope import undo_rope
from indexer._select import RequestBuckets, expand_clusters, nearest_centroid
from indexer.base import MethodEnv, MethodParams, MethodSession, MethodUnavailable, PrefillCapture, SparseMethod, register
from storage.keys import params_hash

MODEL_FORMAT = "ctxcache-saap-model/2"
READABLE_FORMATS = (MODEL_FORMAT, "ctxcache-saap-model/1")  # 1: no `centroid_scale` (read as 0)
MANIFEST = "manifest.json"
BN_EPS = 1e-5
TRAIN_HINT = ("ctxcache train saap --model {model} (add --preset small for a few-minute CPU model), "
              "or over REST: POST /v1/methods/saap/train {{\"preset\": \"small\"}}")


class SaapParams(MethodParams):
    sink: int = Field(1, ge=0, le=4096, description="first tokens always attended (the paper's '1' of 1+2047)")
    window: int = Field(0, ge=0, le=65536, description="frame window, added to `recent` (SAAP's own dense part)")
    recent: int | None = Field(
        None, ge=0, le=65536, description="most recent tokens attended densely; None = n_ctx // 64 in [32, 2047]"
    )
    nprobe: int = Field(32, ge=1, le=65536, description="ℓ: buckets probed per step (clamped to C)")
    probe: Literal["classifier", "centroid"] = Field(
        "classifier", description="rank buckets by the query classifier f_q (SAAP) or by centroid similarity (k-means baseline)"
    )
    model_dir: str | None = Field(
        None, max_length=4096, description="trained SAAP model directory; None = <data_dir>/saap/<model fingerprint[:16]>; "
                                           "over the REST API a path under the service's data dir (relative: from there)"
    )

    build_fields = frozenset({"model_dir"})

    def recent_for(self, n_ctx: int) -> int:
        return self.recent if self.recent is not None else min(2047, max(32, n_ctx // 64))


# ---------------------------------------------------------------------------------------------
# Trained model: location, format, loading


def default_model_dir(fingerprint: str, data_dir: Path | str | None = None) -> Path:
    """`<data_dir>/saap/<fingerprint[:16]>`; data_dir defaults like the service's (`MethodEnv.default()`)."""
    root = Path(data_dir) if data_dir is not None else MethodEnv.default().data_dir
    return root / "saap" / fingerprint[:16]


def model_dir_for(params: SaapParams, fingerprint: str, env: MethodEnv | None = None) -> Path:
    """`params.model_dir`, else the default location under the caller's data directory. A service's
    env is `confined`: a `model_dir` from a request must lie under its data dir (ValueError)."""
    env = env or MethodEnv.default()
    if params.model_dir:
        return env.resolve(params.model_dir)
    return default_model_dir(fingerprint, env.data_dir)


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
        return _open_cached(str(Path(model_dir).resolve()), m["digest"], m)

    def layer(self, layer: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """centroids [KVH, C, D], c_sq [KVH, C], w1 [KVH, Hd, D], scale/shift [KVH, Hd] (b1 + batch
        norm folded), w2 [KVH, C, Hd], b2 [KVH, C], centroid_scale [KVH]; fp32 on `device`."""
        key = (layer, str(device))
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                return got
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
            got = {k: v.float().to(device).contiguous() for k, v in got.items()}
            self._cache[key] = got
            return got


_MODELS: dict[tuple[str, str], SaapModel] = {}
_MODELS_LOCK = threading.Lock()


def _open_cached(path: str, digest: str, manifest: dict) -> SaapModel:
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


# Buckets are stored like kivf's clusters (key ids sorted by bucket + CSR offsets): same reader.
expand_buckets = expand_clusters


# ---------------------------------------------------------------------------------------------
# Session


class _SaapSession(MethodSession):
    def __init__(self, index, params: SaapParams, n_ctx: int, model: SaapModel):
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self.model = model
        self.recent = params.recent_for(n_ctx)
        self.buckets = RequestBuckets()  # the bucket of each request key (private)
        # per (step, layer): [position, visited fraction, bucket fraction, largest probed bucket] as
        # device scalars, read back only when asked (`_materialize`): no host sync on the decode path
        self._pending: list[torch.Tensor] = []
        self._pending_layers: list[int] = []
        self._detail: list[dict] = []

    def _materialize(self) -> list[dict]:
        if self._pending:
            rows = torch.stack(self._pending).cpu().tolist()  # one device-to-host copy for all of them
            self._pending.clear()
            layers = self._pending_layers
            self._detail += [{"pos": int(r[0]), "layer": layer, "visited": r[1], "buckets": r[2], "largest_bucket": int(r[3])}
                             for layer, r in zip(layers, rows)]
            self._pending_layers = []
        return self._detail

    @property
    def selectivity_detail(self) -> list[dict]:
        """Per step and SAAP layer: visited fraction, bucket-only fraction of the context, largest probed bucket."""
        return self._materialize()

    @property
    def selectivity(self) -> list[float]:
        """Per decode step: mean fraction of visible keys read by the SAAP layers (dense part included)."""
        per_step: dict[int, list[float]] = {}
        for d in self._materialize():
            per_step.setdefault(d["pos"], []).append(d["visited"])
        return [sum(v) / len(v) for v in per_step.values()]

    def stats(self) -> dict:
        sel = self.selectivity
        return {"selectivity_mean": round(sum(sel) / len(sel), 5) if sel else None,
                "selectivity_per_step": [round(x, 5) for x in sel],
                "largest_probed_bucket": max((d["largest_bucket"] for d in self.selectivity_detail), default=0)}

    @property
    def local_assign(self) -> dict[int, torch.Tensor]:
        """layer -> [KVH, M] bucket of each request key so far."""
        return self.buckets.as_dict()

    def _bucket(self, layer: int, k: torch.Tensor, start: int) -> None:
        """Bucket request keys k [KVH, T, D] (post-RoPE) at request offsets start .. start + T - 1."""
        w = self.model.layer(layer, k.device)
        pos = torch.arange(self.n_ctx + start, self.n_ctx + start + k.shape[1], device=k.device)
        kd = undo_rope(k.float(), pos, self.model.rope_theta)
        self.buckets.add(layer, start, nearest_centroid(kd, w["centroids"], w["c_sq"]))

    def append(self, layer, k, v, positions):
        if layer in self.model.layers:
            todo = self.buckets.appended(layer, k.shape[1])  # select bucketed this step's keys already
            if todo:
                self._bucket(layer, k[:, k.shape[1] - len(todo):], todo.start)

    def select(self, layer, q, kv):
        if layer not in self.model.layers:
            return None  # layer 0 and untrained layers: full attention
        kvh, g, t, d = q.shape
        dev = q.device
        w = self.model.layer(layer, dev)
        c = w["centroids"].shape[1]
        order = self.index.layer("order", layer).to(dev)  # [KVH, N] int32, shared: read only
        offsets = self.index.layer("offsets", layer).to(dev).long()  # [KVH, C + 1]

        # 1. rank buckets for the group's de-RoPE'd queries, probe the best ℓ
        qd = undo_rope(q.float(), kv.q_pos, self.model.rope_theta)  # [KVH, G, T, D]
        score = bucket_scores(qd, w, self.params.probe)  # [KVH, T, C]
        probe = torch.topk(score, min(self.params.nprobe, c), dim=-1).indices  # [KVH, T, P]
        probed = torch.zeros(kvh, t, c, dtype=torch.bool, device=dev).scatter_(-1, probe, True)

        # 2. every key of the probed buckets: context (CSR slices) + the request's own keys
        cand = expand_buckets(probe, order, offsets)  # [KVH, T, U]
        n_bucket_ctx = (cand >= 0).sum(-1)  # [KVH, T]
        parts = [cand]
        m = kv.n_local
        n_bucket_loc = torch.zeros_like(n_bucket_ctx)
        if m > 0:
            todo = self.buckets.todo(layer, m)
            if todo:  # this step's keys (append comes after select)
                self._bucket(layer, kv.loc_k[:, todo.start:m], todo.start)
            la = self.buckets.view(layer, m)  # [KVH, M]
            loc = torch.arange(self.n_ctx, self.n_ctx + m, device=dev)
            hit = probed.gather(-1, la[:, None, :].expand(kvh, t, m)) & (loc[None, None, :] <= kv.q_pos[None, :, None])
            parts.append(torch.where(hit, loc, -1))
            n_bucket_loc = hit.sum(-1)

        # 3. dense part: SAAP's recent tokens (the frame adds sink + window)
        rec = kv.q_pos[:, None] - torch.arange(self.recent, device=dev)[None, :]  # [T, R]
        parts.append(rec.clamp(min=-1).expand(kvh, t, self.recent))
        self._record(layer, kv, probed, n_bucket_ctx, n_bucket_loc, offsets, probe)
        return torch.cat(parts, dim=-1)

    def _record(self, layer, kv, probed, n_bucket_ctx, n_bucket_loc, offsets, probe) -> None:
        """Selectivity of this step and layer: |probed-bucket keys ∪ dense part| / visible keys."""
        kvh, t, _ = probed.shape
        dev = probed.device
        p = self.params
        q_pos = kv.q_pos
        dense = torch.cat([
            torch.arange(p.sink, device=dev)[None, :].expand(t, p.sink),
            q_pos[:, None] - torch.arange(p.window, device=dev)[None, :],
            q_pos[:, None] - torch.arange(self.recent, device=dev)[None, :],
        ], dim=-1)  # [T, S]
        dense = torch.where((dense >= 0) & (dense <= q_pos[:, None]), dense, -1)
        dense, _ = torch.sort(dense, dim=-1)
        first = torch.ones_like(dense, dtype=torch.bool)
        first[:, 1:] = dense[:, 1:] != dense[:, :-1]
        keep = first & (dense >= 0)  # [T, S] distinct visible dense positions
        assign_ctx = self.index.layer("assign", layer).to(dev)  # [KVH, N] int32, shared: read only
        n_ctx = assign_ctx.shape[1]
        pos = dense.clamp(min=0)
        b_ctx = assign_ctx.gather(1, pos.clamp(max=n_ctx - 1).reshape(1, -1).expand(kvh, -1)).view(kvh, t, -1).long()
        la = self.buckets.view(layer) if self.buckets.count(layer) else None
        if la is not None:
            b_loc = la.gather(1, (pos - n_ctx).clamp(0, la.shape[1] - 1).reshape(1, -1).expand(kvh, -1)).view(kvh, t, -1)
            bucket = torch.where(pos[None] < n_ctx, b_ctx, b_loc)
        else:
            bucket = b_ctx
        in_probed = probed.gather(-1, bucket)  # [KVH, T, S]
        extra = (keep[None] & ~in_probed).sum(-1)
        visited = (n_bucket_ctx + n_bucket_loc + extra).double() / (q_pos[None, :].double() + 1)
        sizes = (offsets[:, 1:] - offsets[:, :-1]).gather(1, probe.reshape(kvh, -1))
        largest = sizes.max() if sizes.numel() else torch.zeros((), device=dev)
        self._pending.append(torch.stack([q_pos[-1].double(), visited.mean(), n_bucket_ctx.double().mean() / max(n_ctx, 1),
                                          largest.double()]))
        self._pending_layers.append(layer)


# ---------------------------------------------------------------------------------------------
# Method


def _digest_bytes(hex64: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(hex64)), dtype=torch.uint8)


@register
class Saap(SparseMethod):
    name = "saap"
    Params = SaapParams
    has_index = True

    def validate_configuration(self, spec, params, env=None) -> list[str]:
        reasons = []
        if getattr(spec, "rope_type", "default") != "default":
            reasons.append(f"saap de-RoPEs keys and queries and supports only the default RoPE, not {spec.rope_type!r}")
        try:
            where = model_dir_for(params, spec.fingerprint, env)
        except ValueError as e:
            return reasons + [f"model_dir: {e}"]
        m = read_manifest(where)
        if m is None:
            hint = (f"ctxcache train saap --model {spec.name} --out {where} (add --preset small for a few-minute CPU model)"
                    if params.model_dir else TRAIN_HINT.format(model=spec.name))
            reasons.append(
                f"no trained SAAP model for {spec.name} (fingerprint {spec.fingerprint[:16]}) under {where}: "
                f"saap needs a per-model query classifier, trained offline once; train it with: {hint}"
            )
            return reasons
        mm = m["model"]
        if mm["fingerprint"] != spec.fingerprint:
            reasons.append(f"the SAAP model under {where} was trained for model fingerprint {mm['fingerprint'][:16]}, "
                           f"not {spec.fingerprint[:16]} ({spec.name}); retrain with: {TRAIN_HINT.format(model=spec.name)}")
        elif (mm["num_kv_heads"], mm["head_dim"], mm["num_layers"]) != (spec.num_kv_heads, spec.head_dim, spec.num_layers):
            reasons.append(f"the SAAP model under {where} does not match {spec.name}'s shape")
        return reasons

    def load_model(self, params: SaapParams, fingerprint: str, env: MethodEnv | None = None) -> SaapModel:
        try:
            where = model_dir_for(params, fingerprint, env)
        except ValueError as e:
            raise MethodUnavailable(f"model_dir: {e}") from None
        if read_manifest(where) is None:
            raise MethodUnavailable(f"no trained SAAP model under {where}; train it with: {TRAIN_HINT.format(model='<model>')}")
        model = SaapModel.open(where)
        if model.fingerprint != fingerprint:
            raise MethodUnavailable(f"the SAAP model under {where} was trained for another LLM ({model.fingerprint[:16]})")
        return model

    def build(self, prefill: PrefillCapture, params: SaapParams, env=None) -> dict[str, torch.Tensor]:
        spec = prefill.spec
        model = self.load_model(params, spec.fingerprint, env)
        k = prefill.k  # [L, KVH, N, D] post-RoPE
        n_layers, kvh, n, _ = k.shape
        c = model.n_clusters
        assign = torch.full((n_layers, kvh, n), -1, dtype=torch.int32)
        order = torch.arange(n, dtype=torch.int32).expand(n_layers, kvh, n).clone()
        offsets = torch.zeros(n_layers, kvh, c + 1, dtype=torch.int32)
        balance = torch.zeros(n_layers, kvh, dtype=torch.float32)
        for layer in sorted(model.layers):  # on the capture's device (the service's captures are on the host)
            w = model.layer(layer, k.device)
            kd = undo_rope(k[layer].float(), prefill.positions.to(k.device), model.rope_theta)  # [KVH, N, D]
            a = nearest_centroid(kd, w["centroids"], w["c_sq"])  # [KVH, N]
            o, off = csr_partition(a, c)
            assign[layer], order[layer], offsets[layer] = a.to(torch.int32), o.to(torch.int32), off.to(torch.int32)
            sizes = (off[:, 1:] - off[:, :-1]).float()
            balance[layer] = sizes.max(-1).values / (n / c)
        ident = torch.cat([_digest_bytes(model.fingerprint), _digest_bytes(model.digest)])
        return {"assign": assign, "order": order, "offsets": offsets, "balance": balance,
                "model_id": ident.expand(n_layers, 64).clone()}

    def index_id(self, params, spec=None, env=None) -> str:
        """With the model `spec`, the trained model's digest is part of the identity: registering a
        context again after the model was retrained (`replace`) builds a new index instead of finding
        the old one, and asking with the old one answers 409 method_not_built."""
        if spec is None:
            return super().index_id(params)
        try:
            m = read_manifest(model_dir_for(params, spec.fingerprint, env))
        except ValueError:  # a path the caller may not use: no model (registration refuses it anyway)
            m = None
        ident = {**params.build_params(), "trained_model": m["digest"] if m else None}
        return f"{self.name}-{params_hash(self.name, self.version, ident)}"

    def open(self, index, params, n_ctx, env=None):
        if index is None:
            raise ValueError("saap needs its built index (key buckets); build it at registration")
        ident = index.layer("model_id", 0).cpu()
        fingerprint, digest = bytes(ident[:32].tolist()).hex(), bytes(ident[32:].tolist()).hex()
        model = self.load_model(params, fingerprint, env)
        if model.digest != digest:
            raise MethodUnavailable(f"this context's saap index was built with trained model {digest[:16]}, but "
                             f"{model.dir} now holds {model.digest[:16]} (retrained?); delete the context and "
                             f"register it again to rebuild its index")
        return _SaapSession(index, params, n_ctx, model)
