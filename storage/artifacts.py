"""Context artifacts on disk: one zarr v3 group per context, published atomically.

Layout (`<root>/<model-slug>/<prompt-hash>/`):

    manifest.json                      written last; its presence is what "published" means
    tokens                             [N] int32
    kv/k, kv/v                         [layers, kv_heads, N, head_dim], chunk [1, 1, 4096, d]
    indexes/<method>-<params_hash>/*   each method's arrays, leading dim = layer, chunk per layer

Verified reads and what they catch (a missing, swapped or damaged chunk raises `ArtifactCorrupt` on
every read; `verify` checks a whole context): `storage/integrity.py`, shared with the object store.

bfloat16 has no zarr dtype: it is stored as a uint16 view (its exact bit pattern) and the logical
dtype is kept in the array attributes and the manifest (`arrays.<name>.dtype`, `stored_dtype` is the
zarr one); reads give the logical dtype back. The K/V dtype (`kv_dtype`: float32, bfloat16 or
float16, the service's setting) is also a top-level manifest field, and part of the context's
prompt hash.

Publishing: everything is written under `<slug>/.tmp-<hash>-<uuid>/`, read back and checked
against the sha256 recorded at write time, then renamed into place (atomic on POSIX). A failed
write removes its temp folder at once; a crash leaves only a temp folder, which `gc_temp()`
removes; no reader ever sees half a context.

The manifest is also where a context's mutable metadata lives (`display_name`, `expires_at`):
`update_metadata` rewrites it atomically under a per-context file lock, so a catalog rebuilt from
storage gets the current values (storage is the source of truth; Redis is an index of it).
"""

from __future__ import annotations

import contextlib
import fcntl
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
from zarr.storage import LocalStore

from storage.integrity import (  # noqa: F401 - the errors are imported from here by their users
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    VerifiedStore,
    check_complete,
    check_metadata,
    chunk_crcs,
    record_read_back,
    sha256,
    verify_arrays,
)
from storage.keys import IndexId, PromptHash

FORMAT = "ctxcache-context/1"
KV_CHUNK_TOKENS = 4096
MANIFEST = "manifest.json"
MANIFEST_LOCK = ".manifest.lock"
METADATA_FIELDS = ("display_name", "expires_at")  # what `update_metadata` may change


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
        return IndexId(self.method, self.params_hash).to_string()


class ContextStore:
    """Filesystem root holding all contexts (local SSD; `storage.objstore.ObjectContextStore`: the
    same artifacts in object storage)."""

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
            "sha256": sha256(a),
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

    def _write_context(self, group: zarr.Group, tokens: list[int], k: torch.Tensor, v: torch.Tensor,
                       indexes: list[IndexArrays]) -> tuple[dict, dict]:
        """Write a whole context's arrays into `group`; return (arrays' metadata, indexes' entries)."""
        arrays: dict[str, dict] = {}
        n = len(tokens)
        arrays["tokens"] = self._write_array(group, "tokens", torch.tensor(tokens, dtype=torch.int32), (max(n, 1),))
        kv_chunks = (1, 1, min(KV_CHUNK_TOKENS, max(n, 1)), k.shape[-1])
        arrays["kv/k"] = self._write_array(group, "kv/k", k, kv_chunks)
        arrays["kv/v"] = self._write_array(group, "kv/v", v, kv_chunks)
        index_meta = {idx.index_id: self._write_index(group, idx, arrays) for idx in indexes}
        return arrays, index_meta

    @staticmethod
    def _new_manifest(key: PromptHash, spec, n: int, arrays: dict, index_meta: dict, meta: dict, t0: float) -> dict:
        manifest = {
            "format": FORMAT,
            "prompt_hash": key.hex,
            "model": spec.to_dict(),
            "n_tokens": n,
            "kv_dtype": arrays["kv/k"]["dtype"],  # part of the prompt hash (storage.keys.PromptHash)
            "created_at": time.time(),
            "arrays": arrays,
            "indexes": index_meta,
            "bytes": sum(a["nbytes"] for a in arrays.values()),
            **meta,
        }
        manifest.setdefault("timings", {})["write_s"] = round(time.perf_counter() - t0, 4)
        return manifest

    def _verify(self, path: Path, arrays_meta: dict) -> None:
        """Read back what was just written under `path`: every chunk present, the data equal to what
        was written; then record each chunk file's crc32c (what every later read is checked against)."""
        group = zarr.open_group(path, mode="r")
        for name, meta in arrays_meta.items():
            arr = group[name]
            check_complete(arr, name)
            record_read_back(name, arr, arr[...], meta, chunk_crcs(path / name), "files")

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
            arrays, index_meta = self._write_context(group, tokens, k, v, indexes)
            self._verify(tmp, arrays)
            manifest = self._new_manifest(key, spec, len(tokens), arrays, index_meta, meta, t0)
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
        with self._manifest_lock(ctx):
            return self._add_indexes_locked(slug, key, ctx, indexes)

    def _add_indexes_locked(self, slug: str, key: PromptHash, ctx: Path, indexes: list[IndexArrays]) -> dict:
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

    @contextlib.contextmanager
    def _manifest_lock(self, ctx: Path):
        """Serialise read-modify-write of one context's manifest across threads and processes (an
        index added while a PATCH rewrites the name must not lose either). flock: POSIX advisory
        lock, released when the file is closed, also by a process that dies holding it."""
        with open(ctx / MANIFEST_LOCK, "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def update_metadata(self, slug: str, key: PromptHash, **fields) -> dict:
        """Set mutable metadata (`display_name`, `expires_at`: None = never) in the stored manifest,
        atomically; return the new manifest. `ArtifactMissing` when the context is not published."""
        unknown = set(fields) - set(METADATA_FIELDS)
        if unknown:
            raise ValueError(f"not manifest metadata: {sorted(unknown)}")
        ctx = self.context_dir(slug, key)
        if not (ctx / MANIFEST).exists():
            raise ArtifactMissing(f"context {key.hex} is not published")
        with self._manifest_lock(ctx):
            manifest = self.read_manifest(slug, key)
            if all(manifest.get(k) == v for k, v in fields.items()):
                return manifest
            manifest.update(fields)
            _write_json_atomic(ctx / MANIFEST, manifest)
            return manifest

    def verify(self, slug: str, key: PromptHash) -> list[str]:
        """Check every chunk of a published context against its manifest; return the problems found
        (empty: intact). Reads every chunk file once; decodes only arrays of a manifest written before
        chunk checksums existed (checked against the whole-array sha256 instead). `ArtifactMissing`
        when there is no manifest, `ArtifactCorrupt` when the manifest itself is unreadable."""
        ctx = self.context_dir(slug, key)
        manifest = self.read_manifest(slug, key)
        group: list[zarr.Group] = []  # opened on the first array: a missing folder is a problem, not an error

        def open_array(name: str, meta: dict) -> zarr.Array:
            if not group:
                group.append(zarr.open_group(ctx, mode="r", zarr_format=3))
            return group[0][name]

        return verify_arrays(manifest["arrays"], open_array, lambda name, rel: (ctx / name / rel).read_bytes(), "on disk")

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

    def stored_contexts(self):
        """(slug, id) of every folder that looks like a context, published or not (fsck counts a
        folder without a readable manifest as damaged; temp folders are not contexts)."""
        if not self.root.exists():
            return
        for slug_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for ctx in sorted(slug_dir.iterdir()):
                if ctx.is_dir() and not ctx.name.startswith("."):
                    try:
                        yield slug_dir.name, PromptHash(ctx.name)
                    except ValueError:
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


def _manifest_stamp(ctx: Path) -> tuple[int, int] | None:
    """(inode, mtime ns) of a context's manifest: every rewrite is a rename, so a new inode."""
    try:
        st = (ctx / MANIFEST).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave half a manifest next to the real one
        raise


class ContextArtifacts:
    """Read side of one published context. Arrays are read lazily, one layer at a time; every chunk
    read from disk is checked against the manifest (`VerifiedStore`)."""

    where = "on disk"  # where a missing array is missing (messages)

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self._group: zarr.Group | None = None
        self._checked: set[str] = set()
        self._lock = threading.Lock()
        self._stamp = _manifest_stamp(path)

    def is_current(self) -> bool:
        """Whether this handle still describes what is on disk: False once the context was deleted,
        rebuilt into different chunks or got an index (a cached handle must then be opened again).
        A manifest rewritten only for its name or expiry keeps the handle (and its cached arrays)."""
        stamp = _manifest_stamp(self.path)
        if stamp is None or self._stamp is None:
            return False
        if stamp == self._stamp:
            return True
        try:
            manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError):
            return False
        if manifest.get("arrays") != self.manifest["arrays"] or manifest.get("indexes") != self.manifest["indexes"]:
            return False
        self.manifest, self._stamp = manifest, stamp
        return True

    @property
    def n_tokens(self) -> int:
        return int(self.manifest["n_tokens"])

    @property
    def kv_dtype(self) -> str:
        """The dtype the K/V are stored in (and read back as)."""
        return self.manifest["arrays"]["kv/k"]["dtype"]

    def _group_of(self, meta: dict) -> zarr.Group:
        """The zarr group holding an array (`meta`: its manifest entry), opened once. Under the lock."""
        if self._group is None:
            store = VerifiedStore(LocalStore(self.path, read_only=True), self.manifest["arrays"])
            self._group = zarr.open_group(store=store, mode="r", zarr_format=3)
        return self._group

    def _array(self, name: str) -> zarr.Array:
        meta = self.manifest["arrays"].get(name)
        if meta is None:
            raise ArtifactMissing(f"{self.path.name}: no array {name!r} in the manifest")
        with self._lock:
            try:
                arr = self._group_of(meta)[name]
            except (KeyError, FileNotFoundError) as e:
                raise ArtifactCorrupt(f"{name}: listed in the manifest but missing {self.where}") from e
            if name not in self._checked:
                check_metadata(arr, name, meta)
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
