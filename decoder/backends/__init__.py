"""Attention backends: they *run* what a method planned (`indexer.base.Plan`).

A backend computes exact attention for a step's queries over the decode frame (the sink, the
context part of the recent window, every request-local token; `indexer.base.frame_bounds`) plus
the plan's context positions, for one layer. It never decides what to attend.

* `torch_ref`: plain torch, float32 arithmetic. The reference every other backend is tested against.
* `offload`: the context K/V stay in host memory and the GPU's kernels read the rows a step
  attends in place, over PCIe (CSAttention's CPU<->GPU mode, for any method); `offload_v` keeps
  only the values there (the keys, which planners read, stay on the GPU).
* `triton`: fused split-K kernels (`decoder/kernels/`), the default on a GPU.

`frame_mask` / `frame_fraction` describe the attended token set without computing attention
(tests, `evaluation/fidelity.py`, decode statistics).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from indexer.base import KVView, Plan, frame_rows  # noqa: F401 - frame_rows is part of this module's API


class AttentionBackend(ABC):
    """Exact attention over (frame ∪ plan) for one layer and step."""

    name: ClassVar[str]
    #: the context arrays ("kv/k", "kv/v") the pipeline keeps in pinned host memory on a GPU worker and
    #: hands out as mapped CUDA views (`decoder.backends.offload`); empty: all on the GPU
    host_arrays: ClassVar[frozenset[str]] = frozenset()
    #: returns a plan's `attended` result when it serves the call (`indexer.base.Attended`) instead of
    #: running; callers then ask planners for it (`KVView.attend_scale`)
    takes_attended: ClassVar[bool] = False

    def validate_configuration(self, spec, device: str | torch.device, dtype: torch.dtype) -> list[str]:
        """Reasons this backend cannot run this model shape / device / dtype (empty = fine)."""
        return []

    @abstractmethod
    def run(self, q: torch.Tensor, kv: KVView, plan: Plan, sink: int, window: int, scale: float) -> torch.Tensor:
        """q [KVH, G, T, D] -> out [KVH, G, T, D] in q's dtype."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def _discover() -> None:
    from decoder.backends import offload, torch_ref  # noqa: F401

    try:
        from decoder.backends import triton as _triton  # noqa: F401
    except ImportError:  # triton not installed: the backend is simply not offered
        pass


def backend_names() -> list[str]:
    _discover()
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    _discover()
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise KeyError(f"unknown attention backend {name!r}; known: {', '.join(sorted(_BACKENDS))}") from None


def default_backend_name(device: str | torch.device) -> str:
    """`triton` on a GPU when it is installed, else `torch_ref`."""
    if torch.device(device).type == "cuda" and "triton" in backend_names():
        return "triton"
    return "torch_ref"


# ---------------------------------------------------------------------------------------------
# The attended set, without attention


def local_visible(q_pos: torch.Tensor, n_ctx: int, m: int) -> torch.Tensor:
    """[T, M] bool: request-local slot j (position N + j) is visible to query t (causal)."""
    return (n_ctx + torch.arange(m, device=q_pos.device))[None, :] <= q_pos[:, None]


def frame_mask(plan: Plan, kv: KVView, sink: int, window: int, group: int) -> torch.Tensor:
    """[KVH, G, T, N + M] bool: every position each query head attends (context, then local slots).
    The reference for backends ("dense attention masked to the plan's token set") and the attended
    set for recall metrics. The LFPS pseudo-token is not a position and is not in the mask."""
    kvh, n, m, t = kv.ctx_k.shape[0], kv.n_ctx, kv.loc_k.shape[1], kv.q_pos.shape[0]
    dev = kv.q_pos.device
    loc = local_visible(kv.q_pos, n, m)[None, None].expand(kvh, group, t, m)
    if plan.is_dense:
        ctx = (torch.arange(n, device=dev)[None, :] <= kv.q_pos[:, None])[None, None].expand(kvh, group, t, n)
        return torch.cat([ctx, loc], dim=-1)
    rows, ok, nf = frame_rows(plan.positions, kv.q_pos, n, kvh, sink, window)
    ok = ok[:, None].expand(kvh, group, t, -1).clone()
    if plan.bypass is not None:
        ok[..., nf:] &= ~plan.bypass.to(dev)[..., None]
    ctx = torch.zeros(kvh, group, t, n + 1, dtype=torch.bool, device=dev)
    ctx.scatter_(-1, torch.where(ok, rows[:, None].expand_as(ok), n), True)
    return torch.cat([ctx[..., :n], loc], dim=-1)


def frame_fraction(plan: Plan, kv: KVView, sink: int, window: int) -> torch.Tensor:
    """[KVH, T] float32: fraction of the visible KV the step reads (a KV head reads the plan's rows
    unless all of its query heads bypass them). On the device, no sync."""
    kvh, n, t = kv.ctx_k.shape[0], kv.n_ctx, kv.q_pos.shape[0]
    visible = (kv.q_pos + 1).float()  # [T]
    if plan.is_dense:
        return torch.ones(kvh, t, device=kv.q_pos.device)
    _, ok, nf = frame_rows(plan.positions, kv.q_pos, n, kvh, sink, window)
    fixed = ok[..., :nf].sum(-1).float()
    chosen = ok[..., nf:].sum(-1).float()
    if plan.bypass is not None:
        chosen = chosen * (~plan.bypass.to(ok.device)).any(1).float()
    local = (kv.q_pos - n + 1).clamp(min=0).float()
    return (fixed + chosen + local[None]) / visible[None]
