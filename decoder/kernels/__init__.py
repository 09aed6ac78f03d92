"""Triton kernels for the decode step (the `triton` attention backend, `decoder/backends/triton.py`).

* `attention`: split-K attention over frame ∪ plan (sink range, window range, the plan's gathered
  context rows, the request-local rows, an optional pseudo-token), flash-decoding style: partial
  softmax states per split, merged by a second kernel. Design, byte/flop counts and what to measure
  on a GPU: `NOTES.md` next to this file.

Importing this package imports triton (ImportError when it is not installed: the backend is then
not offered). On a machine without CUDA the tests run the kernels through Triton's interpreter
(`TRITON_INTERPRET=1`, set by tests/conftest.py) on CPU tensors.
"""
