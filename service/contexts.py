"""What the service does to a context as a whole, across the catalog, the prefill queue and
storage: register it (record + build job, single-flight) and delete it (record + artifacts). Used
by the routes (`service/api/routes/contexts.py`) and the janitor (expiry)."""

from __future__ import annotations

from service.runtime import Runtime
from storage.catalog import Registration
from storage.keys import PromptHash


def register_context(rt: Runtime, cid: PromptHash, record: dict, token_ids: list[int], wanted: dict[str, dict],
                     ttl_seconds: int | None) -> Registration:
    """Create the context's record and queue its build on the prefill queue, in one transaction,
    unless a live record exists (then only the indexes it lacks are queued); see `Catalog.register`."""
    return rt.catalog.register(cid, record, token_ids, wanted, ttl_seconds, enqueue=rt.queues.prefill.push)


def delete_context(rt: Runtime, cid: PromptHash) -> bool:
    """Remove a context's record and its artifacts. True if anything existed."""
    rec = rt.catalog.delete(cid)  # the record as it was, expired or not (None: there was none)
    slug = (rec or {}).get("slug") or rt.lm.spec.slug
    removed = rt.store.delete(slug, cid)
    return rec is not None or removed
