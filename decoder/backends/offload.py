"""`offload`: the context's K/V stay in host memory; the GPU's kernels read the rows a step attends
in place, over PCIe.

CSAttention's CPU<->GPU mode (papers/csattention.txt §3.4), for any method, without a host in the
loop: the pipeline keeps the context's K/V in *pinned* host memory (`host_arrays`) and hands
the decode step CUDA views of them (`mapped`: under unified addressing, pinned host memory is part
of the device's address space), while the method's index arrays and the request-local rows live
on the GPU as with any other backend. The planner runs on the GPU, and the attention kernels
(`triton`, or `torch_ref` where Triton is missing) read the sink, the window and the plan's rows
straight from host memory. No host gather, no copy stream, no host sync: a step is the same graph
as with a GPU-resident context, and it is captured and replayed by the decode runner.

`offload_v` keeps only the values in host memory (the keys on the GPU).

What crosses PCIe per layer and step: the K and V rows attended ((sink + window + K) x KVH per
query token), plus whatever context keys the planner reads (none for csattn, saap and lfps's
tables; the candidates' keys for ctkvr/kivf's rerank; psa's scored blocks; every key for topk). The
batched runner keeps the value rows each layer's last two plans read in a row cache in HBM
(`KVView.v_cache`, `decoder.kernels.stage.RowCache`): the triton kernel reads those from there, so
only the other rows cross PCIe (benchmarks/RESULTS.md, "The attention reads the row cache").
Measured on an H100 (benchmarks/gpu_host_reads.py, RESULTS.md "Offload"): kernels reading mapped
host memory reach ~90% of a bulk pinned copy's bandwidth, scattered rows included. A dense plan
reads every context row over PCIe (correct, and as slow as it sounds). On a CPU-only worker
nothing is mapped and this is `torch_ref`.
"""

from __future__ import annotations

import torch

from decoder.backends import AttentionBackend, register_backend
from decoder.backends.torch_ref import TorchRef
from indexer.base import KVView, Plan

_INT_VIEW = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}


class _HostArray:
    """`__cuda_array_interface__` of a pinned host tensor, viewed as integers of its element size
    (the interface has no bfloat16). Holds the tensor: the CUDA view keeps this object alive."""

    def __init__(self, host: torch.Tensor):
        as_int, typestr = _INT_VIEW[host.element_size()]
        self.host = host.view(as_int)
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(s * host.element_size() for s in host.stride()),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def mapped(host: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """A CUDA tensor on `device` (default: the current one) over the bytes of a pinned host tensor
    (no copy): every kernel that reads it reads host memory over PCIe. Pinned memory is mapped into
    the device's address space under unified addressing (every 64-bit CUDA platform), so its host
    pointer is a device pointer too."""
    if not host.is_pinned():
        raise ValueError("only pinned host memory is mapped into the device's address space")
    dev = torch.device(device if device is not None else "cuda")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    view = torch.as_tensor(_HostArray(host), device=dev).view(host.dtype)
    if view.data_ptr() != host.data_ptr():  # torch copied instead of aliasing: refuse, never serve a copy
        raise RuntimeError("torch copied the host tensor instead of mapping it")
    return view


@register_backend
class Offload(AttentionBackend):
    """`offload`: the context's K and V in pinned host memory (the module docstring); on a GPU it
    runs what `triton` (or `torch_ref`, without Triton) runs, over the mapped views."""

    name = "offload"
    host_arrays = frozenset({"kv/k", "kv/v"})

    def __init__(self, cfg=None):
        self.cfg = cfg  # the triton kernel's KernelConfig (None: its defaults)
        self._gpu: AttentionBackend | None = None  # the backend that runs on a GPU (decided on first use)

    def _on_gpu(self, q: torch.Tensor) -> AttentionBackend:
        if self._gpu is None:
            self._gpu = TorchRef()
            try:
                from decoder.backends.triton import TritonAttention
                from decoder.kernels.attention import unsupported
            except ImportError:  # no triton: torch's kernels read the mapped rows too
                return self._gpu
            if not unsupported(q.shape[-1], q.dtype):
                self._gpu = TritonAttention(self.cfg)
        return self._gpu

    def run(self, q: torch.Tensor, kv: KVView, plan: Plan, sink: int, window: int, scale: float) -> torch.Tensor:
        if q.device.type != "cuda":  # a CPU worker: nothing to map, nothing to ship
            return TorchRef().run(q, kv, plan, sink, window, scale)
        if kv.ctx_k.device != q.device:
            raise ValueError("offload on a GPU reads the context through mapped views (decoder.backends.offload.mapped)")
        return self._on_gpu(q).run(q, kv, plan, sink, window, scale)


@register_backend
class OffloadValues(Offload):
    """`offload_v`: only the context's values stay in host memory; the keys live on the GPU. Half
    the context's bytes leave the GPU, and what a step reads over PCIe is the attended rows' values:
    half of `offload`'s traffic, and none for planners that read keys (ctkvr/kivf's rerank, psa's
    block scores, topk), which then run at HBM speed."""

    name = "offload_v"
    host_arrays = frozenset({"kv/v"})
