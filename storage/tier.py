"""Memory tiers above the zarr store: bounded in-memory caches of artifact arrays, LRU by bytes.

The decode worker asks for (context, array, layer) slices. Two tiers stack:

* **DRAM** (`dram_tier_bytes`): a miss reads the slice from the zarr store (SSD), a hit is a dict
  lookup. Later questions on the same context never touch the disk while it fits.
* **GPU** (`gpu_cache_bytes`, on a GPU worker): a miss copies the slice from the DRAM tier to the
  device once; a hit returns the resident device tensor. Decode steps read context K/V and index
  arrays from here, so nothing crosses PCIe per step (except under the `offload` backends, which
  keep the context's K/V, or its values, pinned in DRAM on purpose; the GPU's kernels read the rows
  a step attends in place).

Entries larger than a tier's whole capacity are returned uncached. Evicting an entry drops the
tier's reference: a tensor a running request still holds stays alive until that request is done.

A tier can also count memory it does not cache: `reserve(key, nbytes)` (the decode worker's batched
requests' own GPU buffers: request-local K/V, the offload backends' row cache) shrinks the room for
cached entries, evicting the least recent ones, until `release(key)`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


class TensorTier:
    """An LRU cache of tensors bounded by bytes. Thread-safe; `load` runs outside the lock (two
    racing misses both load; the first one stored wins and both callers get a valid tensor)."""

    def __init__(self, capacity_bytes: int, name: str = "dram"):
        self.capacity = int(capacity_bytes)
        self.name = name
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._reserved: dict[Hashable, int] = {}  # key -> bytes counted but not cached (`reserve`)
        self._reserved_total = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    @property
    def reserved(self) -> int:
        return self._reserved_total

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple, load: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """Return (tensor, hit)."""
        with self._lock:
            t = self._items.get(key)
            if t is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return t, True
            self.misses += 1
        t = load()
        size = t.numel() * t.element_size()
        with self._lock:
            if size > self.capacity - self._reserved_total:
                return t, False
            if key in self._items:
                return self._items[key], False
            self._items[key] = t
            self._bytes += size
            self._evict()
        return t, False

    def reserve(self, key: Hashable, nbytes: int) -> None:
        """Count `nbytes` under `key` (replacing what it counted before) against the capacity, evicting
        least recent entries to make room. Reservations are never evicted: past the capacity, nothing
        is cached until they are released."""
        with self._lock:
            self._reserved_total += int(nbytes) - self._reserved.get(key, 0)
            self._reserved[key] = int(nbytes)
            self._evict()

    def release(self, key: Hashable) -> None:
        with self._lock:
            self._reserved_total -= self._reserved.pop(key, 0)

    def _evict(self) -> None:  # under the lock
        while self._items and self._bytes + self._reserved_total > self.capacity:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
            self.evictions += 1

    def contains(self, key: tuple) -> bool:
        with self._lock:
            return key in self._items

    def drop(self, prefix: Hashable) -> int:
        """Remove every entry whose key starts with `prefix` (a context id); return bytes freed."""
        with self._lock:
            doomed = [k for k in self._items if k[0] == prefix]
            freed = 0
            for k in doomed:
                t = self._items.pop(k)
                freed += t.numel() * t.element_size()
            self._bytes -= freed
            return freed

    def snapshot(self) -> dict:
        """Counters for /metrics and stats: bytes held, capacity, entries, hits, misses, evictions."""
        with self._lock:
            return {"tier": self.name, "bytes": self._bytes, "reserved_bytes": self._reserved_total, "capacity_bytes": self.capacity,
                    "entries": len(self._items),
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions}


DramTier = TensorTier  # the name the decode worker and the eval harness used before the GPU tier existed
