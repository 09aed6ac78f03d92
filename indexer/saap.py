"""`saap`: Self-Attention with Asymmetric Partitions (papers/saap.txt §3-5, App. A).

Keys and queries are bucketed by two different functions, both learned offline once per LLM:
keys by their nearest k-means centroid (k-means over *de-RoPE'd* keys: RoPE's rotation is what makes
long-range lookups position-dependent), queries by a classifier f_q that predicts, for a de-RoPE'd
query, how its attention mass spreads over the key buckets. Training lives in
`training/` (`ctxcache train saap`); this module holds the per-context build and the
decode-time planner.

Trained model: one directory per LLM, its format and loading in `indexer/saap_model.py`.

Build (prefill worker; `build_fields`: `model_dir`)
  per trained layer and KV head, every context key is de-RoPE'd (`indexer.rope.undo_rope`, the
  model's `rope_theta`, positions 0..N-1) and assigned to its nearest (L2) centroid. Stored:
  `assign` [L, KVH, N] int32 bucket id of each key (-1 in untrained layers; not read at decode), `order` [L, KVH, N]
  int32 key ids grouped by bucket (stable: ascending ids inside a bucket), `offsets`
  [L, KVH, C + 1] int32 CSR offsets into `order` (bucket c = order[offsets[c]:offsets[c+1]], the
  paper's Off/Idx, App. F), `balance` [L, KVH] fp32 largest / mean bucket size (0 = untrained;
  a layer's GPU time is set by its largest visited bucket), `model_id` [L, 64] uint8 = the LLM
  fingerprint and the trained digest (raw sha256 bytes), so a decode worker finds and checks the
  trained model without the ModelSpec.

Decode (`open` once per request, `plan` per layer and step; KV heads and query tokens batched)
  * the dense part is the frame (`SaapParams.frame`): the sink (default 1) and the `window`
    (default 0) + `recent` most recent tokens, plus every request-local token (the frame attends
    all of them). The paper's "1+2047" is sized for 100K-500K contexts; here `recent` defaults to
    n_ctx // 64 clamped to [32, 2047] (2047 from 131K tokens on; 32 at 2K, 128 at 8K), i.e. the
    paper's ~1.6% of a 128K context. The backend attends the frame as ranges: the plan holds
    only context keys outside it.
  * `plan`: the group's queries are de-RoPE'd at their positions (on the device); f_q's softmax
    outputs are summed over the GQA group (paper §5, "batched queries") and the `nprobe` (ℓ,
    default 32, clamped to C) highest buckets are probed. `probe="centroid"` instead ranks buckets
    by the group sum of softmax(q'·c / sqrt(D)) over the centroids: the paper's "K-means (no
    rope)" baseline, on the same partition. ALL context keys of the probed buckets are planned (no
    top-K, paper §4 "beyond top-k"): their CSR slices, expanded into a block of a fixed width K per
    layer (`selection.expand_clusters`), with the keys inside the frame masked to -1. K =
    `selection.probe_width(offsets, ℓ)`, the most keys ℓ buckets of that layer hold in any KV head,
    read once in `open` (so K depends on the index and ℓ, never on the step; a layer's GPU time is
    set by its largest visited buckets, as the paper says). Keys are in one bucket each and the
    probed buckets are distinct, so the planned positions are distinct without a dedup.
  * request-local keys are not bucketed (the frame attends them all); `update` has nothing to do,
    and the persisted partition is never written.
  * layer 0 and every layer the trained model does not cover: `Plan.dense()`.
  * on a GPU (index arrays and queries on CUDA) the plan is made by `indexer/kernels/saap.py` in
    four Triton launches (de-RoPE + f_q's hidden layer; logits; softmax, group sum, top-ℓ and the
    probed buckets' places in the row; the row itself + the selectivity record) instead of ~90
    torch kernels. It reads the classifier's matrices in bf16 (cast once per process and device,
    `SaapModel.kernel_layer`: half the bytes of the step's largest read) and the de-RoPE's cos/sin
    from a table of the request's positions made in `open`. The same plan as the torch path, slot
    for slot, up to float rounding: bf16 weights (each moved by at most 2^-9 of itself), fp32
    summation order; a bucket at the edge of the top-ℓ may swap with a near-tie (the kernels rank
    exact ties by bucket id). The torch path is the reference and the CPU path; tests force the
    kernels through Triton's interpreter (`planner.use_kernels = True`).
  Selectivity (the paper's metric: the fraction of the visible keys attention reads, dense part
  and request tokens included; `decoder.backends.frame_fraction`) is computed by `plan` on the
  device and written into the planner's [step, layer] table (an overwrite, so planning a step
  again records the same value; the table is never read by planning). `stats()` reads it back
  once: `selectivity_per_step` (mean over the SAAP layers, KV heads and query tokens),
  `selectivity_mean` and `largest_probed_bucket`, the keys of the completion's `method_stats`.

Without a trained model for the LLM, `validate_configuration` returns a reason that names the
command that trains one; the service answers 422 `unsupported_configuration` with it at
registration (a context is never queued for a build that cannot run).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from indexer.rope import undo_rope
from indexer.selection import expand_clusters, nearest_centroid, probe_width, selectable
from indexer.base import (
    DecodeContext,
    MethodEnv,
    MethodParams,
    MethodUnavailable,
    Plan,
    Planner,
    PrefillCapture,
    SparseMethod,
    register,
)
from indexer.saap_model import SaapModel, bucket_scores, cached_model, csr_partition, default_model_dir, read_manifest
from storage.keys import params_hash

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

    def frame(self, n_ctx: int) -> tuple[int, int]:
        """SAAP's dense part is part of the frame: the sink and `window` + `recent` most recent tokens."""
        return self.sink, self.window + self.recent_for(n_ctx)

    def _widen(self, factor: float) -> "SaapParams":
        """ℓ `factor` times as many buckets probed (the plan's width grows with the buckets' sizes)."""
        return self.with_overrides({"nprobe": int(self._capped("nprobe", math.ceil(self.nprobe * factor)))})


def model_dir_for(params: SaapParams, fingerprint: str, env: MethodEnv | None = None) -> Path:
    """`params.model_dir`, else the default location under the caller's data directory. A service's
    env is `confined`: a `model_dir` from a request must lie under its data dir (ValueError)."""
    env = env or MethodEnv.default()
    if params.model_dir:
        return env.resolve(params.model_dir)
    return default_model_dir(fingerprint, env.data_dir)


# ---------------------------------------------------------------------------------------------
# Planner


_KERNELS: list = []  # [module or None]: indexer.kernels.saap, imported on first need


def saap_kernels():
    """The fused GPU plan's module, or None where Triton is missing."""
    if not _KERNELS:
        try:
            from indexer.kernels import saap as mod
        except ImportError:
            mod = None
        _KERNELS.append(mod)
    return _KERNELS[0]


class _SaapPlanner(Planner):
    """One request's planning: read-only over the index and the trained model; private stats."""

    def __init__(self, index, params: SaapParams, ctx: DecodeContext, model: SaapModel,
                 widths: dict[int, int], weights: dict[int, dict[str, torch.Tensor]], use_kernels: bool = False):
        self.index = index
        self.params = params
        self.n_ctx = ctx.n_ctx
        self.model = model
        self.sink, self.window = params.frame(ctx.n_ctx)
        self.nprobe = min(params.nprobe, model.n_clusters)
        self.width = widths  # trained layer -> K: the most keys `nprobe` of its buckets hold (any head)
        self._w = weights  # trained layer -> f_q and centroids (fp32) on the index's device: the torch path
        # the fused plan (indexer/kernels/saap.py): used for queries on the index's device when set (open
        # sets it for CUDA; tests set it to run the kernels through Triton's interpreter on the CPU)
        self.use_kernels = use_kernels
        self.kernel_weight_dtype = torch.bfloat16  # the dtype the kernels read w1, w2 and centroids in
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of the request's positions
        self._col = {layer: i for i, layer in enumerate(sorted(widths))}
        # [step, SAAP layer, (visited fraction, largest probed bucket)], NaN = not planned; step =
        # last query position - n_ctx, so a request of at most max_local tokens fits. Allocated on
        # the first plan, on the query's device; written by plan(), read back only by stats().
        self._steps = max(1, ctx.max_local)
        self._rec: torch.Tensor | None = None

    def plan(self, layer, q, kv):
        if layer not in self.width:
            return Plan.dense()  # layer 0 and layers the trained model does not cover: full attention
        dev = q.device
        order = self.index.layer("order", layer)  # [KVH, N] int32, resident on the planning device
        offsets = self.index.layer("offsets", layer)  # [KVH, C + 1] int32
        if self.use_kernels and order.device == dev and offsets.device == dev:
            kern = saap_kernels()
            if kern is not None and not kern.unsupported(q.shape[-1], q.shape[1], self.model.n_clusters, self.nprobe):
                return self._plan_kernels(kern, layer, q, kv, order, offsets)
        w = self._w.get(layer)
        if w is None or w["centroids"].device != dev:  # index arrays elsewhere than the queries, or the kernels' layout
            w = self.model.layer(layer, dev)

        # 1. rank the buckets for the group's de-RoPE'd queries, probe the best ℓ
        qd = undo_rope(q.float(), kv.q_pos, self.model.rope_theta)  # [KVH, G, T, D]
        score = bucket_scores(qd, w, self.params.probe)  # [KVH, T, C]
        probe = torch.topk(score, self.nprobe, dim=-1).indices  # [KVH, T, P]

        # 2. every context key of the probed buckets (fixed width K), minus the frame's keys
        keys = expand_clusters(probe, order, offsets, self.width[layer])  # [KVH, T, K] int64, -1 padding
        ok = selectable(keys, kv.q_pos, self.n_ctx, self.sink, self.window)  # padding (-1) is never selectable
        positions = torch.where(ok, keys, -1).to(torch.int32)
        self._record(layer, kv.q_pos, ok, probe, offsets)
        return Plan(positions)

    def _plan_kernels(self, kern, layer, q, kv, order, offsets) -> Plan:
        """The same plan and record in four Triton launches (indexer/kernels/saap.py)."""
        dev = q.device
        w = self.model.kernel_layer(layer, dev, self.kernel_weight_dtype)  # cached; loaded in open on a GPU
        if self._rope is None or self._rope[0].device != dev:
            self._rope = kern.rope_table(self.n_ctx, self._steps, q.shape[-1], self.model.rope_theta, dev)
        lengths = torch.empty(q.shape[0], q.shape[2], dtype=torch.int32, device=dev)
        positions = kern.saap_plan(q, kv.q_pos, self.n_ctx, *self._rope, w, order, offsets, self.nprobe,
                                   self.width[layer], self.sink, self.window, self.params.probe,
                                   self._rec_table(dev), self._col[layer], lengths=lengths)
        return Plan(positions, lengths=lengths)

    def _rec_table(self, dev) -> torch.Tensor:
        if self._rec is None or self._rec.device != dev:
            self._rec = torch.full((self._steps, len(self._col), 2), float("nan"), dtype=torch.float64, device=dev)
        return self._rec

    def _record(self, layer, q_pos, ok, probe, offsets) -> None:
        """Selectivity of this plan (the paper's metric): keys attention reads / visible keys, per
        KV head and query token, = (sink + the window's context part + request-local tokens + the
        plan's keys) / (q_pos + 1), what `decoder.backends.frame_fraction` counts; and the largest
        probed bucket. One overwrite of the (step, layer) slot: planning a step again records the same."""
        dev = q_pos.device
        self._rec_table(dev)
        kvh = ok.shape[0]
        n = self.n_ctx
        s_end = min(self.sink, n)
        w_lo = (q_pos.long() - self.window + 1).clamp(min=s_end, max=n)  # indexer.base.frame_bounds
        frame = s_end + (n - w_lo) + (q_pos.long() - n + 1).clamp(min=0)  # [T] sink + window + local
        visited = (frame[None] + ok.sum(-1)).double() / (q_pos[None].double() + 1)  # [KVH, T]
        sizes = (offsets[:, 1:] - offsets[:, :-1]).long().gather(1, probe.reshape(kvh, -1))
        row = torch.stack([visited.mean(), sizes.max().double()])  # [2]
        step = (q_pos[-1:].long() - n).clamp(0, self._steps - 1)  # [1]
        self._rec[:, self._col[layer]].index_copy_(0, step, row[None])

    def stats(self) -> dict:
        """selectivity_per_step: per decode step, the mean over SAAP layers, KV heads and query tokens
        of the fraction of visible keys read (dense part and request tokens included);
        selectivity_mean: their mean; largest_probed_bucket: the most keys one probed bucket held."""
        if self._rec is None:
            return {"selectivity_mean": None, "selectivity_per_step": [], "largest_probed_bucket": 0}
        rec = self._rec.cpu()  # the one device-to-host copy, after the request
        planned = ~torch.isnan(rec[..., 0])  # [S, L']
        steps = planned.any(1)
        vis = torch.where(planned, rec[..., 0], 0.0).sum(1) / planned.sum(1).clamp(min=1)
        per_step = [round(float(x), 5) for x in vis[steps]]
        largest = rec[..., 1][planned]
        return {"selectivity_mean": round(sum(per_step) / len(per_step), 5) if per_step else None,
                "selectivity_per_step": per_step,
                "largest_probed_bucket": int(largest.max()) if largest.numel() else 0}


# ---------------------------------------------------------------------------------------------
# Method


def _digest_bytes(hex64: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(bytes.fromhex(hex64)), dtype=torch.uint8)


@register
class Saap(SparseMethod):
    name = "saap"
    plans_ahead = True  # KL to dense at 8K, default model's small SAAP model: 0.210 true query ℓ 2, 0.154 ahead ℓ 3
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

    def open(self, index, params, ctx):
        if index is None:
            raise ValueError("saap needs its built index (key buckets); build it at registration")
        ident = index.layer("model_id", 0).cpu()
        fingerprint, digest = bytes(ident[:32].tolist()).hex(), bytes(ident[32:].tolist()).hex()
        model = self.load_model(params, fingerprint, ctx.env)
        if model.digest != digest:
            raise MethodUnavailable(f"this context's saap index was built with trained model {digest[:16]}, but "
                             f"{model.dir} now holds {model.digest[:16]} (retrained?); delete the context and "
                             f"register it again to rebuild its index")
        # per trained layer, once per request (host reads are fine here, never in plan): the plan's
        # width K (the nprobe largest buckets of the layer, over its KV heads) and the trained weights
        # on the index's device (loaded and sha256-checked once per process and device): fp32 for the
        # torch path, bf16 matrices for the fused GPU plan (index on CUDA, Triton present, shape supported)
        nprobe = min(params.nprobe, model.n_clusters)
        spec = ctx.spec
        group = spec.num_heads // spec.num_kv_heads if spec is not None else 1
        widths, weights, use_kernels, kern = {}, {}, False, None
        for layer in sorted(model.layers):
            offsets = index.layer("offsets", layer)
            widths[layer] = probe_width(offsets, nprobe)
            kern = saap_kernels() if offsets.device.type == "cuda" else None  # no Triton import for a CPU index
            use_kernels = kern is not None and not kern.unsupported(model.head_dim, group, model.n_clusters, nprobe)
            if use_kernels:
                model.kernel_layer(layer, offsets.device)
            else:
                weights[layer] = model.layer(layer, offsets.device)
        planner = _SaapPlanner(index, params, ctx, model, widths, weights, use_kernels)
        if use_kernels:  # the de-RoPE table of the request's positions, made here rather than in a step
            planner._rope = kern.rope_table(ctx.n_ctx, planner._steps, model.head_dim, model.rope_theta, offsets.device)
        return planner
