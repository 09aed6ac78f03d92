"""Typed keys. Every key is a sha256 digest; the built-in, per-process salted hash is never used."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

_HEX64 = re.compile(r"[0-9a-f]{64}")
_INDEX_ID = re.compile(r"([a-z0-9_]+)-([0-9a-f]{16})")
KV_DTYPES = ("float32", "bfloat16", "float16")  # what a context's K/V may be stored in (torch dtype names)


@dataclass(frozen=True, order=True)
class _Sha256Id:
    """A sha256 digest used as an id: 64 lowercase hex digits, validated when made. Ids enter as
    strings at the boundaries (a URL path, a queued job's JSON, a Redis key) through `from_string`
    and leave through `to_string`; in between they are passed as this type."""

    hex: str
    _what = "sha256 id"

    def __post_init__(self) -> None:
        if not isinstance(self.hex, str) or not _HEX64.fullmatch(self.hex):
            raise ValueError(f"not a {self._what} (64 lowercase hex digits): {self.hex!r}")

    @classmethod
    def from_string(cls, s: str):
        return cls(s)

    def to_string(self) -> str:
        return self.hex

    def __str__(self) -> str:
        return self.hex


@dataclass(frozen=True, order=True)
class PromptHash(_Sha256Id):
    """Content address of a context: sha256 over (model fingerprint, tokenizer fingerprint, the dtype
    its K/V are stored in, token ids).

    The KV dtype is part of it because it changes what is served: a context stored in bfloat16 is
    never answered as if float32 or the other way round; the same text registered with another
    `kv_dtype` is another context (built once more, stored next to the first). float32 adds
    nothing to the digest, so the ids of contexts stored before the dtype was a setting (all
    float32) stay what they were.
    What is *not* part of it: display name, ttl, which methods were requested and their params
    (indexes are stored per method under the context, each keyed by its own `params_hash`).
    The string form (64 lowercase hex digits) is the context id in the API; the API parses a path's
    id once (`from_string`) and passes this type down to the catalog, the job queues and the workers.
    """

    _what = "prompt hash"

    @classmethod
    def compute(cls, model_fingerprint: str, tokenizer_fingerprint: str, token_ids: Iterable[int],
                kv_dtype: str = "float32") -> "PromptHash":
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
        h = hashlib.sha256()
        h.update(b"ctxcache-prompt-v1\0")
        h.update(model_fingerprint.encode() + b"\0")
        h.update(tokenizer_fingerprint.encode() + b"\0")
        if kv_dtype != "float32":  # token bytes (ids < 2^32) never spell this text: no collision
            h.update(b"kv_dtype=" + kv_dtype.encode() + b"\0")
        h.update(np.asarray(list(token_ids), dtype="<i8").tobytes())
        return cls(h.hexdigest())



@dataclass(frozen=True, order=True)
class TrainJobId(_Sha256Id):
    """Id of an offline training job: sha256 of what it trains (model fingerprint, resolved
    settings, corpus content), so equal requests are one job (`service/api/routes/training.py`)."""

    _what = "training job id"


@dataclass(frozen=True, order=True)
class IndexId:
    """Identity of a method's persisted index: `<method>-<params_hash>` (16 hex digits, see
    `params_hash`), the name of its folder under a context and its key in the manifest."""

    method: str
    params_hash: str

    def __post_init__(self) -> None:
        if not _INDEX_ID.fullmatch(f"{self.method}-{self.params_hash}"):
            raise ValueError(f"not an index id (<method>-<16 hex digits>): {self.method!r}, {self.params_hash!r}")

    @classmethod
    def from_string(cls, s: str) -> "IndexId":
        m = _INDEX_ID.fullmatch(s) if isinstance(s, str) else None
        if m is None:
            raise ValueError(f"not an index id (<method>-<16 hex digits>): {s!r}")
        return cls(m.group(1), m.group(2))

    def to_string(self) -> str:
        return f"{self.method}-{self.params_hash}"

    def __str__(self) -> str:
        return self.to_string()


def params_hash(method: str, version: int, build_params: dict) -> str:
    """Identity of a method's persisted index: method name, its artifact version, build params."""
    blob = json.dumps({"method": method, "version": version, "params": build_params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
