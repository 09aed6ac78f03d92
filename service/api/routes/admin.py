"""`/v1/admin`: operator tasks over the whole store (verify it, rebuild the catalog from it).

Both run in the API process against the shared data dir and catalog, so they work the same in
embedded and distributed mode, without a restart. They read every manifest (fsck: every chunk file),
so they take time proportional to what is stored; they change nothing stored.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from service.api.deps import RuntimeDep
from service.errors import error_responses
from service.maintenance import fsck, rebuild_catalog

router = APIRouter(prefix="/v1/admin", tags=["admin"])


class DamagedContext(BaseModel):
    id: str
    slug: str
    code: str = Field(description="artifact_corrupt (a chunk or the manifest fails its check) or artifact_missing")
    problems: list[str] = Field(description="the first 20 problems found")
    n_problems: int
    marked: bool = Field(description="the catalog record was set to failed with this code")


class FsckResult(BaseModel):
    checked: int = Field(description="contexts verified (stored ones, plus ready records without artifacts)")
    ok: int
    damaged: list[DamagedContext]


class RebuildResult(BaseModel):
    added: int = Field(description="published contexts the catalog did not know, re-added as ready")
    known: int = Field(description="published contexts the catalog already had")


@router.post("/fsck", response_model=FsckResult, summary="verify every stored context chunk by chunk",
             responses=error_responses())
def run_fsck(rt: RuntimeDep, request: Request, mark: bool = True):
    """Check every chunk file of every stored context against the crc32c its manifest recorded, and
    every `ready` record against storage. With `mark` (default), a damaged context is set to `failed`
    (`artifact_corrupt` / `artifact_missing`): it answers 409 instead of a wrong answer, and
    registering it again rebuilds it. Decode workers of this process drop what they cached of it."""
    report = fsck(rt, mark=mark)
    if mark:
        for key in report.keys:
            for hook in getattr(request.app.state, "on_delete", []):
                hook(key)
    return report.to_dict()


@router.post("/rebuild-catalog", response_model=RebuildResult, summary="re-add what storage holds to the catalog",
             responses=error_responses())
def run_rebuild(rt: RuntimeDep):
    """Re-add every published context the catalog does not know (after Redis lost its data), with the
    display name and expiry its manifest holds (a PATCH writes them there first). Deletes nothing."""
    return rebuild_catalog(rt)
