"""The sparse methods the service offers, listed in one place, and lookup by name.

`METHOD_MODULES` names every method module; each defines one `SparseMethod` subclass decorated
with `@register`. Adding a method is adding its module (+ its test) and one line here. Nothing is
found by scanning the package, so a module's name says nothing about whether it is a method: the
helpers beside the methods (`indexer/selection.py`, `indexer/rope.py`, `indexer/kernels/`) are
simply not listed.

The modules are imported on the first lookup, not at import time: `indexer.base` re-exports
`register`, `get_method` and `method_names`, and the method modules import `indexer.base`. A method
module that fails to import is logged and left out (`failed_modules()` says why), so one broken
method cannot take the service down.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry is imported by indexer.base, which defines SparseMethod
    from indexer.base import SparseMethod

METHOD_MODULES: tuple[str, ...] = (
    "indexer.full",
    "indexer.streaming",
    "indexer.topk",
    "indexer.csattn",
    "indexer.ctkvr",
    "indexer.kivf",
    "indexer.lfps",
    "indexer.psa",
    "indexer.saap",
)

_REGISTRY: dict[str, SparseMethod] = {}
_FAILED: dict[str, str] = {}  # module -> import error
_LOADED = False


def register(cls: type[SparseMethod]) -> type[SparseMethod]:
    """Class decorator: offer `cls` under `cls.name` (one instance, shared by every request)."""
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"two sparse methods are named {cls.name!r}")
    _REGISTRY[cls.name] = cls()
    return cls


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    for module in METHOD_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - one broken method module must not take the service down
            _FAILED[module] = f"{type(e).__name__}: {e}"
            logging.getLogger("ctxcache").error("sparse method module %s failed to import: %s", module, e)
    _LOADED = True


def get_method(name: str) -> SparseMethod:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def method_names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def failed_modules() -> dict[str, str]:
    """Listed method modules that failed to import: module -> error."""
    _load()
    return dict(_FAILED)
