"""Programmatic dependent launch (PDL, Hopper and later), in one place for every Triton kernel of the
project: a kernel launched with it may be scheduled while the one before it on the stream drains,
and waits (`griddepcontrol.wait`, its first instruction on memory) until that one's writes are
visible. Saves most of the gap between two short kernels, also inside a CUDA graph (measured:
benchmarks/RESULTS.md, "psa's select in registers, programmatic dependent launch, ...").

A kernel takes a `PDL: tl.constexpr` and starts with `pdl_begin(PDL)`; its launch passes
`PDL=bool(opts), **opts` with `opts = pdl_launch(device, enabled)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from indexer.kernels import interpreted


def pdl_launch(device: torch.device, enabled: bool = True) -> dict:
    """Launch options: {"launch_pdl": True} on a Hopper-or-later GPU; empty (a plain launch) on the
    interpreter, on older GPUs, or when `enabled` is False (A/B runs)."""
    if not enabled or device.type != "cuda" or interpreted():
        return {}
    return {"launch_pdl": True} if torch.cuda.get_device_capability(device)[0] >= 9 else {}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A kernel's prologue under PDL: wait for the previous kernel's writes, then let the next kernel
    be scheduled. Nothing without PDL (the interpreter has no griddepcontrol)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
