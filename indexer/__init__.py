"""Sparse-attention methods: one module per method, one interface (`indexer.base`)."""

from indexer.base import (  # noqa: F401
    IndexReader,
    KVView,
    MethodParams,
    MethodSession,
    PrefillCapture,
    SparseMethod,
    get_method,
    method_names,
    register,
)
