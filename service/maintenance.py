"""Operator tasks over the whole store: rebuild the catalog from storage, verify every stored context.

Storage is the source of truth: each published context's manifest holds what the catalog needs to
serve it (model, methods and their index ids, token count, display name, expiry), and a PATCH
writes the manifest before Redis. So a catalog that lost its data (FLUSHDB, a fresh Redis) is
rebuilt from the manifests alone, with current names and expiries; nothing is deleted on the way
(a context whose manifest says it expired is re-added with that expiry, and the janitor removes
it like any other expired context).

`fsck` reads every chunk file of every stored context and checks it against the crc32c its
manifest recorded at publish and its data against that crc (`ContextStore.verify`); a damaged context is marked `failed` with
`artifact_corrupt` (or `artifact_missing`) in the catalog, so it answers 409 instead of wrong
tokens, and registering it again rebuilds it.

Used by the API at startup and by the admin routes (`service/api/routes/admin.py`), and by the
prefill worker when a build's record vanished while it ran.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from service.runtime import Runtime
from storage.artifacts import MANIFEST, ArtifactCorrupt, ArtifactMissing
from storage.keys import PromptHash

log = logging.getLogger("ctxcache")


def restore_record(rt: Runtime, slug: str, manifest: dict) -> bool:
    """Add a ready record for one published context from its manifest; False if the catalog knows it."""
    from indexer.base import get_method

    cid = PromptHash.from_string(manifest["prompt_hash"])
    methods = {}
    for index_id, entry in manifest.get("indexes", {}).items():
        try:
            m = get_method(entry["method"])
            methods[entry["method"]] = {"params": m.Params.model_validate(entry["params"]).model_dump(), "index_id": index_id}
        except Exception:  # noqa: BLE001 - a method this build does not know: skip that index
            continue
    record = {"model": manifest["model"]["name"], "slug": slug, "n_tokens": manifest["n_tokens"],
              "prompt_format": manifest.get("prompt_format", "chat"), "display_name": manifest.get("display_name") or "",
              "expires_at": manifest.get("expires_at") or "", "kv_dtype": manifest.get("kv_dtype") or "float32",
              "bytes": manifest["bytes"], "timings": json.dumps(manifest.get("timings", {}))}
    return rt.catalog.add_ready(cid, record, methods, manifest)


def rebuild_catalog(rt: Runtime) -> dict:
    """Re-add every published context the catalog does not know. Returns counts: `added`, `known`."""
    added = known = 0
    for slug, manifest in rt.store.iter_manifests():
        if restore_record(rt, slug, manifest):
            added += 1
        else:
            known += 1
    if added:
        log.info("catalog: re-added %d contexts found on disk", added)
    return {"added": added, "known": known}


@dataclass
class FsckReport:
    checked: int = 0
    damaged: list[dict] = field(default_factory=list)  # {"id", "slug", "code", "problems", "marked"}
    keys: list[PromptHash] = field(default_factory=list)  # the damaged contexts' ids, in the same order

    @property
    def ok(self) -> int:
        return self.checked - len(self.damaged)

    def to_dict(self) -> dict:
        return {"checked": self.checked, "ok": self.ok, "damaged": self.damaged}


def verify_store(store, report: FsckReport | None = None) -> FsckReport:
    """Verify every context under the store, a folder or a bucket (no catalog needed: `ctxcache
    fsck --data-dir` / `--storage-url`). A context without a readable manifest is damaged too."""
    report = report or FsckReport()
    for slug, key in store.stored_contexts():
        report.checked += 1
        try:
            problems = store.verify(slug, key)
            code = "artifact_corrupt"
        except ArtifactMissing:
            problems, code = [f"no {MANIFEST}: not a published context"], "artifact_missing"
        except ArtifactCorrupt as e:
            problems, code = [str(e)], "artifact_corrupt"
        if problems:
            report.damaged.append({"id": key.to_string(), "slug": slug, "code": code, "problems": problems[:20],
                                   "n_problems": len(problems), "marked": False})
            report.keys.append(key)
    return report


def fsck(rt: Runtime, mark: bool = True) -> FsckReport:
    """Verify every stored context, and every `ready` record of the catalog against storage; with
    `mark`, damaged contexts the catalog knows become `failed` (`artifact_corrupt`/`artifact_missing`)."""
    report = verify_store(rt.store)
    stored = {(slug, key.hex) for slug, key in rt.store.stored_contexts()}
    recs, _ = rt.catalog.list(0, 1 << 30, status="ready")
    for rec in recs:
        if (rec.get("slug"), rec["id"]) not in stored:
            report.checked += 1
            report.damaged.append({"id": rec["id"], "slug": rec.get("slug", ""), "code": "artifact_missing",
                                   "problems": ["the catalog lists it as ready; storage has no artifacts"],
                                   "n_problems": 1, "marked": False})
            report.keys.append(PromptHash.from_string(rec["id"]))
    if mark:
        for key, bad in zip(report.keys, report.damaged):
            msg = f"fsck: {bad['n_problems']} problem(s), first: {bad['problems'][0]}"[:2000]
            bad["marked"] = rt.catalog.update(key, status="failed", error_code=bad["code"], error_message=msg)
    for bad in report.damaged:
        log.error("fsck: context %s is damaged (%s): %s", bad["id"], bad["code"], "; ".join(bad["problems"][:3]))
    return report
