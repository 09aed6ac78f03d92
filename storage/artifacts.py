"""Context artifacts on disk: one zarr v3 group per context, published atomically.

Layout (`<root>/<model-slug>/<prompt-hash>/`):

    manifest.json                      written last; its presence is what "published" means
    tokens                             [N] int32
    kv/k, kv/v                         [layers, kv_heads, N, head_dim], chunk [1, 1, 4096, d]
    indexes/<method>-<params_hash>/*   each method's arrays, leading dim = layer, chunk per layer

Every chunk carries a crc32c (zarr's `crc32c` codec), so a corrupt chunk fails to decode. A
*missing* chunk would silently read back as the fill value, so every array is checked for
complete chunks before its first read. bfloat16 has no zarr dtype: it is stored as a uint16 view
and the logical dtype is kept in the array attributes and the manifest.

Publishing: everything is written under `<slug>/.tmp-<hash>-<uuid>/`, read back and checked
against the sha256 recorded at write time, then renamed into place (atomic on POSIX). A crash
leaves only a temp folder, which `gc_temp()` removes; no reader ever sees half a context.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec

from storage.keys import PromptHash

FORMAT = "ctxcache-context/1"
KV_CHUNK_TOKENS = 4096
MANIFEST = "manifest.json"


class ArtifactError(Exception):
    """Base class: something about stored artifacts is wrong."""


class ArtifactMissing(ArtifactError):
    pass


class ArtifactCorrupt(ArtifactError):
    pass


# ---------------------------------------------------------------------------------------------
# dtype handling: torch <-> stored numpy


def _to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Return (array to store, logical dtype name). bf16 becomes its exact uint16 bit pattern."""
    t = t.detach().cpu().contiguous()
    logical = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), logical
    return t.numpy(), logical


def _to_torch(a: np.ndarray, logical: str) -> torch.Tensor:
    if logical == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@dataclass
class IndexArrays:
    """One method's persisted index, as the prefill worker built it."""

    method: str
    version: int
    params: dict  # build params (the ones that change the arrays)
    params_hash: str
    arrays: dict[str, torch.Tensor]  # name -> tensor with leading layer dim
    build_s: float = 0.0

    @property
    def index_id(self) -> str:
        return f"{self.method}-{self.params_hash}"


class ContextStore:
    """Filesystem root holding all contexts (local SSD; an fsspec store would slot in here)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def context_dir(self, slug: str, key: PromptHash) -> Path:
        return self.root / slug / key.hex

    def exists(self, slug: str, key: PromptHash) -> bool:
        return (self.context_dir(slug, key) / MANIFEST).exists()

    # -- writing --------------------------------------------------------------------------------

    def _write_array(self, group: zarr.Group, name: str, t: torch.Tensor, chunks: tuple[int, ...]) -> dict:
        a, logical = _to_numpy(t)
        arr = group.create_array(
            name,
            shape=a.shape,
            chunks=chunks,
            dtype=a.dtype,
            compressors=[Crc32cCodec()],
            fill_value=0,
            config={"write_empty_chunks": True},  # an all-zero chunk must exist on disk too
            attributes={"ctxcache_dtype": logical},
        )
        arr[...] = a
        return {
            "shape": list(a.shape),
            "dtype": logical,
            "stored_dtype": str(a.dtype),
            "chunks": list(chunks),
            "nbytes": int(a.nbytes),
            "sha256": _sha256(a),
        }

    def _write_index(self, group: zarr.Group, idx: IndexArrays, arrays_meta: dict) -> dict:
        for name, t in idx.arrays.items():
            path = f"indexes/{idx.index_id}/{name}"
            chunks = (1, *t.shape[1:]) if t.ndim > 1 else tuple(t.shape)
            arrays_meta[path] = self._write_array(group, path, t, chunks)
        return {
            "method": idx.method,
            "version": idx.version,
            "params": idx.params,
            "params_hash": idx.params_hash,
            "arrays": sorted(idx.arrays),
            "build_s": round(idx.build_s, 4),
        }

    def _verify(self, path: Path, arrays_meta: dict) -> None:
        group = zarr.open_group(path, mode="r")
        for name, meta in arrays_meta.items():
            arr = group[name]
            _check_complete(arr, name)
            if _sha256(arr[...]) != meta["sha256"]:
                raise ArtifactCorrupt(f"{name}: read-back checksum differs from what was written")

    def publish(
        self,
        key: PromptHash,
        spec,
        tokens: list[int],
        k: torch.Tensor,  # [L, KVH, N, D]
        v: torch.Tensor,
        indexes: list[IndexArrays],
        meta: dict,
    ) -> dict:
        """Write a whole context under a temp name, verify it, rename it into place; return the manifest."""
        final = self.context_dir(spec.slug, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{key.hex}-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        try:
            group = zarr.open_group(tmp, mode="w")
            arrays: dict[str, dict] = {}
            n = len(tokens)
            arrays["tokens"] = self._write_array(group, "tokens", torch.tensor(tokens, dtype=torch.int32), (max(n, 1),))
            kv_chunks = (1, 1, min(KV_CHUNK_TOKENS, max(n, 1)), k.shape[-1])
            arrays["kv/k"] = self._write_array(group, "kv/k", k, kv_chunks)
            arrays["kv/v"] = self._write_array(group, "kv/v", v, kv_chunks)
            index_meta = {idx.index_id: self._write_index(group, idx, arrays) for idx in indexes}
            self._verify(tmp, arrays)
            manifest = {
                "format": FORMAT,
                "prompt_hash": key.hex,
                "model": spec.to_dict(),
                "n_tokens": n,
                "created_at": time.time(),
                "arrays": arrays,
                "indexes": index_meta,
                "bytes": sum(a["nbytes"] for a in arrays.values()),
                **meta,
            }
            manifest.setdefault("timings", {})["write_s"] = round(time.perf_counter() - t0, 4)
            _write_json_atomic(tmp / MANIFEST, manifest)
            with self._lock:
                if final.exists():  # a finished earlier build of the same content: keep it
                    shutil.rmtree(tmp, ignore_errors=True)
                    return self.read_manifest(spec.slug, key)
                os.rename(tmp, final)
            return manifest
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def add_indexes(self, slug: str, key: PromptHash, indexes: list[IndexArrays]) -> dict:
        """Add method indexes to a published context (each under a temp name, then renamed;
        the manifest is replaced atomically last)."""
        ctx = self.context_dir(slug, key)
        manifest = self.read_manifest(slug, key)
        for idx in indexes:
            if idx.index_id in manifest["indexes"]:
                continue
            tmp_root = ctx / f".tmp-index-{uuid.uuid4().hex[:8]}"
            try:
                group = zarr.open_group(tmp_root, mode="w")
                arrays: dict[str, dict] = {}
                entry = self._write_index(group, idx, arrays)
                self._verify(tmp_root, arrays)
                dest = ctx / "indexes" / idx.index_id
                dest.parent.mkdir(exist_ok=True)
                shutil.rmtree(dest, ignore_errors=True)  # leftover of a crash before the manifest
                os.rename(tmp_root / "indexes" / idx.index_id, dest)
            finally:
                shutil.rmtree(tmp_root, ignore_errors=True)
            manifest["indexes"][idx.index_id] = entry
            manifest["arrays"].update(arrays)
        manifest["bytes"] = sum(a["nbytes"] for a in manifest["arrays"].values())
        _write_json_atomic(ctx / MANIFEST, manifest)
        return manifest

    # -- reading --------------------------------------------------------------------------------

    def read_manifest(self, slug: str, key: PromptHash) -> dict:
        path = self.context_dir(slug, key) / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ArtifactMissing(f"context {key.hex} has no artifacts under {path.parent}") from e
        except ValueError as e:
            raise ArtifactCorrupt(f"{path}: manifest is not valid JSON") from e
        if manifest.get("format") != FORMAT or manifest.get("prompt_hash") != key.hex:
            raise ArtifactCorrupt(f"{path}: manifest does not describe context {key.hex}")
        return manifest

    def open(self, slug: str, key: PromptHash) -> "ContextArtifacts":
        return ContextArtifacts(self.context_dir(slug, key), self.read_manifest(slug, key))

    def delete(self, slug: str, key: PromptHash) -> bool:
        path = self.context_dir(slug, key)
        if not path.exists():
            return False
        # rename first so a concurrent reader sees it gone at once, then remove
        trash = path.parent / f".tmp-deleted-{key.hex}-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def iter_manifests(self):
        """Every published context (used to rebuild the catalog if Redis lost it)."""
        for slug_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for ctx in sorted(slug_dir.iterdir()):
                if ctx.name.startswith(".") or not (ctx / MANIFEST).exists():
                    continue
                try:
                    yield slug_dir.name, self.read_manifest(slug_dir.name, PromptHash(ctx.name))
                except (ArtifactError, ValueError):
                    continue

    def gc_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp folders left by crashed writers."""
        removed, now = 0, time.time()
        for tmp in list(self.root.glob("*/.tmp-*")) + list(self.root.glob("*/*/.tmp-index-*")):
            try:
                if now - tmp.stat().st_mtime >= older_than_s:
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed += 1
            except FileNotFoundError:
                pass
        return removed


def _check_complete(arr: zarr.Array, name: str) -> None:
    have, want = arr.nchunks_initialized, arr.nchunks
    if have != want:
        raise ArtifactCorrupt(f"{name}: {want - have} of {want} chunks missing on disk")


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ContextArtifacts:
    """Read side of one published context. Arrays are read lazily, one layer at a time."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self._group: zarr.Group | None = None
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    def _array(self, name: str) -> zarr.Array:
        if name not in self.manifest["arrays"]:
            raise ArtifactMissing(f"{self.path.name}: no array {name!r} in the manifest")
        with self._lock:
            if self._group is None:
                self._group = zarr.open_group(self.path, mode="r")
            try:
                arr = self._group[name]
            except KeyError as e:
                raise ArtifactCorrupt(f"{name}: listed in the manifest but missing on disk") from e
            if name not in self._checked:
                _check_complete(arr, name)
                self._checked.add(name)
        return arr

    def read(self, name: str, layer: int | None = None) -> torch.Tensor:
        arr = self._array(name)
        meta = self.manifest["arrays"][name]
        try:
            data = arr[layer] if layer is not None else arr[...]
        except ValueError as e:  # crc32c mismatch and other decode failures
            raise ArtifactCorrupt(f"{name}: {e}") from e
        except FileNotFoundError as e:
            raise ArtifactCorrupt(f"{name}: chunk vanished during read") from e
        return _to_torch(np.asarray(data), meta["dtype"])

    def index_arrays(self, index_id: str) -> list[str]:
        return list(self.manifest["indexes"][index_id]["arrays"])
