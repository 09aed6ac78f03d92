"""indexer/_select.py's shared pieces that carry state: `RequestBuckets` (kivf and saap sessions)."""

from __future__ import annotations

import torch

from indexer._select import RequestBuckets


def test_request_buckets_follow_select_then_append_and_bucket_each_key_once():
    """The decode frame calls select (which buckets this step's keys) and then append (the same
    keys): each offset is bucketed exactly once, in order; a layer that only sees appends (no select)
    is bucketed by append; capacity doubles (a 1,000-token request reallocates ~7 times, not 1,000)."""
    b = RequestBuckets()
    calls: list[tuple[int, int]] = []

    def bucket(layer, start, t):
        calls.append((start, t))
        b.add(layer, start, torch.arange(start, start + t).expand(2, t) % 7)

    # question chunk of 5 tokens, then 1-token steps: select sees m = 5, 6, 7, ...; append t = 5, 1, 1, ...
    reallocs, last = 0, None
    for m, t in [(5, 5)] + [(5 + i, 1) for i in range(1, 1000)]:
        todo = b.todo(0, m)
        if todo:
            bucket(0, todo.start, len(todo))
        assert not b.appended(0, t)  # select did it
        cur = b._ids[0]
        reallocs += cur is not last
        last = cur
    assert calls == [(0, 5)] + [(4 + i, 1) for i in range(1, 1000)]
    assert b.count(0) == 1004 and torch.equal(b.view(0)[0], torch.arange(1004) % 7)
    assert reallocs <= 8
    # append only (a layer select left to dense attention, or keys select never saw)
    for t in (3, 1, 1):
        todo = b.appended(1, t)
        assert len(todo) == t
        bucket(1, todo.start, len(todo))
    assert b.count(1) == 5 and torch.equal(b.view(1, 5)[1], torch.arange(5) % 7)
    assert set(b.as_dict()) == {0, 1} and b.as_dict()[1].shape == (2, 5)
