"""One pipeline for building and opening a context, used by the workers (`service/jobs/`) and
by the evaluation harness (`evaluation/harness.py`), so both run the same code path.

* `build_context`: prefill once (capture Q/K/V), build every requested index, publish the context
  atomically (or add the indexes to an already published one).
* `open_context`: a request's decode side: the context's K/V and the method's index arrays served
  by the caller's tiers (`ContextTiers`: GPU > DRAM > zarr) where the attention backend reads them,
  the method's planner, and the backend. Index ids are computed once by the caller (the API puts
  them into the job) and passed in.

Where arrays live during decode: on a GPU worker, on the GPU (loaded once per context and kept by
the GPU tier across steps and requests), except that `offload` keeps the context's K/V pinned in
DRAM and the kernels read them in place (`decoder/backends/offload.py`); on a CPU worker, in DRAM.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoder.backends import AttentionBackend, get_backend
from decoder.backends.offload import mapped
from decoder.host_memory import pinned_copy
from decoder.generate import ContextKV
from decoder.prefill import prefill
from indexer.base import DecodeContext, IndexReader, MethodEnv, MethodParams, Planner, SparseMethod
from storage.artifacts import ContextArtifacts, ContextStore, IndexArrays
from storage.keys import KV_DTYPES, IndexId, PromptHash
from storage.tier import TensorTier


# ---------------------------------------------------------------------------------------------
# Build (prefill worker)


@dataclass
class BuildResult:
    manifest: dict
    prefill_s: float
    built: dict[str, float] = field(default_factory=dict)  # index_id -> build seconds
    failed: dict[str, str] = field(default_factory=dict)  # index_id -> error (only with keep_going)


def _stored_kv(k: torch.Tensor, v: torch.Tensor, kv_dtype: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The captured K/V [L, KVH, N, D] in the dtype they are stored in (None: as captured);
    round-to-nearest-even, torch's cast."""
    if kv_dtype is None:
        return k, v
    dt = getattr(torch, kv_dtype)
    return k.to(dt), v.to(dt)


def build_context(
    lm,
    store: ContextStore,
    key: PromptHash,
    tokens: list[int],
    todo: dict[str, tuple[SparseMethod, MethodParams]],
    *,
    env: MethodEnv | None = None,
    chunk_tokens: int = 512,
    progress: Callable[[float], None] | None = None,
    on_index: Callable[[int, int], None] | None = None,
    manifest_extra: dict | None = None,
    keep_going: bool = False,
    kv_dtype: str | None = None,
) -> BuildResult:
    """Prefill `tokens` and build the indexes in `todo` (index_id -> (method, params)); publish the
    context, or add the indexes when it is already published. `progress(f)` reports the prefill's
    fraction done, `on_index(i, n)` each finished index. With `keep_going`, a failing index build is
    recorded in `failed` and the others still publish (the eval harness); without, it raises.

    `kv_dtype` (a `storage.keys.KV_DTYPES` name; None = the model's dtype) is what the K/V are
    stored in; `key` must be the prompt hash for that dtype. Indexes are built from the capture as
    the model computed it, before the cast: they are then the same for every stored dtype, also
    when an index is added later to a published context (its prefill runs again)."""
    spec = lm.spec
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:  # refused before the prefill, not after it
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
    published = store.exists(spec.slug, key)
    t0 = time.perf_counter()
    cap = prefill(lm, tokens, chunk_tokens=chunk_tokens, keep_q=bool(todo), progress=progress)
    t_prefill = time.perf_counter() - t0
    builds, failed = [], {}
    for i, (index_id, (method, params)) in enumerate(sorted(todo.items())):
        t1 = time.perf_counter()
        try:
            arrays = method.build(cap, params, env)
        except Exception as e:
            if not keep_going:
                raise
            failed[index_id] = f"{type(e).__name__}: {e}"[:500]
            continue
        builds.append(IndexArrays(method.name, method.version, params.build_params(), IndexId.from_string(index_id).params_hash,
                                  {k: v.cpu() for k, v in arrays.items()}, time.perf_counter() - t1))
        if on_index is not None:
            on_index(i + 1, len(todo))
    timings = {"prefill_s": round(t_prefill, 4), "prefill_tokens_per_s": round(len(tokens) / max(t_prefill, 1e-9), 1),
               "index_s": {b.method: round(b.build_s, 4) for b in builds}}
    if published:
        manifest = store.add_indexes(spec.slug, key, builds)
    else:
        k, v = _stored_kv(cap.k, cap.v, kv_dtype)
        del cap  # the capture (Q too) is not needed past here: free it before the write
        manifest = store.publish(key, spec, tokens, k, v, builds, {"timings": timings, **(manifest_extra or {})})
    return BuildResult(manifest, t_prefill, {b.index_id: b.build_s for b in builds}, failed)


# ---------------------------------------------------------------------------------------------
# Open (decode worker)


class ContextTiers:
    """A decode worker's memory tiers: DRAM always, GPU when it decodes on a GPU. Keys are
    (context id, array name, layer)."""

    def __init__(self, dram_bytes: int, gpu_bytes: int = 0, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.dram = TensorTier(dram_bytes, "dram")
        self.gpu = TensorTier(gpu_bytes, "gpu") if self.device.type == "cuda" else None

    def drop(self, cid: str) -> None:
        self.dram.drop(cid)
        if self.gpu is not None:
            self.gpu.drop(cid)

    def snapshot(self) -> list[dict]:
        return [t.snapshot() for t in (self.dram, self.gpu) if t is not None]


@dataclass
class LoadStats:
    """What one request's loads cost: seconds, hits/misses per tier, and the arrays it holds.

    `held` keeps a reference to every array the request has loaded, for as long as the request
    lives: a tier may evict an entry meanwhile, but its memory stays valid for this request (a
    captured CUDA graph reads raw device pointers, so freeing an array under a live request would
    make a replay read reused memory)."""

    s: float = 0.0
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    held: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def count(self, tier: str, hit: bool) -> None:
        d = self.hits if hit else self.misses
        d[tier] = d.get(tier, 0) + 1


@dataclass
class OpenedContext:
    kv: ContextKV
    planner: Planner
    backend: AttentionBackend
    params: MethodParams
    resident: torch.device  # the device the step reads from (offload: the context's K/V are mapped host memory)
    loads: LoadStats
    load: Callable[[str, int], torch.Tensor]  # (array name, layer) -> tensor, through the tiers

    @property
    def kv_device(self) -> str:
        """Where the context's K/V bytes live: "cpu" for host memory (which `offload` maps into the
        GPU's address space), else the device (`offload_v`: the keys' device, values in host memory)."""
        host = self.backend.host_arrays
        if self.resident.type == "cpu" or host >= CONTEXT_ARRAYS:
            return "cpu"
        return f"{self.resident} (values: cpu)" if host else str(self.resident)


CONTEXT_ARRAYS = frozenset({"kv/k", "kv/v"})


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_pinned() else pinned_copy(t)  # huge pages: pins a context's arrays ~11x faster


def _loader(art: ContextArtifacts, cid: str, tiers: ContextTiers, resident: torch.device, loads: LoadStats,
            host_arrays: frozenset[str]):
    """(name, layer) -> tensor where the step reads it. On a GPU, the arrays named in `host_arrays`
    (the `offload` backends' context K/V) are pinned in the DRAM tier and handed out as mapped CUDA
    views; everything else goes through the GPU tier."""

    def from_dram(name: str, layer: int, pin: bool = False) -> torch.Tensor:
        read = (lambda: _pinned(art.read(name, layer))) if pin else (lambda: art.read(name, layer))
        t, hit = tiers.dram.get((cid, name, layer), read)
        loads.count("dram", hit)
        return t

    def load(name: str, layer: int) -> torch.Tensor:
        t = loads.held.get((name, layer))
        if t is not None:
            return t
        t0 = time.perf_counter()
        if resident.type != "cuda" or tiers.gpu is None:
            t = from_dram(name, layer)
        elif name in host_arrays:
            # an unpinned copy another backend left in the tier is pinned for this request only
            t = mapped(_pinned(from_dram(name, layer, pin=True)), resident)
        else:
            t, hit = tiers.gpu.get((cid, name, layer), lambda: from_dram(name, layer).to(resident))
            loads.count("gpu", hit)
        loads.held[name, layer] = t
        loads.s += time.perf_counter() - t0
        return t

    return load


def open_context(
    art: ContextArtifacts,
    cid: str,
    method: SparseMethod,
    params: MethodParams,
    index_id: str | None,
    *,
    tiers: ContextTiers,
    spec,
    backend: str | AttentionBackend = "torch_ref",
    max_local: int = 1024,
    env: MethodEnv | None = None,
) -> OpenedContext:
    """The decode side of one request on a stored context. `index_id` is the method's index as the
    API resolved it (None for index-free methods); the caller checked it exists in `art`."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    resident = tiers.device
    loads = LoadStats()
    load = _loader(art, cid, tiers, resident, loads, be.host_arrays)
    index = None
    if method.has_index:
        prefix = f"indexes/{index_id}/"
        index = IndexReader(lambda name, layer: load(prefix + name, layer), art.index_arrays(index_id))
    planner = method.open(index, params, DecodeContext(art.n_tokens, spec, max_local, env))
    return OpenedContext(ContextKV(art.n_tokens, load), planner, be, params, resident, loads, load)
