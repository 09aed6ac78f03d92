"""The kernels' own timestamps (`indexer/kernels/stamps.py`, read by benchmarks/gpu_timeline.py):
the host side everywhere, the stamps themselves on a GPU (CTkvr's plan and the triton attention of one
step: every program of every launch stamped, in launch order on the GPU's clock, and the plan the same
as without a recorder)."""

from __future__ import annotations

import math

import pytest
import torch

stamps = pytest.importorskip("indexer.kernels.stamps", reason="triton is not installed")

from indexer.base import DecodeContext, get_method  # noqa: E402
from tests.test_kernels_ivf import _capture, _reader, _sorted_rows, _spec, _steps  # noqa: E402


def test_stamp_args_only_inside_a_recording():
    assert stamps.stamp_args("select") == {"TS": None, "STAMP": False}
    with pytest.raises(ValueError, match="CUDA"):
        with stamps.recording("cpu"):
            pass
    assert stamps._active is None  # a refused recording leaves none active


def test_stamps_buffers_and_read(monkeypatch):
    rec = stamps.Stamps("cpu", programs=6)
    buf = rec.reserve("rerank")
    assert buf.shape == (6, stamps.SLOTS, stamps.WORDS) and buf.dtype == torch.int64
    assert rec.reserve("rerank") is buf  # one buffer per kernel name: a captured graph keeps writing it
    buf[0, 0, 0], buf[3, 1, 0] = 5, 7  # programs 0 and 3 stamped, 1, 2 and 4, 5 not
    assert rec.read()["rerank"].shape[0] == 4  # up to the last program that stamped
    rec.clear()
    assert rec.read()["rerank"].shape[0] == 0
    monkeypatch.setattr(stamps, "_active", rec)
    args = stamps.stamp_args("select")
    assert args["STAMP"] is True and args["TS"] is rec.reserve("select")


@pytest.mark.gpu
def test_a_stamped_step_times_every_program_in_launch_order():
    from decoder.backends import get_backend
    from indexer.kernels import ivf

    kvh, g, d, n = 4, 4, 128, 4096
    m = get_method("ctkvr")
    p = m.Params(k=256, list_size=512)
    cap = _capture(1, kvh, g, d, n)
    index = _reader(m.build(cap, p))
    ctx = DecodeContext(n, _spec(kvh, g, d), 16)
    plain, stamped = m.open(index, p, ctx), m.open(index, p, ctx)
    q, kv = next(_steps(2, kvh, g, d, n, [1], dtype=cap.k.dtype, ctx=(cap.k[0], cap.v[0])))
    sink, window = p.frame(n)
    backend = get_backend("triton")
    want = plain.plan(0, q, kv)
    out_want = backend.run(q, kv, want, sink, window, d ** -0.5)
    with stamps.recording("cuda") as rec:
        got = stamped.plan(0, q, kv)
        out = backend.run(q, kv, got, sink, window, d ** -0.5)
        torch.cuda.synchronize()
        seen = rec.read()
    assert torch.equal(_sorted_rows(got.positions), _sorted_rows(want.positions))
    torch.testing.assert_close(out, out_want, atol=0, rtol=0)
    cfg = ivf.DEFAULT_CONFIG
    rows = kvh  # one query token
    n_slot = math.ceil(p.probe * p.list_size / (cfg.block_u * cfg.chunks_per_prog))
    expect = {"probe": math.ceil((p.n_centroids_for(n) + p.fifo) / cfg.block_c) * rows, "rerank": (n_slot + 1) * rows,
              "select": 2 * rows}
    for name, count in expect.items():
        assert seen[name].shape[0] == count, name
    order = [k for k in ("probe", "rerank", "select", "split", "merge") if k in seen]
    assert order[:4] == ["probe", "rerank", "select", "split"]
    end_slot = {"select": 7}
    spans = {}
    for name in order:
        b = seen[name]
        start, end = b[:, 0, 0], b[:, end_slot.get(name, 1), 0]
        assert (start > 0).all() and (end >= start).all(), f"{name}: a program without its stamps"
        spans[name] = (int(start.min()), int(end.max()))
    for a, z in zip(order, order[1:]):  # stream order: a kernel's programs start after the one before ended
        assert spans[a][1] <= spans[z][0], (a, z, spans)


def test_timeline_analysis_of_known_stamps():
    """benchmarks/gpu_timeline.py's reading of one replay's stamps: kernel spans from the first start,
    the gaps between kernels, and the select's phases from each program's clock (converted with its
    own timer / clock ratio), split into FIFO-push and plan programs only where the select has both."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_timeline

    def buf(programs):
        return torch.zeros(programs, stamps.SLOTS, stamps.WORDS, dtype=torch.int64)

    probe, select = buf(2), buf(4)
    probe[0, 0, 0], probe[0, 1, 0] = 1_000, 5_000  # ns: starts at t0, ends 4 µs later
    probe[1, 0, 0], probe[1, 1, 0] = 1_500, 6_000
    for i in range(4):  # select programs (row i // 2, w = i % 2): 2 cycles per ns, phases 1 + i µs apart
        start = 7_000 + 100 * i
        for slot in range(8):
            select[i, slot, 0] = start + slot * (1 + i) * 1_000
            select[i, slot, 1] = 10_000 + 2 * slot * (1 + i) * 1_000
            select[i, slot, 2] = i
    got = gpu_timeline.analyse({"probe": probe, "select": select}, push=True)
    k = got["kernels"]
    assert k["probe"]["first_start_us"] == 0 and k["probe"]["last_end_us"] == 5.0 and k["probe"]["programs"] == 2
    assert k["select"]["first_start_us"] == 6.0 and k["select"]["last_start_us"] == 6.3 and k["select"]["sms"] == 4
    assert got["gaps_us"] == {"probe->select": 1.0}
    assert sorted(got["phases"]["push"]["lse"]) == [1.0, 3.0]  # programs 0 and 2
    assert sorted(got["phases"]["plan"]["count"]) == [2.0, 4.0]  # programs 1 and 3
    assert sorted(got["phases"]["plan"]["total"]) == [14.0, 28.0]
    alone = gpu_timeline.analyse({"select": select}, push=False)  # kivf: one plan program per row
    assert alone["phases"]["push"] == {} and len(alone["phases"]["plan"]["lse"]) == 4
