"""`offload`: the context's K/V stay in host memory; only the rows a step attends cross PCIe.

CSAttention's CPU<->GPU mode (papers/csattention.txt §3.4), for any method: the pipeline keeps the
context K/V and the method's index arrays in DRAM (`context_on_host`), the planner runs on the CPU
(the query is copied to the host for it), and this backend gathers the frame's and the plan's rows
on the host straight into pinned buffers, copies them to the GPU with `non_blocking` copies on the
current stream and attends there together with the request-local rows, which live on the GPU. A
dense plan ships every context row (correct, and as slow as it sounds). On a CPU-only worker
nothing moves and this is `torch_ref`.

What crosses PCIe per layer and step: (sink + window + K) x KVH x T rows of K and of V, plus the
[KVH, T, R] validity mask; host -> device only, apart from the query and its positions (device ->
host, for the planner). The pinned buffers come from torch's caching host allocator, which keeps a
block alive until the copies that read it have run.
"""

from __future__ import annotations

import torch

from decoder.backends import AttentionBackend, frame_rows, register_backend
from decoder.backends.torch_ref import TorchRef, attend_rows
from indexer.base import Plan


def _pinned_rows(src: torch.Tensor, rows: torch.Tensor, pin: bool) -> torch.Tensor:
    """src [KVH, N, D] host, rows [KVH, X] -> [KVH, X, D] gathered into a (pinned) host buffer."""
    kvh, n, d = src.shape
    flat = (rows + n * torch.arange(kvh)[:, None]).reshape(-1)
    out = torch.empty(flat.numel(), d, dtype=src.dtype, pin_memory=pin)
    torch.index_select(src.contiguous().view(kvh * n, d), 0, flat, out=out)
    return out.view(kvh, rows.shape[1], d)


@register_backend
class Offload(AttentionBackend):
    name = "offload"
    context_on_host = True

    def run(self, q, kv, plan, sink, window, scale):
        dev = q.device
        if kv.ctx_k.device == dev:  # nothing to ship
            return TorchRef().run(q, kv, plan, sink, window, scale)
        kvh, _, t, d = q.shape
        n = kv.n_ctx
        q_pos = kv.q_pos.cpu()
        positions = plan.positions
        if positions is None:  # dense: every context row
            positions = torch.arange(n, dtype=torch.int32).expand(kvh, t, n)
        rows, ok, nf = frame_rows(positions.cpu(), q_pos, n, kvh, sink, window)
        pin = dev.type == "cuda"
        flat = rows.reshape(kvh, -1)
        k_rows = _pinned_rows(kv.ctx_k, flat, pin).to(dev, non_blocking=True).view(kvh, t, -1, d)
        v_rows = _pinned_rows(kv.ctx_v, flat, pin).to(dev, non_blocking=True).view(kvh, t, -1, d)
        ok = (ok.contiguous().pin_memory() if pin else ok).to(dev, non_blocking=True)
        on_dev = Plan(
            None,
            bypass=None if plan.bypass is None else plan.bypass.to(dev, non_blocking=True),
            rest_logit=None if plan.rest_logit is None else plan.rest_logit.to(dev, non_blocking=True),
            rest_value=None if plan.rest_value is None else plan.rest_value.to(dev, non_blocking=True),
        )
        return attend_rows(q, k_rows, v_rows, ok, nf, kv, on_dev, scale)
