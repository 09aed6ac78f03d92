"""FastAPI dependencies: the runtime (settings, catalog, queues, store, tokenizer) of this process,
and a context id parsed from the request path."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.errors import ApiError
from service.runtime import Runtime
from storage.keys import PromptHash


def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def context_id(cid: str) -> PromptHash:
    """A context id as a request gives it (the `{cid}` path parameter, a body field) -> the typed
    key, parsed once here; 404 `not_found` when it is not one."""
    try:
        return PromptHash.from_string(cid)
    except ValueError:
        raise ApiError(404, "not_found", f"no context {cid!r} (ids are 64 hex digits)") from None


ContextId = Annotated[PromptHash, Depends(context_id)]  # a route's `{cid}` path parameter, typed
