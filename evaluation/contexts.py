"""The stored contexts an evaluation measures, reached the way the service's workers reach them
(`decoder/pipeline.py`): `Artifacts` publishes a document into a `ContextStore` once (prefill,
build the indexes a config needs, publish; reused across runs) and `ContextReader` opens a stored
context for decoding (per-layer arrays through the DRAM tier, the method's planner, the backend).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from decoder.generate import ContextKV
from decoder.pipeline import ContextTiers, OpenedContext, build_context, open_context
from indexer.base import MethodParams, Planner, SparseMethod, get_method
from storage.artifacts import ContextStore
from storage.keys import PromptHash

log = logging.getLogger("ctxcache.eval")


@dataclass
class Published:
    key: PromptHash
    n_tokens: int
    reused: bool  # the context was already in the store
    prefill_s: float  # 0 when nothing had to be prefilled
    built: dict[str, float]  # index_id -> build seconds (this run)
    failed: dict[str, str]  # index_id -> error of its build


class Artifacts:
    """Publishes contexts into a ContextStore and opens them for decoding, like the two workers
    (`decoder/pipeline.py`)."""

    def __init__(self, lm, store: ContextStore, *, tier_bytes: int, chunk_tokens: int, prompt_format: str = "chat"):
        self.lm = lm
        self.store = store
        self.tiers = ContextTiers(tier_bytes)
        self.chunk_tokens = chunk_tokens
        self.prompt_format = prompt_format

    def key(self, ids: list[int]) -> PromptHash:
        spec = self.lm.spec
        return PromptHash.compute(spec.fingerprint, spec.tokenizer_fingerprint, ids)

    def ensure(self, ids: list[int], wanted: dict[str, tuple[SparseMethod, MethodParams]]) -> Published:
        """wanted: index_id -> (method, params) of every index-bearing run that can run."""
        spec = self.lm.spec
        key = self.key(ids)
        reused = self.store.exists(spec.slug, key)
        have = set(self.store.read_manifest(spec.slug, key)["indexes"]) if reused else set()
        todo = {i: mp for i, mp in wanted.items() if i not in have}
        if reused and not todo:
            return Published(key, len(ids), True, 0.0, {}, {})
        res = build_context(self.lm, self.store, key, ids, todo, chunk_tokens=self.chunk_tokens, keep_going=True,
                            manifest_extra={"prompt_format": self.prompt_format, "display_name": "ctxcache eval"})
        for index_id, err in res.failed.items():
            log.error("building %s failed: %s", index_id, err)
        return Published(key, len(ids), reused, res.prefill_s, res.built, res.failed)

    def reader(self, key: PromptHash) -> "ContextReader":
        return ContextReader(self.store.open(self.lm.spec.slug, key), key.hex, self.tiers, spec=self.lm.spec)


class ContextReader:
    """Decode side of one stored context (the DecodeWorker's path: `decoder.pipeline.open_context`)."""

    def __init__(self, art, cid: str, tiers: ContextTiers, spec=None):
        self.art = art
        self.spec = spec  # index ids of methods bound to a trained model (SAAP) include its digest
        self.cid = cid
        self.tiers = tiers
        self.n_tokens = art.n_tokens

    def open(self, method: SparseMethod, params: MethodParams, max_local: int = 1024) -> OpenedContext:
        index_id = method.index_id(params, self.spec) if method.has_index else None
        return open_context(self.art, self.cid, method, params, index_id, tiers=self.tiers, spec=self.spec,
                            max_local=max_local)

    def context_kv(self) -> ContextKV:
        return self.open(get_method("full"), get_method("full").Params()).kv

    def planner(self, method: SparseMethod, params: MethodParams, max_local: int = 1024) -> Planner:
        return self.open(method, params, max_local).planner
