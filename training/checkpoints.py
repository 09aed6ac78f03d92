"""The files that make a training run resumable: safetensors written under a temporary name and
renamed (a crash leaves the old file or none, never a torn one), and their metadata read back.

Both the corpus capture cache (`training/capture.py`, one file per window) and the per-layer
checkpoints (`training/loop.py`, `layer_XX.safetensors`) record in their metadata what they were
made from; a rerun reuses a file only when that record matches.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def read_metadata(path: Path) -> dict[str, str] | None:
    """A safetensors file's metadata ({} when it has none); None for a torn or foreign file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001 - a torn or foreign file is simply not a valid checkpoint
        return None
