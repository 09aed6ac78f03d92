"""DRAM tier: a bounded in-memory cache of artifact arrays, LRU by bytes.

The decode worker asks for (context, array, layer) slices; a miss reads from the zarr store
(SSD tier), a hit is a dict lookup. Later questions on the same context never touch disk while
the context fits. Entries larger than the whole capacity are returned uncached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch


class DramTier:
    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._items: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple, load: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """Return (tensor, hit). `load` runs outside the lock (two racing misses both load; one wins)."""
        with self._lock:
            t = self._items.get(key)
            if t is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return t, True
            self.misses += 1
        t = load()
        size = t.numel() * t.element_size()
        if size > self.capacity:
            return t, False
        with self._lock:
            if key not in self._items:
                self._items[key] = t
                self._bytes += size
            while self._bytes > self.capacity:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
        return t, False

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
