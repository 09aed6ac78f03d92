"""Integrity of stored context arrays: the checks the local store (`storage/artifacts.py`) and the
object store (`storage/objstore.py`) share, written once.

Every chunk file (or object) ends with the crc32c of its data (zarr's `crc32c` codec, checked when
the chunk is decoded), and the manifest records each chunk's crc32c too (`arrays.<name>.chunk_crc32c`,
taken at publish, during the read-back). Every read goes through `VerifiedStore`, which compares the
crc a chunk carries with the manifest's as the chunk comes off the disk or the network; the codec
then checks the data against that crc. So a chunk swapped for another valid chunk (whose own crc is
valid), a flipped bit, or a *missing* chunk (which zarr would silently read back as the fill value)
raises `ArtifactCorrupt` on that read, every time the chunk is read (a DRAM tier that evicts reads it
again), not once per opened handle.

Why crc32c and not a sha256 per chunk: the crc is already computed by the decode, so the check
costs a 4-byte compare, where hashing every chunk again doubled the cost of a read from the page
cache. The threat is damage and mix-ups (bit rot, a bad copy, a chunk of another layer or context),
which a 32-bit check catches but for a 2^-32 chance per damaged chunk; deliberate forgery is not in
scope for any per-chunk digest, since whoever can rewrite chunk files can rewrite the manifest next
to them. Each array's sha256 over its data (`arrays.<name>.sha256`) stays in the manifest: the
publish read-back checks it (`record_read_back`), and `verify_arrays` uses it for contexts published
before chunk checksums existed (their reads still fail on a missing chunk).

The checks see only bytes, so they cover bfloat16's uint16 view the same way as any other dtype.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import google_crc32c
import numpy as np
import zarr
from zarr.storage import WrapperStore


class ArtifactError(Exception):
    """Base class: something about stored artifacts is wrong."""


class ArtifactMissing(ArtifactError):
    pass


class ArtifactCorrupt(ArtifactError):
    pass


def sha256(a: np.ndarray) -> str:
    """The sha256 of an array's data (C order), hex: the manifest's `arrays.<name>.sha256`."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def trailer_crc(chunk: bytes | np.ndarray) -> str:
    """The crc32c a chunk carries (its last 4 bytes, as zarr's `crc32c` codec wrote them), hex."""
    return bytes(chunk[-4:]).hex()


def data_crc(chunk: bytes) -> str:
    """The crc32c of a chunk's data, in the byte order the codec writes it, hex."""
    return np.uint32(google_crc32c.value(chunk[:-4])).tobytes().hex()


def chunk_problem(name: str, rel: str, chunk: bytes, want: str) -> str | None:
    """What is wrong with one chunk of array `name` (`rel`: its key in the array, "c/0/1/0/0"), given
    the crc32c the manifest wants: a crc of another chunk (swapped in from elsewhere) or data that
    does not match its crc (damaged); None when intact."""
    if trailer_crc(chunk) != want:
        return f"{name}/{rel}: chunk checksum differs from the manifest"
    if data_crc(chunk) != want:
        return f"{name}/{rel}: chunk data does not match its crc32c"
    return None


def chunk_crcs(array_dir: Path) -> dict[str, str]:
    """The crc32c of every chunk file of one array on disk, keyed by its path relative to the
    array ("c/0/1/0/0"); each file's data must match the crc it carries."""
    out = {}
    for f in sorted((array_dir / "c").rglob("*")):
        if f.is_file():
            chunk, rel = f.read_bytes(), f.relative_to(array_dir).as_posix()
            if data_crc(chunk) != trailer_crc(chunk):
                raise ArtifactCorrupt(f"{array_dir.name}/{rel}: chunk data does not match its crc32c")
            out[rel] = trailer_crc(chunk)
    return out


def check_metadata(arr: zarr.Array, name: str, meta: dict) -> None:
    """The array's zarr metadata must describe what the manifest recorded (a swapped zarr.json
    could otherwise reshape or retype valid chunks)."""
    if list(arr.shape) != meta["shape"] or list(arr.chunks) != meta["chunks"] or str(arr.dtype) != meta["stored_dtype"]:
        raise ArtifactCorrupt(f"{name}: zarr metadata (shape {list(arr.shape)}, chunks {list(arr.chunks)}, "
                              f"dtype {arr.dtype}) differs from the manifest")


def check_complete(arr: zarr.Array, name: str) -> None:
    have, want = arr.nchunks_initialized, arr.nchunks
    if have != want:
        raise ArtifactCorrupt(f"{name}: {want - have} of {want} chunks missing on disk")


def record_read_back(name: str, arr: zarr.Array, data: np.ndarray, meta: dict, crcs: dict[str, str],
                     unit: str) -> None:
    """The publish read-back of one array: `data` (read back from storage) must equal what was
    written (the sha256 in `meta`), and `crcs` (its chunks' crc32c as read back) must cover every
    chunk; then they go into `meta["chunk_crc32c"]`, what every later read is checked against.
    `unit` names a chunk in the messages ("files", "objects")."""
    if sha256(data) != meta["sha256"]:
        raise ArtifactCorrupt(f"{name}: read-back checksum differs from what was written")
    if len(crcs) != arr.nchunks:
        raise ArtifactCorrupt(f"{name}: {len(crcs)} chunk {unit} for {arr.nchunks} chunks")
    meta["chunk_crc32c"] = dict(sorted(crcs.items()))


def verify_arrays(arrays: dict[str, dict], open_array: Callable[[str, dict], zarr.Array],
                  read_chunk: Callable[[str, str], bytes], where: str,
                  map_chunks: Callable[[Callable, Iterable], Iterator] = map) -> list[str]:
    """Check every array of a manifest (`arrays`: the manifest's `arrays`); return the problems
    found (empty: intact). Each array's zarr metadata is compared with the manifest; its chunks are
    fetched once each (`read_chunk(name, rel)`, FileNotFoundError when missing) and checked against
    the manifest's crc32c; arrays of a manifest written before chunk checksums existed are decoded
    and checked against the whole-array sha256 instead. `open_array(name, meta)` opens an array
    (KeyError / FileNotFoundError when it is missing), `where` ends the "missing" messages ("on
    disk", "in the object store"), `map_chunks` may fetch chunks in parallel."""
    problems: list[str] = []
    chunks: list[tuple[str, str, str]] = []  # (array, chunk key relative to it, crc32c wanted)
    for name, meta in sorted(arrays.items()):
        try:
            arr = open_array(name, meta)
            check_metadata(arr, name, meta)
            if "chunk_crc32c" in meta:
                chunks += [(name, rel, crc) for rel, crc in meta["chunk_crc32c"].items()]
                continue
            check_complete(arr, name)
            if sha256(arr[...]) != meta["sha256"]:
                problems.append(f"{name}: data differs from the sha256 in the manifest")
        except (KeyError, FileNotFoundError):
            problems.append(f"{name}: listed in the manifest but missing {where}")
        except (ArtifactCorrupt, ValueError) as e:
            problems.append(f"{name}: {e}" if not str(e).startswith(name) else str(e))

    def check(item: tuple[str, str, str]) -> str | None:
        name, rel, want = item
        try:
            chunk = read_chunk(name, rel)
        except FileNotFoundError:
            return f"{name}/{rel}: chunk missing {where}"
        return chunk_problem(name, rel, chunk, want)

    return problems + [p for p in map_chunks(check, sorted(chunks)) if p]


class VerifiedStore(WrapperStore):
    """A read-only zarr store over one context (a folder, or a build in an object store) that checks
    each chunk as it is read: it must exist (zarr would return the fill value for a missing one)
    and, where the manifest has its crc32c, carry that crc (the codec checks the data against it
    when decoding). Metadata documents (`zarr.json`) pass through; `check_metadata` compares them
    with the manifest."""

    def __init__(self, store, arrays: dict[str, dict]):
        super().__init__(store)
        self._arrays = arrays
        self._crcs = {f"{name}/{rel}": crc for name, meta in arrays.items()
                      for rel, crc in (meta.get("chunk_crc32c") or {}).items()}
        self._prefixes = tuple(f"{name}/c/" for name in arrays)

    def _with_store(self, store) -> "VerifiedStore":
        return type(self)(store, self._arrays)

    async def get(self, key, prototype, byte_range=None):
        if not key.startswith(self._prefixes):
            return await self._store.get(key, prototype, byte_range)
        buf = await self._store.get(key, prototype, None)
        if buf is None:
            raise ArtifactCorrupt(f"{key}: chunk missing on disk")
        want = self._crcs.get(key)
        if want is not None and trailer_crc(buf.as_numpy_array()) != want:
            raise ArtifactCorrupt(f"{key}: chunk checksum differs from the manifest")
        if byte_range is not None:  # not used by these arrays (no sharding); served after the check
            return await self._store.get(key, prototype, byte_range)
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]


class RecordingStore(WrapperStore):
    """A read-only pass-through that records the crc32c each chunk carries, keyed by its key in the
    store ("kv/k/c/0/1/0/0"): a read-back then gets each array's data (for its sha256) and its
    chunks' crcs (for the manifest) in one read."""

    def __init__(self, store, seen: dict[str, str] | None = None):
        super().__init__(store)
        self.seen = {} if seen is None else seen

    def _with_store(self, store) -> "RecordingStore":
        return type(self)(store, self.seen)

    async def get(self, key, prototype, byte_range=None):
        buf = await self._store.get(key, prototype, byte_range)
        if buf is not None and byte_range is None and "/c/" in key:
            self.seen[key] = trailer_crc(buf.as_numpy_array())
        return buf
