"""The layout rules of the tree (docs/architecture.md), checked on the source so that they stay true:

* imports run downwards only: storage < indexer < decoder < training, evaluation < service. A module
  may import its own package, a lower one or a peer of the same rank, never a higher one (lazy
  imports inside functions count: they are dependencies all the same);
* a module over 500 lines says why in its docstring, on a line that starts with `Long because`;
* every method module the registry lists has a docstring, and every registered method comes
  from a listed module (the list is the only place methods are declared).

Packages that do not exist (yet) are skipped, so the rules hold for the tree as it grows.
`PENDING` names the files whose fix is being made on another branch: each is an expected failure
(strict: once it is fixed, its entry must go), so the list can only shrink.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"storage": 0, "indexer": 1, "decoder": 2, "training": 3, "evaluation": 3, "service": 4}
MAX_LINES = 500
LONG_MARKER = "Long because"


# (rule, file) -> who fixes it. Empty once the layout refactor (issue 16) is merged.
PENDING = {
}


def _modules(rule: str) -> list:
    paths = sorted(p for pkg in RANK if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py"))
    params = []
    for p in paths:
        rel = str(p.relative_to(ROOT))
        why = PENDING.get((rule, rel))
        marks = [pytest.mark.xfail(strict=True, reason=f"pending: {why}")] if why else []
        params.append(pytest.param(p, id=rel, marks=marks))
    return params


def _imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports (relative imports resolve to its own package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = path.relative_to(ROOT).parts[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(own if node.level else (node.module or "").split(".")[0])
    return found


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""


def test_the_layered_packages_exist():
    assert all((ROOT / pkg).is_dir() for pkg in ("storage", "indexer", "decoder", "service"))


@pytest.mark.parametrize("path", _modules("imports"))
def test_imports_run_downwards(path: Path):
    own = path.relative_to(ROOT).parts[0]
    upward = sorted(pkg for pkg in _imported_packages(path) if RANK.get(pkg, -1) > RANK[own])
    assert not upward, f"{path.relative_to(ROOT)} ({own}) imports higher layers: {upward}"


@pytest.mark.parametrize("path", _modules("long"))
def test_long_modules_say_why(path: Path):
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = _docstring(path)
    assert any(line.lstrip().startswith(LONG_MARKER) for line in doc.splitlines()), (
        f"{path.relative_to(ROOT)} has {lines} lines: split it by job, or say why it is one module "
        f"in its docstring, on a line starting with {LONG_MARKER!r}")


def test_registry_lists_every_method_with_a_docstring():
    from indexer.registry import METHOD_MODULES, failed_modules, get_method, method_names

    assert not failed_modules()
    assert method_names()
    for module in METHOD_MODULES:
        assert (importlib.import_module(module).__doc__ or "").strip(), f"{module} has no module docstring"
    for name in method_names():
        assert type(get_method(name)).__module__ in METHOD_MODULES, f"method {name!r} is not in the registry's list"
