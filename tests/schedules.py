"""Triton's interpreter with its programs run in another order than the launch grid's.

The interpreter runs a grid's programs one after another, in index order; a GPU runs them in
whatever order its scheduler picks, several at a time. A kernel whose result depends on that order
(which program wins an atomic, which one finishes a ticket last) computes one fixed outcome on CPU CI
and varies on a GPU. `program_order("reverse" | "shuffle")` runs every launch inside it with its
programs in reversed or seeded-shuffled order, so a test can compare outcomes across orders on the
CPU. Programs still run one at a time (no interleaving inside a program), which covers what the
kernels here rely on: atomics and tickets between programs, and waits only for programs that took an
earlier ticket (select.py's compaction), which in a sequential run have finished.

Written against Triton 3.6's `GridExecutor.__call__` (the version pyproject.toml pins): the same
steps, with the loop over the grid permuted.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import random

from triton.runtime import interpreter as _itp


@contextlib.contextmanager
def program_order(order: str, seed: int = 0):
    if order not in ("forward", "reverse", "shuffle"):
        raise ValueError(f"unknown program order {order!r}")
    if order == "forward":
        yield
        return
    rng = random.Random(seed)
    original = _itp.GridExecutor.__call__

    def call(self, *args_dev, **kwargs):
        argspec = inspect.getfullargspec(self.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in argspec.args}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
        for hook in self.pre_run_hooks:
            hook(*args_hst, **kwargs_hst)
        patch_scope = _itp._patch_lang(self.fn)
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            args = {name: arg if name in self.constexprs else _itp._implicit_cvt(arg) for name, arg in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            _itp.interpreter_builder.set_grid_dim(*grid)
            ids = list(itertools.product(*(range(n) for n in grid)))
            if order == "reverse":
                ids.reverse()
            else:
                rng.shuffle(ids)
            for x, y, z in ids:
                _itp.interpreter_builder.set_grid_idx(x, y, z)
                self.fn(**args)
        finally:
            patch_scope.restore()
        self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    _itp.GridExecutor.__call__ = call
    try:
        yield
    finally:
        _itp.GridExecutor.__call__ = original
