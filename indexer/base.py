"""The sparse-method interface: methods *plan*, attention backends *run*.

Every method (full, topk, streaming, csattn, ...) is one module in `indexer/` that defines a
`SparseMethod` subclass decorated with `@register`, listed in `indexer/registry.py`; the service
finds it by name, so adding a method is adding a file and its line there. The split follows flashinfer's `plan()`/`run()` and vLLM's metadata
builder / attention impl: a method decides *which* context tokens a query attends; it never
computes attention. `decoder/backends/` computes it (`torch_ref`, the reference; `offload`,
context K/V in host memory; `triton`, fused kernels).

Life cycle, in faiss terms (`train/add/search`):

* `validate_configuration(spec, params, env) -> [reasons]`: empty when the method can run here.
* `build(capture, params, env) -> {name: tensor}`: prefill worker, once per context. Input: the
  captured post-RoPE Q/K/V of every layer. Output: arrays with a leading layer dimension, persisted
  with the context (`storage/artifacts.py`), served per layer by the decode worker's tiers
  (GPU > DRAM > zarr) and never written afterwards.
* `open(index, params, ctx) -> Planner`: decode worker, once per request; the planner holds the
  request's private state.
* `planner.plan(layer, q, kv) -> Plan`: once per layer and decode step. The context positions the
  query group attends besides the *frame* (below), as a fixed-shape tensor.
* `planner.update(layer, k, v, positions)`: after the step's attention; the planner commits what
  it learned from the step (CTkvr's centroid FIFO, LFPS's score tables). `plan` only reads state,
  so a plan can be made ahead or thrown away.

The decode frame (attended by every backend, for every method; `frame_bounds`):

* the first `sink` context tokens, the context tokens inside the recent `window` of the query, and
  **every request-local token** (question + generated so far, causal). A request's own tokens are
  bounded by the service (question + max_tokens), so attending all of them costs at most a few
  hundred rows, needs no search and no index, and removes every request-length-dependent shape
  from the plans;
* plus the plan's positions: context positions in [0, N) outside the sink and the window (a
  backend masks any that fall inside them, so nothing is counted twice).

Plans are fixed-shape and sync-free: `positions` is [KVH, T, K] int32 with K fixed by
(params, n_ctx, the index) and -1 for an empty slot; nothing in `plan`/`update` reads a device
value back on the host (no `.item()`, `bool(t)`, `nonzero`, data-dependent shapes), so a decode
step can be captured in a CUDA graph.

Parameters are one pydantic model per method (`extra="forbid"`, every field constrained), so bad
values are rejected with a 4xx before any work starts. Fields listed in `build_fields` change the
persisted arrays and therefore the index identity (`params_hash`); all other fields are decode-time
and may be overridden per request.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from indexer.registry import get_method, method_names, register  # noqa: F401 - callers import them from here
from storage.keys import IndexId, params_hash


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


def budget(n: int, *, k: int | None = None, ratio: float | None = None, default: int | None = None) -> int:
    """Tokens a top-K method selects over a context of n tokens: `k` if set, else ceil(ratio·n),
    else `default`; at least 1, at most n. The one budget rule every method uses (plans are sized
    from the context, never from the request's growing length)."""
    if k is not None:
        got = k
    elif ratio is not None:
        got = math.ceil(ratio * n)
    elif default is not None:
        got = default
    else:
        raise ValueError("budget needs k, ratio or a default")
    return max(1, min(got, n))


class MethodParams(BaseModel):
    """The decode frame shared by every method: exact attention over the sink, the recent window,
    the request's own tokens and the plan's positions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sink: int = Field(4, ge=0, le=4096, description="first tokens always attended (attention sinks)")
    window: int = Field(32, ge=0, le=65536, description="most recent tokens always attended")

    build_fields: ClassVar[frozenset[str]] = frozenset()
    # Fields that count context tokens or groups of them (a frame, centroids, clusters, lists,
    # blocks, probes): plans, frames and builds are sized from them and not all are clamped to the
    # context, so a value above its length only adds cost. Whichever of these a method's params have
    # is bounded by `context_limits`; a method may list others. Not `k`: `budget()` clamps it to the
    # context, and k above n is the documented way to select every token.
    context_bounded: ClassVar[frozenset[str]] = frozenset({
        "sink", "window", "recent", "n_centroids", "n_clusters", "list_size", "list_len", "init_steps",
        "table_sink", "block_size", "probe", "nprobe"})

    def context_limits(self, n_ctx: int) -> dict[str, int]:
        """The largest sane value of each context-bounded field for a context of n_ctx tokens. The
        service refuses a request that gives more (422 `invalid_parameter`) before any work starts."""
        return {f: n_ctx for f in self.context_bounded
                if f in type(self).model_fields and isinstance(getattr(self, f), int | None)}  # saap's `probe` is a name

    def build_params(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if k in self.build_fields}

    def with_overrides(self, overrides: dict) -> "MethodParams":
        return type(self).model_validate({**self.model_dump(), **overrides})

    def frame(self, n_ctx: int) -> tuple[int, int]:
        """(sink, window) the backend attends for a context of n_ctx tokens. A method whose dense
        part depends on the context length (SAAP's `recent`) widens the window here."""
        return self.sink, self.window

    def widened(self, factor: float) -> "MethodParams":
        """These params with the search's budget `factor` (>= 1) times as wide, for plans made from a
        predicted query (the runner's `plan_ahead`, service setting `plan_ahead_widen`): the extra rows
        buy back what the prediction costs (benchmarks/RESULTS.md). Never a build field, so the
        index stays the same. Factor 1, or a method without a search budget (full, streaming): itself."""
        return self if factor == 1 else self._widen(factor)

    def _widen(self, factor: float) -> "MethodParams":
        """`widened` for factor != 1: what a method with a search budget overrides."""
        return self

    def _capped(self, name: str, value: float) -> float:
        """value, at most the field's upper bound (`le`)."""
        for m in type(self).model_fields[name].metadata:
            if getattr(m, "le", None) is not None:
                value = min(value, m.le)
        return value


class BudgetParams(MethodParams):
    """Params of a method whose plans hold a top-K of the context (topk, csattn, ctkvr, kivf,
    lfps): K = `budget(n_ctx)`, the module-level `budget` rule over `k` and `budget_ratio`, else
    `default_k`. A subclass declares its own `k` and `ratio` fields (their bounds, defaults and
    descriptions are its own) and overrides only what differs: `default_k` (CTkvr's 512 when
    neither is set) or `budget_ratio` (CSAttn's ratio comes from `rho` or a schedule)."""

    default_k: ClassVar[int | None] = None
    ratio_field: ClassVar[str] = "ratio"  # the field `budget_ratio` reads when set (CSAttn's `rho`)

    @property
    def budget_ratio(self) -> float | None:
        return self.ratio

    def budget(self, n_ctx: int) -> int:
        """K, the context positions a plan holds per (KV head, token), from the context length."""
        return budget(n_ctx, k=self.k, ratio=self.budget_ratio, default=self.default_k)

    def _widen(self, factor: float) -> "BudgetParams":
        """K `factor` times as large: `k` if set, else the ratio (capped at 1), else `default_k`."""
        if self.k is None and self.budget_ratio is not None:
            return self.with_overrides({self.ratio_field: min(1.0, round(self.budget_ratio * factor, 12))})
        k = self.k if self.k is not None else self.default_k
        return self.with_overrides({"k": self._capped("k", math.ceil(k * factor))})


@dataclass
class PrefillCapture:
    """What the prefill worker hands to `build`: every layer's post-RoPE tensors (CPU).

    q: [L, H, N, D]; k, v: [L, KVH, N, D]; positions: [N] (0..N-1); `spec` is the ModelSpec
    (rope_theta etc. for methods that need de-RoPE'd vectors, see indexer/rope.py).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    spec: object

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class DecodeContext:
    """What `open` learns about the request: the context length, the model's shape, the most
    request-local tokens the request can have (question + max new tokens: private state that grows
    with the request is allocated once at this size) and the method environment."""

    n_ctx: int
    spec: object = None
    max_local: int = 1024
    env: MethodEnv | None = None


@dataclass
class KVView:
    """Keys/values one decode step may look at, for one layer.

    ctx_k/ctx_v: the persisted context [KVH, N, D] (positions 0..N-1); loc_k/loc_v: the request's own
    tokens [KVH, M, D] at positions N..N+M-1. M may be a capacity: slots after the last query are
    unused, and which ones a query sees follows from q_pos alone (local slot j is visible to query
    t iff N + j <= q_pos[t]). q_pos: [T] absolute positions of the query tokens, on the query's device.
    v_cache: a `decoder.kernels.stage.RowCache` of ctx_v's rows in GPU memory (one-token steps whose
    ctx_v is in host memory): the `triton` backend reads the plan's rows it holds from it, and
    refreshes it (v_staged: already filled for this step, only read); the same values as ctx_v, so
    every other reader ignores it.
    attend_scale: set by a caller whose backend takes a planner's attention (`AttentionBackend.
    takes_attended`) to the scale it will attend with: a planner that can attend its plan while it
    searches (psa's and CTkvr's fused plans) may then return the result as `Plan.attended`. None: plan only.
    """

    ctx_k: torch.Tensor
    ctx_v: torch.Tensor
    loc_k: torch.Tensor
    loc_v: torch.Tensor
    q_pos: torch.Tensor
    v_cache: object = None
    v_staged: bool = False
    attend_scale: float | None = None

    @property
    def n_ctx(self) -> int:
        return self.ctx_k.shape[1]


def graph_capturing(t: torch.Tensor) -> bool:
    """True while the current CUDA stream records a graph (t: a tensor of the step, for its device).
    Host-side diagnostics of a step (planner stats, the runner's K/V-fraction count) skip their
    device work then: a replayed graph would repeat it every token, and its host half never runs."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def frame_bounds(q_pos: torch.Tensor, n_ctx: int, sink: int, window: int) -> tuple[int, torch.Tensor]:
    """The frame's context part per query token: the sink is [0, s_end), the window is
    [w_lo[t], n_ctx); a plan selects in [s_end, w_lo[t]). Returns (s_end, w_lo [T] int64).

    Queries are request tokens (q_pos >= n_ctx), so the window covers at most `window` - 1 context
    tokens, and none once the request is `window` tokens long."""
    s_end = min(sink, n_ctx)
    w_lo = (q_pos.long() - window + 1).clamp(min=s_end, max=n_ctx)
    return s_end, w_lo


def frame_rows(positions: torch.Tensor | None, q_pos: torch.Tensor, n_ctx: int, kvh: int, sink: int, window: int
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Context rows one step attends, fixed shape: (rows [KVH, T, R] int64 in [0, N), ok [KVH, T, R]
    bool, n_frame). R = n_frame + K; the first n_frame = s_end + window slots are the sink and the
    window (ok where inside the context), the last K the plan's positions (ok where valid and not
    already in the sink or window: duplicates are masked here, never sorted away)."""
    s_end, w_lo = frame_bounds(q_pos, n_ctx, sink, window)
    t = q_pos.shape[0]
    dev = q_pos.device
    win = w_lo[:, None] + torch.arange(window, device=dev)  # [T, W]
    fixed = torch.cat([torch.arange(s_end, device=dev).expand(t, s_end), win], dim=-1)
    fixed_ok = torch.cat([torch.ones(t, s_end, dtype=torch.bool, device=dev), win < n_ctx], dim=-1)
    rows, ok = fixed.expand(kvh, t, -1), fixed_ok.expand(kvh, t, -1)
    if positions is not None:
        pos = positions.to(dev).long()
        pos_ok = (pos >= s_end) & (pos < w_lo[None, :, None])
        rows, ok = torch.cat([rows, pos], dim=-1), torch.cat([ok, pos_ok], dim=-1)
    return rows.clamp(0, max(n_ctx - 1, 0)), ok, s_end + window


@dataclass
class BlockList:
    """A plan's positions given as whole blocks of `size` tokens (psa's budget plan on a GPU: its select
    writes one id per block instead of one position per token, and the `triton` backend expands them
    in its chunk loop). Row (h, t)'s positions are its ids' tokens in order, id·size + j for j < size,
    each kept where the id is >= 0 and the token lies in [s_end, w_lo[t]) (`frame_bounds`: where a plan
    selects), else -1. `positions` expands them with torch for every other reader, on each read (the ids
    may be a buffer a replayed graph rewrites); nothing is computed when the list is made, so a
    graph-captured step holds no expansion.

    ids: [KVH, T, nblk] int32, -1 = none. q_pos [T], n_ctx, sink, window: the step's frame."""

    ids: torch.Tensor
    size: int
    q_pos: torch.Tensor
    n_ctx: int
    sink: int
    window: int

    @property
    def width(self) -> int:
        return self.ids.shape[-1] * self.size

    def frame_is(self, q_pos: torch.Tensor, n_ctx: int, sink: int, window: int) -> bool:
        """Whether the list was made for this frame (a backend that reads the ids masks the frame itself)."""
        return q_pos is self.q_pos and (n_ctx, sink, window) == (self.n_ctx, self.sink, self.window)

    @property
    def positions(self) -> torch.Tensor:
        """[KVH, T, nblk·size] int32, the plan's positions as `Plan.positions` defines them."""
        s_end, w_lo = frame_bounds(self.q_pos, self.n_ctx, self.sink, self.window)
        ids = self.ids.long()[..., None]  # [KVH, T, nblk, 1]
        tok = ids * self.size + torch.arange(self.size, device=ids.device)
        ok = (ids >= 0) & (tok >= s_end) & (tok < w_lo.to(ids.device)[None, :, None, None])
        return torch.where(ok, tok, -1).to(torch.int32).flatten(-2)


class Plan:
    """One layer's decode-step plan: what the query group attends besides the frame.

    positions: [KVH, T, K] int32 context positions in [0, N), distinct within a row, -1 = empty
        slot; K is fixed for (params, n_ctx, index), never by the step. None = dense attention over
        every visible token. Given as a tensor, or as a `BlockList` (`blocks`), expanded by each read
        of `positions`: a backend that reads blocks never asks for it (`width` is K either way).
    bypass: optional [KVH, G, T] bool: query heads that ignore `positions` (frame only), e.g.
        LFPS's highly sparse heads.
    rest_logit / rest_value: optional pseudo-token standing for the context tokens a head does not
        attend (LFPS's bypass output: the mean value, weighted by a log-normal estimate of their
        mass): logit [KVH, G, T] fp32 (-inf = none), value [KVH, D].
    lengths: optional [KVH, T] int32, a bound on each row's filled part: positions[h, t,
        lengths[h, t]:] are all -1 (slots below it may be -1 too). Planners whose rows are
        valid-first with a -1 tail (psa, saap) give it, so a backend can skip the tail (the triton
        backend divides only the live rows over its programs); it never changes what is attended.
    attended: optional `Attended`: this plan's attention, computed by the planner while it searched
        (asked for by `KVView.attend_scale`); a backend that takes it returns it instead of running.
    """

    def __init__(self, positions: "torch.Tensor | BlockList | None", bypass: torch.Tensor | None = None,
                 rest_logit: torch.Tensor | None = None, rest_value: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None, attended: "Attended | None" = None):
        self.blocks = positions if isinstance(positions, BlockList) else None
        self._positions = None if self.blocks is not None else positions
        self.bypass = bypass
        self.rest_logit = rest_logit
        self.rest_value = rest_value
        self.lengths = lengths
        self.attended = attended

    @classmethod
    def dense(cls) -> "Plan":
        return cls(None)

    @property
    def positions(self) -> torch.Tensor | None:
        return self.blocks.positions if self.blocks is not None else self._positions

    @property
    def is_dense(self) -> bool:
        return self.blocks is None and self._positions is None

    @property
    def width(self) -> int:
        """K, the plan's slots per row (0 when dense), without expanding a block list."""
        if self.blocks is not None:
            return self.blocks.width
        return 0 if self._positions is None else self._positions.shape[-1]

    def __repr__(self) -> str:
        what = "dense" if self.is_dense else f"blocks of {self.blocks.size}" if self.blocks is not None else "positions"
        return f"Plan({what}, width {self.width})"


@dataclass(frozen=True)
class Attended:
    """A plan's attention computed by its planner: the exact attention of `query` over the frame
    (sink, window, every visible request-local token) and the plan's positions at `scale`, what an
    attention backend's `run(query, kv, plan, sink, window, scale)` computes, up to summation order.
    psa's fused plan computes it from the scores its exact sums take anyway, CTkvr's in a launch that
    starts while its select runs (`indexer/kernels/ivf.py`), so a step needs no
    attention launches after the plan (`indexer/kernels/psa.py`). It is valid for exactly that query
    tensor and frame: `serves` checks them, and a backend runs as usual where they differ (a plan made
    ahead from a predicted query never carries one).

    out: [KVH, G, T, D] in the query's dtype."""

    query: torch.Tensor
    sink: int
    window: int
    scale: float
    out: torch.Tensor

    def serves(self, q: torch.Tensor, sink: int, window: int, scale: float) -> bool:
        return q is self.query and (sink, window, scale) == (self.sink, self.window, self.scale)


class IndexReader:
    """Per-layer access to one method's persisted arrays, served by the decode worker's tiers
    (resident on the planning device after the first use). Read only."""

    def __init__(self, load_layer, names: list[str]):
        self._load_layer = load_layer  # (name, layer) -> tensor
        self.names = names

    def layer(self, name: str, layer: int) -> torch.Tensor:
        return self._load_layer(name, layer)


class Planner(ABC):
    """Per-request state of a method. Private to one request.

    `graph_safe`: whether a one-token step's plan()/update() may be captured once in a CUDA graph
    and replayed (`decoder.runner`): True unless plan()/update() branch on host-side state that
    changes per step (csattn with a search period > 1 reuses a plan by a host-side count) or
    allocate persistent state after the request's first one-token step. Host-side counters kept for
    `stats()` only are allowed; they undercount replayed steps.

    `reads_query`: whether plan() depends on q at all (False for the frame-only and dense planners);
    the runner plans ahead (`decoder.runner`, `plan_ahead`) only for requests whose planner reads it.
    A planner that plans ahead is called as plan(L + 1) before update(L) of the same step, so its
    per-step state must be per layer (every planner here keeps it in dicts keyed by layer)."""

    graph_safe: bool = True
    reads_query: bool = True

    @abstractmethod
    def plan(self, layer: int, q: torch.Tensor, kv: KVView) -> Plan:
        """q: [KVH, G, T, D] post-RoPE queries on the planning device. Fixed shape, no host sync."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v: [KVH, T, D] keys/values the request just appended at `positions` [T], after the
        step's attention. Commit what this layer's last plan learned (optional)."""

    def stats(self) -> dict:
        """Method-specific numbers of this request (JSON-able), returned in the completion's
        `stats.method_stats`. Read back from the device here, never during a step. Empty by default."""
        return {}

    def close(self) -> None:
        """Release what the planner holds besides memory. Idempotent."""


class SparseMethod(ABC):
    name: ClassVar[str]
    Params: ClassVar[type[MethodParams]] = MethodParams
    version: ClassVar[int] = 1  # bump when the persisted layout of `build` changes
    has_index: ClassVar[bool] = False  # True when `build` persists arrays
    # planned ahead on a GPU by default (the service's plan_ahead "auto"): set where the plans made
    # from a predicted query with the budget widened (`MethodParams.widened`, plan_ahead_widen) stay at
    # least as close to dense as the method's own plans from the true query, and planning ahead so
    # pays on the GPU (faster at B = 1, not much slower at B = 8: RESULTS.md, session 22)
    plans_ahead: ClassVar[bool] = False

    def validate_configuration(self, spec, params: MethodParams, env: MethodEnv | None = None) -> list[str]:
        """Reasons this method cannot run for this model/params (empty = fine)."""
        return []

    def build(self, prefill: PrefillCapture, params: MethodParams, env: MethodEnv | None = None) -> dict[str, torch.Tensor]:
        return {}

    @abstractmethod
    def open(self, index: IndexReader | None, params: MethodParams, ctx: DecodeContext) -> Planner: ...

    def plan_width(self, params: MethodParams, n_ctx: int) -> int | None:
        """K, the context positions a plan holds per (KV head, token) besides the frame, for the
        service's cost estimate before a request runs (`service/limits.py`); None = dense plans
        (every visible token, read in place). Default: `budget(n_ctx)` for the top-K methods'
        params (`BudgetParams`), None for the bare frame's params (`full`), else n_ctx, the upper
        bound (a plan holds distinct context positions)."""
        if isinstance(params, BudgetParams):
            return params.budget(n_ctx)
        return None if type(params) is MethodParams else n_ctx

    def index_id(self, params: MethodParams, spec=None, env: MethodEnv | None = None) -> str:
        """The identity of the index `build` makes from these params: `<name>-<sha256 of version and
        build params>`. A method whose index also depends on something outside the params (SAAP: the
        trained model) adds it when given the model `spec` and `env`; the service always passes them."""
        return IndexId(self.name, params_hash(self.name, self.version, params.build_params())).to_string()
