"""Measuring sparse methods against exact attention and against each other (`ctxcache eval`).
Above `decoder/` and `indexer/` (it runs their code), below `service/`.

  fidelity.py   attention-level and model-level metrics on captured tensors (tests, benchmarks, eval)
  config.py     EvalConfig: model, methods and parameter grids, what to measure; the runs it expands to
  contexts.py   publishing and opening stored contexts the way the service's workers do
  harness.py    the evaluation: fidelity, attention replay and tasks over every run; run_eval
  tasks.py      RULER-style task samples and their scoring
  report.py     results.json, results.md and the PNG plots
"""
