"""The decode runner's per-request state and the records of its one-token steps (`decoder/runner.py`).

`Request` is what the runner keeps for one request: its static request-local K/V buffers and the
device scalars a captured step advances in place. `CapturedStep` is a CUDA graph of one batch's
one-token step with its static outputs. `Issued` is a one-token step that has been enqueued and whose
tokens have not been read yet: with `Runner(pipelined=True)` the next step is issued before this one's
tokens are read, so its outputs are copied out of the graph's buffers first (`Issued.of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoder.kernels.stage import RowCache
from indexer.base import Planner


@dataclass(eq=False)  # identity: the runner finds a request in a step's list by `in` (fields hold tensors)
class Request:
    slot: int
    planner: Planner
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [KVH, N, D], held while active
    n_ctx: int
    sink: int
    window: int
    loc_k: torch.Tensor  # [L, KVH, max_local, D] the request's own keys (question + generated)
    loc_v: torch.Tensor
    question: torch.Tensor  # [Tq] int64 on the device
    tok: torch.Tensor  # [1] int64: the next input token (written by the step that sampled it)
    pos: torch.Tensor  # [1] int64: absolute position of the next input token
    temperature: torch.Tensor  # [1] fp32
    seed: torch.Tensor  # [1] int64
    max_new: int
    hot: bool  # temperature > 0
    safe: bool  # graph_safe(planner)
    ahead: bool  # its one-token steps are planned ahead (the runner's plan_ahead; its planner reads the query)
    produced: int = 0
    started: bool = False  # the question chunk has run
    warm: bool = False  # one eager one-token step has run
    finish_reason: str | None = None  # "stop" | "length" once finished
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [V] fp32 of the step whose token was returned last
    slot_base: torch.Tensor | None = None  # [2, L] int64: addresses of loc_k[l], loc_v[l] (fused slot writes)
    head_stride: torch.Tensor | None = None  # [1] int64: elements between two heads of loc_k[l] (max_local x D)
    touched: torch.Tensor | None = None  # [L] fp64 sums of frame fractions (track_fraction)
    row_caches: dict = field(default_factory=dict)  # layer -> RowCache (the runner's cache_rows)
    counted: int = 0  # (kv head, query token) pairs summed in `touched`, per layer
    own_bytes: int | None = None  # `nbytes()`, kept until a row cache is made

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def row_cache(self, layer: int, k: int, like: torch.Tensor) -> RowCache:
        """The cache of layer `layer`'s context value rows its last plans read (`RowCache`, its default
        plans kept; plans of k positions; like: the [KVH, N, D] values, for shape, dtype and device).
        Made at the layer's first one-token step, which runs eagerly, before any capture (the
        runner's graph rules)."""
        cache = self.row_caches.get(layer)
        kvh, n, d = like.shape
        if cache is None or not cache.fits(kvh, n, k):
            cache = self.row_caches[layer] = RowCache.empty(kvh, n, k, d, like.dtype, like.device)
            self.own_bytes = None
        return cache

    def nbytes(self) -> int:
        """Device memory the request holds of its own: its request-local K/V and its row caches (made at
        its first one-token step), not the context's arrays it reads."""
        if self.own_bytes is None:
            self.own_bytes = sum(t.numel() * t.element_size() for t in (self.loc_k, self.loc_v)) + sum(
                c.nbytes for c in self.row_caches.values())
        return self.own_bytes

    def cache_counts(self) -> tuple[int, int]:
        """(plan rows served from the row caches, plan rows read) over the layers so far (a host sync)."""
        if not self.row_caches:
            return 0, 0
        hits, rows = torch.stack([c.counts for c in self.row_caches.values()]).sum(0).tolist()
        return int(hits), int(rows)


@dataclass
class CapturedStep:
    key: tuple  # the batch's slots
    graph: object  # torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B] int64, static output
    logits: torch.Tensor  # [B, V] fp32, static output


@dataclass
class Issued:
    """A one-token step of `reqs`, enqueued on the device, tokens not read yet."""

    reqs: list[Request]
    tokens: torch.Tensor  # [B] int64: on CUDA a pinned host copy, valid once `done` has completed
    logits: torch.Tensor  # [B, V] fp32, the step's own (a later replay does not overwrite it)
    done: torch.cuda.Event | None  # recorded after the copies (None on the CPU: already done)
    status: str  # how it ran: the runner's `graph_status` of that step

    @classmethod
    def of(cls, reqs: list[Request], tokens: torch.Tensor, logits: torch.Tensor, status: str) -> Issued:
        """The step's outputs copied where the next step cannot overwrite them (a graph's outputs are
        static buffers), in stream order: no host sync."""
        if tokens.device.type != "cuda":
            return cls(reqs, tokens.clone(), logits.clone(), None, status)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(reqs, host, logits.clone(), done, status)

    def settle(self) -> None:
        """Wait until the step has run: before its tokens are read, or a buffer or a graph it uses is
        released."""
        if self.done is not None:
            self.done.synchronize()
