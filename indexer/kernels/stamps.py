"""Timestamps taken inside kernels, for the timeline of one decode step (`benchmarks/gpu_timeline.py`).

Where a step's time goes between and inside its kernels is what a profiler's per-kernel durations
do not show: when each kernel's first program starts after the previous kernel's last one ends (the
graph's gap), how long each program runs against the kernel's span, and which phase of a program's
work takes its time. A kernel that takes `TS` and `STAMP: tl.constexpr` calls
`stamp(TS, program, slot, STAMP)` at the points it wants timed: with STAMP it waits for all of the
program's warps (a barrier) and stores %globaltimer (ns, the whole GPU's clock), %clock64 (the SM's
cycles) and %smid into slot `slot` of program `program`; without it (every launch outside a timeline,
and the interpreter, which has no inline assembly) it compiles to nothing.

Host side: `recording(device)` makes a `Stamps` the active recorder; each instrumented launch asks
`stamp_args(kernel_name)` for its two arguments, (a zeroed int64 buffer, True) while a recorder is
active and (None, False) otherwise. The buffers are allocated once per kernel name before a graph is
captured (`Stamps.reserve`), so a captured step's replays write into the same memory.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from indexer.kernels import interpreted

SLOTS = 8  # stamps per program
WORDS = 4  # per stamp: globaltimer ns, clock64, smid, spare


@triton.jit
def stamp(TS, program, slot, ON: tl.constexpr):
    """TS[program, slot] = (globaltimer, clock64, smid) once every warp of the program got here."""
    if ON:
        tl.debug_barrier()
        gt = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
        at = TS + (program.to(tl.int64) * 8 + slot) * 4  # SLOTS, WORDS
        tl.store(at, gt)
        tl.store(at + 1, clk)
        tl.store(at + 2, sm.to(tl.int64))


class Stamps:
    """The buffers of one timeline: per kernel name an int64 [programs, SLOTS, WORDS] tensor."""

    def __init__(self, device: torch.device | str, programs: int = 8192):
        self.device = torch.device(device)
        self.programs = programs
        self.buffers: dict[str, torch.Tensor] = {}

    def reserve(self, name: str) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = torch.zeros(self.programs, SLOTS, WORDS, dtype=torch.int64, device=self.device)
            self.buffers[name] = buf
        return buf

    def clear(self) -> None:
        for buf in self.buffers.values():
            buf.zero_()

    def read(self) -> dict[str, torch.Tensor]:
        """Copies on the host of the programs that stamped (rows with any stamp), per kernel."""
        out = {}
        for name, buf in self.buffers.items():
            b = buf.cpu()
            used = (b[:, :, 0] != 0).any(dim=1)
            out[name] = b[: int(used.nonzero().max()) + 1] if used.any() else b[:0]
        return out


_active: Stamps | None = None


@contextlib.contextmanager
def recording(device: torch.device | str, programs: int = 8192):
    """Make a fresh `Stamps` the active recorder for the block (kernels launched in it stamp). CUDA
    only: the stamps are PTX special registers, which neither a CPU nor Triton's interpreter has."""
    global _active
    if torch.device(device).type != "cuda" or interpreted():
        raise ValueError("kernel timestamps need a CUDA device (not the CPU or Triton's interpreter)")
    prev, _active = _active, Stamps(device, programs)
    try:
        yield _active
    finally:
        _active = prev


def stamp_args(name: str) -> dict:
    """The `TS` / `STAMP` launch arguments of kernel `name`: its buffer while a recorder is active."""
    if _active is None:
        return {"TS": None, "STAMP": False}
    return {"TS": _active.reserve(name), "STAMP": True}
