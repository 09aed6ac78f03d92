"""Typed keys. Every key is a sha256 digest; the built-in, per-process salted hash is never used."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KV_DTYPES = ("float32", "bfloat16", "float16")  # what a context's K/V may be stored in (torch dtype names)


@dataclass(frozen=True, order=True)
class PromptHash:
    """Content address of a context: sha256 over (model fingerprint, tokenizer fingerprint, the dtype
    its K/V are stored in, token ids).

    The KV dtype is part of it because it changes what is served: a context stored in bfloat16 is
    never answered as if float32 or the other way round; the same text registered with another
    `kv_dtype` is another context (built once more, stored next to the first). float32 adds
    nothing to the digest, so the ids of contexts stored before the dtype was a setting (all
    float32) stay what they were.
    What is *not* part of it: display name, ttl, which methods were requested and their params
    (indexes are stored per method under the context, each keyed by its own `params_hash`).
    The string form (64 lowercase hex digits) is the context id in the API.
    """

    hex: str

    def __post_init__(self) -> None:
        if not _HEX64.match(self.hex):
            raise ValueError(f"not a prompt hash (64 lowercase hex digits): {self.hex!r}")

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

    @classmethod
    def from_string(cls, s: str) -> "PromptHash":
        return cls(s)

    def to_string(self) -> str:
        return self.hex

    def __str__(self) -> str:
        return self.hex


def params_hash(method: str, version: int, build_params: dict) -> str:
    """Identity of a method's persisted index: method name, its artifact version, build params."""
    blob = json.dumps({"method": method, "version": version, "params": build_params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
