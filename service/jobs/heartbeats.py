"""Worker heartbeats, in Redis: which workers live, and what each publishes about itself.

    {p}worker:{kind}:{wid}   JSON {"at", ...info} of a live worker of `kind` (prefill, decode, train,
                             janitor); expires when the worker stops renewing it

The API counts them for `/readyz` and for `503 no_decode_worker`, and reads the decode workers'
published tiers for `/metrics`.
"""

from __future__ import annotations

import json
import time

import redis


class Heartbeats:
    def __init__(self, client: redis.Redis, prefix: str):
        self.r = client
        self.p = prefix

    def k_worker(self, kind: str, wid: str) -> str:
        return f"{self.p}worker:{kind}:{wid}"

    def beat(self, kind: str, wid: str, ttl_s: int, info: dict | None = None) -> None:
        """Heartbeat; `info` (JSON) is what the worker publishes about itself (tiers, device)."""
        self.r.set(self.k_worker(kind, wid), json.dumps({"at": time.time(), **(info or {})}), ex=ttl_s)

    def keep_alive(self, kind: str, wid: str, ttl_s: int) -> None:
        """Renew a worker's heartbeat without replacing what it published (from a heartbeat thread,
        while the worker's loop is busy)."""
        key = self.k_worker(kind, wid)
        if not self.r.expire(key, ttl_s):
            self.r.set(key, json.dumps({"at": time.time()}), ex=ttl_s)

    def live(self, kind: str) -> int:
        """How many workers of `kind` are live."""
        return sum(1 for _ in self.r.scan_iter(match=self.k_worker(kind, "*"), count=100))

    def info(self, kind: str) -> dict[str, dict]:
        """worker id -> its last heartbeat's info, for the live workers of a kind."""
        out = {}
        prefix = self.k_worker(kind, "")
        for key in self.r.scan_iter(match=self.k_worker(kind, "*"), count=100):
            raw = self.r.get(key)
            if raw:
                k = key.decode() if isinstance(key, bytes) else key
                out[k.removeprefix(prefix)] = json.loads(raw)
        return out
