"""The sparse-method interface. Every method (full, topk, streaming, csattn, ...) is one module in
`indexer/` that defines a `SparseMethod` subclass decorated with `@register`; the service finds it
by name, so adding a method is adding a file.

Life cycle, in faiss terms (`train/add/search`):

* `build(prefill, params, env) -> {name: tensor}`: prefill worker, once per context. Input: the
  captured post-RoPE Q/K/V of every layer. Output: arrays with a leading layer dimension, persisted
  with the context (`storage/artifacts.py`), loaded lazily per layer by the decode worker.
* `open(index, params, n_ctx, env) -> MethodSession`: decode worker, once per request. The session holds
  the request's private state; the persisted arrays (shared by all requests, cached in DRAM) are
  never mutated.
* `session.select(layer, q, kv) -> positions`: once per layer and decode step ("plan"); the
  decoder unions the result with sink + recent window and runs exact attention over it ("run").
* `session.append(layer, k, v, positions)`: the keys the request just appended (question and
  generated tokens), for methods that keep their index current while decoding.

Parameters are one pydantic model per method (`extra="forbid"`, every field constrained), so bad
values are rejected with a 4xx before any work starts. Fields listed in `build_fields` change the
persisted arrays and therefore the index identity (`params_hash`); all other fields are decode-time
and may be overridden per request.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from storage.keys import params_hash


class MethodUnavailable(ValueError):
    """A method cannot serve this context as it stands (e.g. the trained model its index was built
    with is gone or was replaced). The service answers 409 `method_unavailable` with the message,
    which should say what to do."""


@dataclass(frozen=True)
class MethodEnv:
    """Where a method finds what lives outside a context: per-model resources trained offline
    (SAAP's classifier under `<data_dir>/saap/`). The service passes its own (`--data-dir`); library
    callers that pass none get `MethodEnv.default()`, the service's default location.

    `confined`: parameters come from API clients, so a path among them (SAAP's `model_dir`) must
    lie under `data_dir` (relative paths are taken from there). The service sets it; library and
    CLI callers may point anywhere."""

    data_dir: Path
    confined: bool = False

    def resolve(self, path: str | Path) -> Path:
        """A path given in method parameters: relative to `data_dir`; when `confined`, refused
        (ValueError) unless it resolves to a place under `data_dir` (symlinks followed)."""
        p = Path(path)
        if not self.confined:
            return p
        root = self.data_dir.resolve()
        full = (root / p).resolve()  # an absolute p replaces root
        if full != root and root not in full.parents:
            raise ValueError(f"{path!r} is outside the service's data directory; give a path under {self.data_dir}")
        return full

    @classmethod
    def default(cls) -> "MethodEnv":
        return cls(Path(os.environ.get("CTXCACHE_DATA_DIR", "data")))


class MethodParams(BaseModel):
    """Decode frame shared by every method: exact attention over sink + recent window + selection."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sink: int = Field(4, ge=0, le=4096, description="first tokens always attended (attention sinks)")
    window: int = Field(32, ge=0, le=65536, description="most recent tokens always attended")

    build_fields: ClassVar[frozenset[str]] = frozenset()

    def build_params(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if k in self.build_fields}

    def with_overrides(self, overrides: dict) -> "MethodParams":
        return type(self).model_validate({**self.model_dump(), **overrides})


@dataclass
class PrefillCapture:
    """What the prefill worker hands to `build`: every layer's post-RoPE tensors (CPU).

    q: [L, H, N, D]; k, v: [L, KVH, N, D]; positions: [N] (0..N-1); `spec` is the ModelSpec
    (rope_theta etc. for methods that need de-RoPE'd vectors, see decoder/rope.py).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    spec: object

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]


@dataclass
class KVView:
    """Keys/values one decode step may look at, for one layer.

    ctx_k/ctx_v: the persisted context [KVH, N, D]; loc_k/loc_v: the request's own tokens
    [KVH, M, D] (the last T of them are this step's queries). Positions: context 0..N-1, then
    N..N+M-1. q_pos: [T] absolute positions of the query tokens.
    """

    ctx_k: torch.Tensor
    ctx_v: torch.Tensor
    loc_k: torch.Tensor
    loc_v: torch.Tensor
    q_pos: torch.Tensor

    @property
    def n_ctx(self) -> int:
        return self.ctx_k.shape[1]

    @property
    def n_local(self) -> int:
        return self.loc_k.shape[1]


class IndexReader:
    """Lazy, per-layer access to one method's persisted arrays (through the DRAM tier)."""

    def __init__(self, load_layer, names: list[str]):
        self._load_layer = load_layer  # (name, layer) -> tensor
        self.names = names

    def layer(self, name: str, layer: int) -> torch.Tensor:
        return self._load_layer(name, layer)


class MethodSession(ABC):
    """Per-request state of a method. Private to one request."""

    @abstractmethod
    def select(self, layer: int, q: torch.Tensor, kv: KVView) -> torch.Tensor | None:
        """q: [KVH, G, T, D] post-RoPE queries. Return positions [KVH, T, K] (int64, -1 = empty
        slot) in [0, N + M) shared by the GQA group, or None for dense attention over everything."""

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [KVH, T, D] keys/values the request just appended at `positions` [T]."""

    def attend(self, layer: int, q: torch.Tensor, kv: KVView) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional: compute the attention output itself, for methods whose output is not exact
        attention over a token set (e.g. LFPS's bypass for highly sparse heads). Return
        (out [KVH, G, T, D], fraction of visible KV read [KVH, T]) or None to use select()."""
        return None

    def close(self) -> None:
        """Optional: release what the session holds besides memory (csattn's worker thread) when
        the request ends; `decoder.generate.generate` calls it. Idempotent."""

    def stats(self) -> dict:
        """Method-specific numbers of this request (JSON-able), returned in the completion's
        `stats.method_stats` (e.g. SAAP's selectivity per step). Empty by default."""
        return {}


class SparseMethod(ABC):
    name: ClassVar[str]
    Params: ClassVar[type[MethodParams]] = MethodParams
    version: ClassVar[int] = 1  # bump when the persisted layout of `build` changes
    has_index: ClassVar[bool] = False  # True when `build` persists arrays

    def host_resident(self, params: MethodParams) -> bool:
        """True: the decoder keeps this request's context K/V and index arrays in host memory even
        when the model runs on a GPU; the session ships what attention needs (csattn's offload mode)."""
        return False

    def validate_configuration(self, spec, params: MethodParams, env: MethodEnv | None = None) -> list[str]:
        """Reasons this method cannot run for this model/params (empty = fine)."""
        return []

    def build(self, prefill: PrefillCapture, params: MethodParams, env: MethodEnv | None = None) -> dict[str, torch.Tensor]:
        return {}

    @abstractmethod
    def open(self, index: IndexReader | None, params: MethodParams, n_ctx: int,
             env: MethodEnv | None = None) -> MethodSession: ...

    def index_id(self, params: MethodParams, spec=None, env: MethodEnv | None = None) -> str:
        """The identity of the index `build` makes from these params: `<name>-<sha256 of version and
        build params>`. A method whose index also depends on something outside the params (SAAP: the
        trained model) adds it when given the model `spec` and `env`; the service always passes them."""
        return f"{self.name}-{params_hash(self.name, self.version, params.build_params())}"


_REGISTRY: dict[str, SparseMethod] = {}
_BROKEN: dict[str, str] = {}  # module name -> import error
_DISCOVERED = False


def register(cls: type[SparseMethod]) -> type[SparseMethod]:
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"two sparse methods are named {cls.name!r}")
    _REGISTRY[cls.name] = cls()
    return cls


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    import indexer

    for mod in pkgutil.iter_modules(indexer.__path__):
        if not mod.name.startswith("_") and mod.name != "base":
            try:
                importlib.import_module(f"indexer.{mod.name}")
            except Exception as e:  # noqa: BLE001 - one broken method module must not take the service down
                _BROKEN[mod.name] = f"{type(e).__name__}: {e}"
                logging.getLogger("ctxcache").error("sparse method module indexer.%s failed to import: %s", mod.name, e)
    _DISCOVERED = True


def get_method(name: str) -> SparseMethod:
    _discover()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def method_names() -> list[str]:
    _discover()
    return sorted(_REGISTRY)
