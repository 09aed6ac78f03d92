"""Fork/join of CUDA side streams, for the decode runner (`decoder/runner.py`: each request's
attention on its own stream) and its planning ahead (`decoder/plan_ahead.py`)."""

from __future__ import annotations

import torch


def fork_join(streams: list | None, fns: list) -> list:
    """Run fns[i]() with streams[i] as the current stream, each after what the current stream has
    queued so far; the current stream then waits for all of them (inside a CUDA graph capture this
    records parallel branches). streams None: run them in order on the current stream."""
    if streams is None:
        return [fn() for fn in fns]
    main = torch.cuda.current_stream()
    outs = []
    for s, fn in zip(streams, fns, strict=True):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(fn())
    for s in streams:
        main.wait_stream(s)
    return outs
