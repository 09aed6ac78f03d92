"""Triton kernels the planners run on a GPU (fused searches: `indexer/selection.py` dispatches to
them on CUDA tensors and keeps plain torch for the CPU), plus what every Triton kernel of the
project needs: `interpreted()` (kernels run through Triton's CPU interpreter, the CI mode set by
tests/conftest.py) and, in that mode, a fix of the interpreter for NumPy >= 2.4. The attention
kernels (`decoder/kernels/`) import it from here.

Importing this package imports nothing from Triton; its kernel modules do (and fail to import
where Triton is missing, which the dispatchers treat as "use torch").
"""

from __future__ import annotations

import os

import torch


def interpreted() -> bool:
    """True when Triton runs kernels through its CPU interpreter (tests on a machine without CUDA)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpreter_numpy2_compat() -> None:
    """Triton 3.6's interpreter turns a loop bound given as a runtime int (a shape-(1,) array
    there) into a Python int with `int(array)`, which NumPy >= 2.4 refuses for 1-d arrays
    (TypeError 'only 0-dimensional arrays can be converted to Python scalars'). Patched here,
    in interpreter mode only (CPU tests); compiled kernels are unaffected."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no Triton: nothing to patch (its kernels are not offered)
        return

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_numpy2_compat", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
                       if self.handle.data.size == 1 else int(self.handle.data))

    patched._numpy2_compat = True
    interpreter._patch_lang_tensor = patched


if interpreted():
    _interpreter_numpy2_compat()


class Workspaces:
    """Grow-only scratch buffers for kernel launches, one per (device, stream, tag, dtype): reused by
    every call on that stream (calls on one stream are ordered), grown by doubling. A buffer that is
    outgrown is kept alive, never freed while the process lives: a CUDA graph captured earlier may
    still read it (a replay would otherwise read memory the allocator has handed out again)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, tag: str, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        """A [numel] view; `zero`: a new buffer starts zeroed (kernels that clean up after themselves)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream, tag, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None:
                self._retired.append(buf)
            size = max(numel, 2 * (0 if buf is None else buf.numel()))
            buf = (torch.zeros if zero else torch.empty)(size, dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:numel]

    def buffers(self) -> list[torch.Tensor]:
        """The live buffers (tests poison them to prove a kernel writes before it reads)."""
        return list(self._bufs.values())

    def clear(self) -> None:
        """Forget every buffer (tests; graphs captured before must not be replayed afterwards)."""
        self._bufs.clear()
        self._retired.clear()
