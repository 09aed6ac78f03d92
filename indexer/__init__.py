"""Sparse-attention methods: one module per method, one interface (`indexer.base`), one list of
the methods offered (`indexer.registry`)."""

from indexer.base import (  # noqa: F401
    DecodeContext,
    IndexReader,
    KVView,
    MethodParams,
    Plan,
    Planner,
    PrefillCapture,
    SparseMethod,
    get_method,
    method_names,
    register,
)
