"""Context artifacts on disk: one zarr v3 group per context, published atomically.

Layout (`<root>/<model-slug>/<prompt-hash>/`):

    manifest.json                      written last; its presence is what "published" means
    tokens                             [N] int32
    kv/k, kv/v                         [layers, kv_heads, N, head_dim], chunk [1, 1, 4096, d]
    indexes/<method>-<params_hash>/*   each method's arrays, leading dim = layer, chunk per layer

Verified reads: every chunk file ends with the crc32c of its data (zarr's `crc32c` codec, checked
when the chunk is decoded), and the manifest records each chunk's crc32c too
(`arrays.<name>.chunk_crc32c`, read from the files at publish, after the read-back). Every read goes
through `_VerifiedStore`, which compares the crc a chunk file carries with the manifest's as the
file comes off the disk; the codec then checks the data against that crc. So a chunk swapped for
another valid chunk (whose own crc is valid), a flipped bit, or a *missing* chunk (which zarr would
silently read back as the fill value) raises `ArtifactCorrupt` on that read, every time the chunk is
read (a DRAM tier that evicts reads it again), not once per opened handle.

Why crc32c and not a sha256 per chunk: the crc is already computed by the decode, so the check
costs a 4-byte compare, where hashing every chunk again doubled the cost of a read from the page
cache. The threat is damage and mix-ups (bit rot, a bad copy, a chunk of another layer or context),
which a 32-bit check catches but for a 2^-32 chance per damaged chunk; deliberate forgery is not in
scope for any per-chunk digest, since whoever can rewrite chunk files can rewrite the manifest next
to them. Each array's sha256 over its data (`arrays.<name>.sha256`) stays in the manifest: the
publish read-back checks it, and `verify` uses it for contexts published before chunk checksums
existed (their reads still fail on a missing chunk).

bfloat16 has no zarr dtype: it is stored as a uint16 view (its exact bit pattern) and the logical
dtype is kept in the array attributes and the manifest (`arrays.<name>.dtype`, `stored_dtype` is the
zarr one); reads give the logical dtype back. The K/V dtype (`kv_dtype`: float32, bfloat16 or
float16, the service's setting) is also a top-level manifest field, and part of the context's
prompt hash. The chunk checks below see only bytes, so they cover the uint16 view the same way.

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
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec
from zarr.storage import LocalStore, WrapperStore

from storage.keys import PromptHash

FORMAT = "ctxcache-context/1"
KV_CHUNK_TOKENS = 4096
MANIFEST = "manifest.json"
MANIFEST_LOCK = ".manifest.lock"
METADATA_FIELDS = ("display_name", "expires_at")  # what `update_metadata` may change


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
            _check_complete(arr, name)
            if _sha256(arr[...]) != meta["sha256"]:
                raise ArtifactCorrupt(f"{name}: read-back checksum differs from what was written")
            crcs = _chunk_crcs(path / name)
            if len(crcs) != arr.nchunks:
                raise ArtifactCorrupt(f"{name}: {len(crcs)} chunk files for {arr.nchunks} chunks")
            meta["chunk_crc32c"] = crcs

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
        problems: list[str] = []
        group = None
        for name, meta in sorted(manifest["arrays"].items()):
            try:
                if group is None:
                    group = zarr.open_group(ctx, mode="r", zarr_format=3)
                arr = group[name]
                _check_metadata(arr, name, meta)
                if "chunk_crc32c" in meta:
                    problems += _verify_chunk_files(ctx / name, name, meta["chunk_crc32c"])
                    continue
                _check_complete(arr, name)
                if _sha256(arr[...]) != meta["sha256"]:
                    problems.append(f"{name}: data differs from the sha256 in the manifest")
            except (KeyError, FileNotFoundError):
                problems.append(f"{name}: listed in the manifest but missing on disk")
            except (ArtifactCorrupt, ValueError) as e:
                problems.append(f"{name}: {e}" if not str(e).startswith(name) else str(e))
        return problems

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


def _trailer_crc(chunk: bytes | np.ndarray) -> str:
    """The crc32c a chunk file carries (its last 4 bytes, as zarr's `crc32c` codec wrote them), hex."""
    return bytes(chunk[-4:]).hex()


def _data_crc(chunk: bytes) -> str:
    """The crc32c of a chunk file's data, in the byte order the codec writes it, hex."""
    return np.uint32(google_crc32c.value(chunk[:-4])).tobytes().hex()


def _chunk_crcs(array_dir: Path) -> dict[str, str]:
    """The crc32c of every chunk file of one array, keyed by its path relative to the array
    ("c/0/1/0/0"); each file's data must match the crc it carries."""
    out = {}
    for f in sorted((array_dir / "c").rglob("*")):
        if f.is_file():
            chunk, rel = f.read_bytes(), f.relative_to(array_dir).as_posix()
            if _data_crc(chunk) != _trailer_crc(chunk):
                raise ArtifactCorrupt(f"{array_dir.name}/{rel}: chunk data does not match its crc32c")
            out[rel] = _trailer_crc(chunk)
    return out


def _verify_chunk_files(array_dir: Path, name: str, crcs: dict[str, str]) -> list[str]:
    """Problems with one array's chunk files: missing, carrying another crc than the manifest's (a
    chunk from elsewhere), or data that does not match its crc (damaged)."""
    problems = []
    for rel, want in sorted(crcs.items()):
        try:
            chunk = (array_dir / rel).read_bytes()
        except FileNotFoundError:
            problems.append(f"{name}/{rel}: chunk missing on disk")
            continue
        if _trailer_crc(chunk) != want:
            problems.append(f"{name}/{rel}: chunk checksum differs from the manifest")
        elif _data_crc(chunk) != want:
            problems.append(f"{name}/{rel}: chunk data does not match its crc32c")
    return problems


def _check_metadata(arr: zarr.Array, name: str, meta: dict) -> None:
    """The array's zarr metadata must describe what the manifest recorded (a swapped zarr.json
    could otherwise reshape or retype valid chunks)."""
    if list(arr.shape) != meta["shape"] or list(arr.chunks) != meta["chunks"] or str(arr.dtype) != meta["stored_dtype"]:
        raise ArtifactCorrupt(f"{name}: zarr metadata (shape {list(arr.shape)}, chunks {list(arr.chunks)}, "
                              f"dtype {arr.dtype}) differs from the manifest")


def _check_complete(arr: zarr.Array, name: str) -> None:
    have, want = arr.nchunks_initialized, arr.nchunks
    if have != want:
        raise ArtifactCorrupt(f"{name}: {want - have} of {want} chunks missing on disk")


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


class _VerifiedStore(WrapperStore):
    """A read-only zarr store over one context's folder that checks each chunk as it is read: the
    file must exist (zarr would return the fill value for a missing one) and, where the manifest
    has its crc32c, carry that crc (the codec checks the data against it when decoding). Metadata
    documents (`zarr.json`) pass through; `_check_metadata` compares them with the manifest."""

    def __init__(self, store: LocalStore, arrays: dict[str, dict]):
        super().__init__(store)
        self._arrays = arrays
        self._crcs = {f"{name}/{rel}": crc for name, meta in arrays.items()
                      for rel, crc in (meta.get("chunk_crc32c") or {}).items()}
        self._prefixes = tuple(f"{name}/c/" for name in arrays)

    def _with_store(self, store: LocalStore) -> "_VerifiedStore":
        return type(self)(store, self._arrays)

    async def get(self, key, prototype, byte_range=None):
        if not key.startswith(self._prefixes):
            return await self._store.get(key, prototype, byte_range)
        buf = await self._store.get(key, prototype, None)
        if buf is None:
            raise ArtifactCorrupt(f"{key}: chunk missing on disk")
        want = self._crcs.get(key)
        if want is not None and _trailer_crc(buf.as_numpy_array()) != want:
            raise ArtifactCorrupt(f"{key}: chunk checksum differs from the manifest")
        if byte_range is not None:  # not used by these arrays (no sharding); served after the check
            return await self._store.get(key, prototype, byte_range)
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]


class ContextArtifacts:
    """Read side of one published context. Arrays are read lazily, one layer at a time; every chunk
    read from disk is checked against the manifest (`_VerifiedStore`)."""

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

    def _array(self, name: str) -> zarr.Array:
        if name not in self.manifest["arrays"]:
            raise ArtifactMissing(f"{self.path.name}: no array {name!r} in the manifest")
        with self._lock:
            try:
                if self._group is None:
                    store = _VerifiedStore(LocalStore(self.path, read_only=True), self.manifest["arrays"])
                    self._group = zarr.open_group(store=store, mode="r", zarr_format=3)
                arr = self._group[name]
            except (KeyError, FileNotFoundError) as e:
                raise ArtifactCorrupt(f"{name}: listed in the manifest but missing on disk") from e
            if name not in self._checked:
                _check_metadata(arr, name, self.manifest["arrays"][name])
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
