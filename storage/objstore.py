"""Context artifacts in object storage (AWS S3 and S3-compatible stores: MinIO, Ceph RGW, R2),
through obstore and zarr's `ObjectStore`. `open_context_store` picks this or the local folder.

Layout under the storage URL (`s3://bucket/prefix`):

    <slug>/<hash>/manifest.json       written last; a context exists iff its manifest exists
    <slug>/<hash>/<build>/...         the zarr arrays of one write: `b-<id>` holds the tokens, K/V and
                                      the indexes built with them, `i-<id>` indexes added later

The arrays, codecs and manifest are the local store's (storage/artifacts.py); the manifest adds
`arrays.<name>.root`, the build an array lives in. A manifest without it (a local context folder
copied into the bucket as it is: `aws s3 sync <data_dir>/contexts s3://bucket/prefix`) is read
from `<slug>/<hash>/<name>`.

What is guaranteed, and how, without the rename and the flock of a local disk:

* **No half-written context is ever visible.** A write puts every chunk under a build prefix of
  its own (a fresh random id: two writers never mix chunks, and a rebuild never overwrites chunks
  a reader is using), reads all of it back (each array's sha256 as written; each chunk's crc32c
  recorded) and only then creates the manifest, with a conditional PUT (`If-None-Match: *`). Each
  PUT is atomic, and readers open a context only through its manifest, so a build without one is
  never read. A failed write deletes its build; a crash leaves one nobody references, which
  `gc_temp` deletes once it is older than the threshold. Of two writers of the same context, the
  first manifest wins and the other deletes its build (the local store's rename rule).
* **Verified reads.** The same `VerifiedStore` as on disk (`storage/integrity.py`) checks every chunk object against the
  crc32c in the manifest as it arrives: a missing, swapped or damaged chunk raises
  `ArtifactCorrupt`, on every read (a tier that evicts reads it again).
* **No lost manifest update.** `add_indexes` and `update_metadata` replace the manifest with a
  compare-and-swap (`If-Match` on the ETag of the version read, retried on a conflict): the local
  store's per-context flock, across machines. A cached read handle notices a new manifest by its
  ETag (one HEAD per request).
* **Delete** removes the manifest first (the context is gone for every reader at once), then
  every object under the context's prefix.
* **The store down or refusing** (network, credentials, 5xx after retries): `StorageUnavailable`,
  an `OSError`, which the API answers 503 `storage_unavailable`; never a wrong answer.

Conditional writes are required: AWS S3 (since November 2024), MinIO, Ceph RGW and moto have them.

Why obstore (not s3fs through `FsspecStore`): its conditional PUTs (create, and update by ETag)
are what the manifest protocol rests on, and it is one self-contained wheel (s3fs pulls aiobotocore
and pins botocore tightly). Credentials, region and endpoint come from the standard AWS variables
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
`AWS_ENDPOINT_URL`), read by obstore itself; the service's settings only name the URL and, where
set, the endpoint and region.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path, PurePosixPath

import obstore
import obstore.exceptions as obx
import torch
import zarr
from obstore.store import S3Store
from zarr.storage import ObjectStore

from storage.artifacts import (
    FORMAT,
    MANIFEST,
    METADATA_FIELDS,
    ArtifactCorrupt,
    ArtifactError,
    ArtifactMissing,
    ContextArtifacts,
    ContextStore,
    IndexArrays,
)
from storage.integrity import RecordingStore, VerifiedStore, record_read_back, verify_arrays
from storage.keys import PromptHash

BUILD_PREFIXES = ("b-", "i-")  # a context's first write, indexes added later
CAS_TRIES = 20  # compare-and-swap attempts on one manifest before giving up (each loses only to another writer)


class StorageUnavailable(OSError):
    """The object store could not be reached or refused a request (not: an object is missing)."""


@contextlib.contextmanager
def _storage_errors(what: str) -> Iterator[None]:
    """obstore's errors as `StorageUnavailable`, but for a missing object (FileNotFoundError) and
    the conditional-write outcomes the callers handle. The message names the error class only: the
    full one (with the endpoint and bucket) stays in the exception chain, for the logs."""
    try:
        yield
    except (ArtifactError, FileNotFoundError, obx.AlreadyExistsError, obx.PreconditionError):
        raise
    except obx.BaseError as e:
        raise StorageUnavailable(errno.EIO, f"object storage: {what} failed ({type(e).__name__})") from e


def _build_id(kind: str) -> str:
    return f"{kind}{uuid.uuid4().hex[:16]}"


class ObjectContextStore(ContextStore):
    """All contexts under one object-store URL (`s3://bucket/prefix`). Same interface and
    manifest as the local `ContextStore`, whose array writing it shares; everything that touches
    storage is its own (module docstring: the protocol and what it guarantees)."""

    min_gc_interval_s = 600.0  # `gc_temp` lists the whole bucket prefix: the janitor's ticks are too frequent for that

    def __init__(self, url: str, *, endpoint_url: str | None = None, region: str | None = None):
        if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
            raise ValueError(f"storage URL {url!r}: expected s3://bucket[/prefix]")
        self.url = url.rstrip("/")
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self._opts = dict(
            config={k: v for k, v in {"endpoint": endpoint, "region": region}.items() if v},
            client_options={"allow_http": bool(endpoint and endpoint.startswith("http://")),
                            "connect_timeout": timedelta(seconds=5), "timeout": timedelta(seconds=120)},
            # bounded: a store that is down fails a request within ~20 s, not after obstore's default 3 minutes
            retry_config={"max_retries": 3, "retry_timeout": timedelta(seconds=20)},
        )
        self.s3 = S3Store.from_url(self.url, **self._opts)
        self._last_gc = float("-inf")

    def __repr__(self) -> str:
        return f"ObjectContextStore({self.url!r})"

    # -- paths and small operations -------------------------------------------------------------

    @staticmethod
    def _ctx(slug: str, key: PromptHash) -> str:
        return f"{slug}/{key.hex}"

    @staticmethod
    def _root(ctx: str, meta: dict) -> str:
        """Where an array's build lives (the context's prefix itself for a copied local context)."""
        return f"{ctx}/{meta['root']}" if meta.get("root") else ctx

    def context_dir(self, slug: str, key: PromptHash) -> PurePosixPath:
        """The context's prefix (relative to the storage URL)."""
        return PurePosixPath(self._ctx(slug, key))

    def _zarr_store(self, prefix: str, *, read_only: bool) -> ObjectStore:
        """A zarr store rooted at one build (its own client on that prefix): the arrays' keys are
        then the local layout's, and zarr writes no group documents above the build."""
        return ObjectStore(S3Store.from_url(f"{self.url}/{prefix}", **self._opts), read_only=read_only)

    def _list(self, prefix: str) -> list[dict]:
        with _storage_errors("list"):
            return [meta for batch in obstore.list(self.s3, prefix, chunk_size=1000) for meta in batch]

    def _delete_prefix(self, prefix: str) -> int:
        paths = [m["path"] for m in self._list(prefix)]
        with _storage_errors("delete"):
            for i in range(0, len(paths), 1000):
                obstore.delete(self.s3, paths[i:i + 1000])
        return len(paths)

    def _discard_build(self, prefix: str) -> None:
        """Best effort after a failed write: what stays is unreferenced, and `gc_temp` removes it."""
        with contextlib.suppress(Exception):
            self._delete_prefix(prefix)

    def exists(self, slug: str, key: PromptHash) -> bool:
        try:
            with _storage_errors("head"):
                obstore.head(self.s3, f"{self._ctx(slug, key)}/{MANIFEST}")
        except FileNotFoundError:
            return False
        return True

    def storage_check(self) -> dict:
        """Readiness: write and delete a small object (credentials, bucket and write permission).
        Reported by URL; the error names its class only."""
        out = {"ok": True, "url": self.url}
        probe = f".readyz/{uuid.uuid4().hex}"
        try:
            with _storage_errors("probe"):
                obstore.put(self.s3, probe, b"ok")
                obstore.delete(self.s3, probe)
        except OSError as e:
            out.update(ok=False, error=f"storage cannot be written: {e.strerror or type(e).__name__}")
        return out

    # -- manifests ------------------------------------------------------------------------------

    def _get_manifest(self, slug: str, key: PromptHash) -> tuple[dict, str | None]:
        """The manifest and its ETag (what a compare-and-swap and a handle's `is_current` use)."""
        path = f"{self._ctx(slug, key)}/{MANIFEST}"
        try:
            with _storage_errors("manifest read"):
                res = obstore.get(self.s3, path)
                data, etag = bytes(res.bytes()), res.meta.get("e_tag")
        except FileNotFoundError as e:
            raise ArtifactMissing(f"context {key.hex} has no manifest in the object store") from e
        try:
            manifest = json.loads(data)
        except ValueError as e:
            raise ArtifactCorrupt(f"{path}: manifest is not valid JSON") from e
        if manifest.get("format") != FORMAT or manifest.get("prompt_hash") != key.hex:
            raise ArtifactCorrupt(f"{path}: manifest does not describe context {key.hex}")
        return manifest, etag

    def read_manifest(self, slug: str, key: PromptHash) -> dict:
        return self._get_manifest(slug, key)[0]

    def _put_manifest(self, slug: str, key: PromptHash, manifest: dict, mode) -> None:
        data = json.dumps(manifest, indent=1, sort_keys=True).encode()
        with _storage_errors("manifest write"):
            obstore.put(self.s3, f"{self._ctx(slug, key)}/{MANIFEST}", data, mode=mode, use_multipart=False)

    def _swap_manifest(self, slug: str, key: PromptHash, change: Callable[[dict], bool]) -> dict:
        """Read-modify-write of one manifest as a compare-and-swap: `change` edits the manifest it
        is given and says whether it changed anything; the new one is written only over the
        version read (`If-Match` its ETag), else read again and retried."""
        for attempt in range(CAS_TRIES):
            manifest, etag = self._get_manifest(slug, key)
            if not change(manifest):
                return manifest
            try:
                self._put_manifest(slug, key, manifest, mode={"e_tag": etag})
                return manifest
            except obx.PreconditionError:
                time.sleep(random.uniform(0.0, 0.05 * (attempt + 1)))  # another writer got there first
            except FileNotFoundError as e:  # deleted since it was read
                raise ArtifactMissing(f"context {key.hex} was deleted") from e
        raise StorageUnavailable(errno.EAGAIN, f"object storage: manifest of {key.hex} kept changing; retry")

    # -- writing --------------------------------------------------------------------------------

    def _read_back(self, path: str, arrays_meta: dict) -> None:
        """Read a build back: every array equal to what was written (sha256), every chunk present;
        record each chunk's crc32c in `arrays_meta` (what every later read is checked against)."""
        rec = RecordingStore(self._zarr_store(path, read_only=True))
        group = zarr.open_group(store=rec, mode="r", zarr_format=3)
        for name, meta in arrays_meta.items():
            arr = group[name]
            try:
                data = arr[...]
            except ValueError as e:  # a chunk whose data does not match its crc32c
                raise ArtifactCorrupt(f"{name}: read-back failed: {e}") from e
            head = f"{name}/"
            crcs = {k.removeprefix(head): crc for k, crc in rec.seen.items() if k.startswith(head + "c/")}
            record_read_back(name, arr, data, meta, crcs, "objects")

    def _write_build(self, path: str, write: Callable[[zarr.Group], dict]) -> dict:
        """Write one build (`write` fills the group and returns the arrays' metadata), read it back;
        the arrays' metadata with their `root`. A failure deletes the build."""
        build = path.rsplit("/", 1)[1]
        try:
            with _storage_errors("write"):
                group = zarr.open_group(store=self._zarr_store(path, read_only=False), mode="w-", zarr_format=3)
                arrays = write(group)
                self._read_back(path, arrays)
        except BaseException:
            self._discard_build(path)
            raise
        for meta in arrays.values():
            meta["root"] = build
        return arrays

    def publish(self, key: PromptHash, spec, tokens: list[int], k: torch.Tensor, v: torch.Tensor,
                indexes: list[IndexArrays], meta: dict) -> dict:
        """Write a whole context as a new build, read it back, then create its manifest (only if
        none exists: the first writer wins); return the manifest in force."""
        ctx = self._ctx(spec.slug, key)
        path = f"{ctx}/{_build_id('b-')}"
        t0 = time.perf_counter()
        index_meta: dict = {}

        def write(group: zarr.Group) -> dict:
            arrays, built = self._write_context(group, tokens, k, v, indexes)
            index_meta.update(built)
            return arrays

        arrays = self._write_build(path, write)
        manifest = self._new_manifest(key, spec, len(tokens), arrays, index_meta, meta, t0)
        try:
            self._put_manifest(spec.slug, key, manifest, mode="create")
        except obx.AlreadyExistsError:
            current = self.read_manifest(spec.slug, key)
            if current["arrays"]["kv/k"].get("root") != manifest["arrays"]["kv/k"]["root"]:
                self._discard_build(path)  # an earlier build of the same content: keep it
            return current  # (else: ours, answered twice by a retried PUT)
        # any other failure leaves the build: referenced if the PUT did land, else gc_temp's
        return manifest

    def add_indexes(self, slug: str, key: PromptHash, indexes: list[IndexArrays]) -> dict:
        """Write the indexes the manifest lacks as one new build, read it back, then add them to
        the manifest by compare-and-swap; arrays of an index another writer added meanwhile are
        deleted again."""
        ctx = self._ctx(slug, key)
        have = self.read_manifest(slug, key)["indexes"]
        todo = [idx for idx in indexes if idx.index_id not in have]
        if not todo:
            return self.read_manifest(slug, key)
        path = f"{ctx}/{_build_id('i-')}"
        entries: dict[str, dict] = {}

        def write(group: zarr.Group) -> dict:
            arrays: dict[str, dict] = {}
            for idx in todo:
                entries[idx.index_id] = self._write_index(group, idx, arrays)
            return arrays

        arrays = self._write_build(path, write)
        added: list[str] = []

        def change(manifest: dict) -> bool:
            added[:] = [i for i in entries if i not in manifest["indexes"]]
            for index_id in added:
                manifest["indexes"][index_id] = entries[index_id]
                manifest["arrays"].update({n: m for n, m in arrays.items() if n.startswith(f"indexes/{index_id}/")})
            manifest["bytes"] = sum(a["nbytes"] for a in manifest["arrays"].values())
            return bool(added)

        try:
            manifest = self._swap_manifest(slug, key, change)
        except ArtifactError:
            self._discard_build(path)
            raise
        for index_id in set(entries) - set(added):
            self._discard_build(f"{path}/indexes/{index_id}")
        return manifest

    def update_metadata(self, slug: str, key: PromptHash, **fields) -> dict:
        """Set mutable metadata (`display_name`, `expires_at`) in the stored manifest by
        compare-and-swap; `ArtifactMissing` when the context is not published."""
        unknown = set(fields) - set(METADATA_FIELDS)
        if unknown:
            raise ValueError(f"not manifest metadata: {sorted(unknown)}")

        def change(manifest: dict) -> bool:
            if all(manifest.get(k) == v for k, v in fields.items()):
                return False
            manifest.update(fields)
            return True

        return self._swap_manifest(slug, key, change)

    def delete(self, slug: str, key: PromptHash) -> bool:
        """Remove the manifest (the context is gone for readers at once), then its prefix."""
        ctx = self._ctx(slug, key)
        with contextlib.suppress(FileNotFoundError), _storage_errors("delete"):
            obstore.delete(self.s3, f"{ctx}/{MANIFEST}")
        return self._delete_prefix(ctx) > 0

    # -- checking -------------------------------------------------------------------------------

    def verify(self, slug: str, key: PromptHash) -> list[str]:
        """Check every chunk object of a published context against its manifest (the local
        store's checks and messages, chunk objects fetched in parallel); [] when intact."""
        ctx = self._ctx(slug, key)
        manifest = self.read_manifest(slug, key)
        groups: dict[str, zarr.Group] = {}  # build -> group

        def open_array(name: str, meta: dict) -> zarr.Array:
            root = self._root(ctx, meta)
            with _storage_errors("read"):
                if root not in groups:
                    groups[root] = zarr.open_group(store=self._zarr_store(root, read_only=True), mode="r", zarr_format=3)
                return groups[root][name]

        def read_chunk(name: str, rel: str) -> bytes:
            with _storage_errors("read"):
                return bytes(obstore.get(self.s3, f"{self._root(ctx, manifest['arrays'][name])}/{name}/{rel}").bytes())

        with ThreadPoolExecutor(8) as pool:  # one GET per chunk: overlap the round trips
            return verify_arrays(manifest["arrays"], open_array, read_chunk, "in the object store", pool.map)

    # -- reading and listing --------------------------------------------------------------------

    def open(self, slug: str, key: PromptHash) -> "ObjectContextArtifacts":
        manifest, etag = self._get_manifest(slug, key)
        return ObjectContextArtifacts(self, self._ctx(slug, key), manifest, etag)

    def stored_contexts(self) -> Iterator[tuple[str, PromptHash]]:
        """(slug, id) of every prefix that looks like a context, published or not."""
        with _storage_errors("list"):
            slugs = obstore.list_with_delimiter(self.s3)["common_prefixes"]
        for slug in sorted(s for s in slugs if not s.startswith(".")):
            with _storage_errors("list"):
                ctxs = obstore.list_with_delimiter(self.s3, slug)["common_prefixes"]
            for ctx in sorted(ctxs):
                try:
                    yield slug, PromptHash(ctx.rsplit("/", 1)[-1])
                except ValueError:
                    continue

    def iter_manifests(self):
        """Every published context (used to rebuild the catalog if Redis lost it). A store that
        cannot be listed raises: a rebuild must not report an empty bucket."""
        for slug, key in self.stored_contexts():
            try:
                yield slug, self.read_manifest(slug, key)
            except ArtifactError:
                continue

    def gc_temp(self, older_than_s: float = 3600.0) -> int:
        """Delete builds no manifest references (a crashed or lost write), once their newest object
        is older than `older_than_s`; a context whose manifest cannot be read is left to fsck.
        Lists the whole prefix, so it runs at most every `min_gc_interval_s`; returns the number of
        builds removed."""
        now = time.monotonic()
        if now - self._last_gc < self.min_gc_interval_s:
            return 0
        self._last_gc = now
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than_s)
        removed = 0
        for slug, key in list(self.stored_contexts()):
            ctx = self._ctx(slug, key)
            newest: dict[str, datetime] = {}  # build -> its newest object's time
            objects = self._list(ctx)
            for meta in objects:
                top, _, rest = meta["path"][len(ctx) + 1:].partition("/")
                if rest and top.startswith(BUILD_PREFIXES):
                    newest[top] = max(newest.get(top, meta["last_modified"]), meta["last_modified"])
            try:
                used = {m.get("root") for m in self.read_manifest(slug, key)["arrays"].values()}
            except ArtifactMissing:
                used = set()
            except ArtifactCorrupt:
                continue
            for build, when in newest.items():
                if build not in used and when < cutoff:
                    self._delete_prefix(f"{ctx}/{build}")
                    removed += 1
            if not used and not newest and objects and max(m["last_modified"] for m in objects) < cutoff:
                self._delete_prefix(ctx)  # what zarr wrote next to a build (group documents)
        return removed


class ObjectContextArtifacts(ContextArtifacts):
    """Read side of one context in object storage: arrays read lazily through `VerifiedStore`
    (each chunk object checked against the manifest's crc32c as it arrives)."""

    where = "in the object store"

    def __init__(self, store: ObjectContextStore, ctx: str, manifest: dict, etag: str | None):
        self.path = PurePosixPath(ctx)
        self.manifest = manifest
        self._store = store
        self._ctx = ctx
        self._etag = etag
        self._groups: dict[str, zarr.Group] = {}
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def _group_of(self, meta: dict) -> zarr.Group:
        """The group of the build an array lives in, read through `VerifiedStore` with the
        manifest's crcs of that build's arrays; opened once per build. Under the lock."""
        root = ObjectContextStore._root(self._ctx, meta)
        if root not in self._groups:
            arrays = {name: m for name, m in self.manifest["arrays"].items()
                      if ObjectContextStore._root(self._ctx, m) == root}
            store = VerifiedStore(self._store._zarr_store(root, read_only=True), arrays)
            self._groups[root] = zarr.open_group(store=store, mode="r", zarr_format=3)
        return self._groups[root]

    def is_current(self) -> bool:
        """Whether this handle still describes what is stored (the manifest's ETag, one HEAD; on a
        new ETag, the arrays and indexes compared as on disk). A store that cannot be reached
        raises `StorageUnavailable` rather than serving a context that may be gone."""
        slug, hex_ = self._ctx.rsplit("/", 1)
        key = PromptHash(hex_)
        try:
            with _storage_errors("head"):
                etag = obstore.head(self._store.s3, f"{self._ctx}/{MANIFEST}").get("e_tag")
        except FileNotFoundError:
            return False
        if etag is not None and etag == self._etag:
            return True
        try:
            manifest, etag = self._store._get_manifest(slug, key)
        except ArtifactError:
            return False
        if manifest.get("arrays") != self.manifest["arrays"] or manifest.get("indexes") != self.manifest["indexes"]:
            return False
        self.manifest, self._etag = manifest, etag
        return True

    def read(self, name: str, layer: int | None = None) -> torch.Tensor:
        with _storage_errors(f"read of {name}"):
            return super().read(name, layer)


def open_context_store(url: str | None, local_root: Path, *, endpoint_url: str | None = None,
                       region: str | None = None) -> ContextStore:
    """The store the settings name: object storage at `url` (`s3://bucket/prefix`), else the
    local folder `local_root` (as before the setting existed)."""
    if url:
        return ObjectContextStore(url, endpoint_url=endpoint_url, region=region)
    return ContextStore(local_root)
