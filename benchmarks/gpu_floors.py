"""Memory floors of ctkvr's two memory-bound kernels, against the kernels themselves, in one run.

At 128K on the H200 (session 31's timeline) ctkvr's probe reads its 17.3 MB of centroids in 10.8 µs
(~1.6 TB/s, a third of the HBM's peak) and each of the attention's split programs takes 6.7 µs for
one 128-row chunk (128 positions, then 128 gathered K and V rows). Whether either can be shorter
depends on what the memory system gives a kernel of that shape at all. This script times, from the
kernels' own timestamps (`indexer/kernels/stamps.py`: first program start to last program end, a
CUDA graph of one launch replayed after the benchmarks' cold-L2 flush, medians):

* `stream`: the probe's bytes with no work: grid (blocks, rows), each program one [BLOCK_C, 4, 128]
  bf16 load and a sum (BLOCK_C 32 is the probe's own shape, 64 one wave);
* `stream_loop`: P programs each looping over blocks with Triton's software pipeline (`num_stages`):
  loads of the next blocks in flight while one is summed;
* `torch_amax`: torch's reduction over the same tensor (no stamps: its graph replay, for scale);
* `gather`: the split kernel's bytes with no attention: grid (9, 8), each program 128 positions
  from a plan (a round trip to L2 the gather's addresses wait for; `computed`: no such load), then
  128 K and 128 V rows, the positions in random or ascending order over the whole context, within
  a 2 MB-per-head window, or contiguous;
* `probe picks= dedup= fifo=`: ctkvr's probe kernel launched directly with parts of its work
  switched off by its constexprs (no picks, no zeroing of the dedup map, no FIFO table);
* `probe` and `split`: the real kernels (ctkvr's probe in its plan, the split kernel on a
  1,024-position plan via `frame_attention`);
* `empty_chain`: five empty kernels in one graph: the gap between dependent launches.

What it found (H200, 2026-11-30, benchmarks/RESULTS.md session 32): `stream` 6.9 µs against the probe's
9.7-11.0 (its variants); the probe's span without its FIFO table 8.4 µs. `gather` is NOT a floor: Triton compiled its loads
as a chain (37 registers, each row's loads followed by their reduction before the next loads issue), so
its 6.4-8.2 µs per program measure that chain; the split kernel itself took 5.6 µs per program on the same
plan. A gather floor needs every load in flight at once (e.g. the split kernel's cp.async path).

    python benchmarks/gpu_floors.py            # on the device tool; JSON to $OUT/gpu_floors.json
    TRITON_INTERPRET=1 python benchmarks/gpu_floors.py --device cpu   # the kernels' logic, small shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._gpu_timing import BF, D, G, KVH, M_LOCAL, Timing, capture_graph  # noqa: E402
from indexer.kernels.stamps import recording, stamp, stamp_args  # noqa: E402

T = Timing()
C_ROWS = 2048 + 64  # ctkvr's centroids + FIFO ring per KV head at 128K (indexer/kernels/ivf.py's cost table)


@triton.jit
def _stream_kernel(X, OUT, n_blocks, BLOCK_C: tl.constexpr, D: tl.constexpr, G: tl.constexpr, TS=None,
                   STAMP: tl.constexpr = False):
    s = tl.program_id(0)
    r = tl.program_id(1)
    prog = r * tl.num_programs(0) + s
    stamp(TS, prog, 0, STAMP)
    e = s * BLOCK_C + tl.arange(0, BLOCK_C)
    ptr = X + (r.to(tl.int64) * n_blocks * BLOCK_C + e[:, None, None]) * (G * D) \
        + tl.arange(0, G)[None, :, None] * D + tl.arange(0, D)[None, None, :]
    x = tl.load(ptr).to(tl.float32)
    tl.store(OUT + prog, tl.sum(tl.sum(tl.sum(x, 2), 1), 0))
    stamp(TS, prog, 1, STAMP)


@triton.jit
def _stream_loop_kernel(X, OUT, total_blocks, BLOCK_C: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                        STAGES: tl.constexpr, TS=None, STAMP: tl.constexpr = False):
    p = tl.program_id(0)
    stamp(TS, p, 0, STAMP)
    acc = tl.zeros([BLOCK_C, G, D], tl.float32)
    for b in tl.range(p, total_blocks, tl.num_programs(0), num_stages=STAGES):
        e = (b * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
        ptr = X + e[:, None, None] * (G * D) + tl.arange(0, G)[None, :, None] * D + tl.arange(0, D)[None, None, :]
        acc += tl.load(ptr).to(tl.float32)
    tl.store(OUT + p, tl.sum(tl.sum(tl.sum(acc, 2), 1), 0))
    stamp(TS, p, 1, STAMP)


@triton.jit
def _gather_kernel(POS, CK, CV, OUT, n_ctx, width, KNOWN: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   TS=None, STAMP: tl.constexpr = False):
    c = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    prog = h * tl.num_programs(0) + c
    stamp(TS, prog, 0, STAMP)
    j = c * BLOCK_N + tl.arange(0, BLOCK_N)
    if KNOWN:  # the same kind of scattered rows, addresses computed in the program
        pos = ((j.to(tl.int64) * 104729 + h * 7919) % n_ctx)
    else:
        pos = tl.load(POS + h * width + j).to(tl.int64)
    row = h * n_ctx + pos
    k = tl.load(CK + row[:, None] * D + tl.arange(0, D)[None, :]).to(tl.float32)
    v = tl.load(CV + row[:, None] * D + tl.arange(0, D)[None, :]).to(tl.float32)
    tl.store(OUT + prog, tl.sum(tl.sum(k, 1) + tl.sum(v, 1), 0))
    stamp(TS, prog, 1, STAMP)


@triton.jit
def _empty_kernel(OUT, TS=None, STAMP: tl.constexpr = False):
    stamp(TS, tl.program_id(0), 0, STAMP)
    tl.store(OUT + tl.program_id(0), 1.0)
    stamp(TS, tl.program_id(0), 1, STAMP)


def spans(rec, reps: int, replay) -> dict:
    """Median over cold replays of each stamped kernel's span (first start -> last end) and program time,
    and of the gaps between consecutive kernels, µs."""
    per = []
    for _ in range(reps):
        rec.clear()
        T.flush_l2()
        replay()
        torch.cuda.synchronize()
        got = {}
        for name, b in rec.read().items():
            ran = (b[:, 0, 0] > 0) & (b[:, 1, 0] > 0)
            st, en = b[ran, 0, 0].double(), b[ran, 1, 0].double()
            got[name] = (float(st.min()), float(en.max()), float(((en - st) / 1e3).median()), int(ran.sum()))
        per.append(got)
    out = {}
    names = sorted(per[0], key=lambda k: per[0][k][0])
    for name in names:
        out[name] = {"span_us": statistics.median((p[name][1] - p[name][0]) / 1e3 for p in per),
                     "prog_us": statistics.median(p[name][2] for p in per), "programs": per[0][name][3]}
    for a, z in zip(names, names[1:]):
        out[f"gap {a}->{z}"] = statistics.median((p[z][0] - p[a][1]) / 1e3 for p in per)
    return out


def timed(name: str, fn, reps: int, dev) -> dict:
    fn()
    if dev.type != "cuda":  # the interpreter: the logic ran, nothing to time
        return {"case": name, "ran": True}
    with recording(dev) as rec:
        g = capture_graph(fn)
        row = {"case": name, **spans(rec, reps, g.replay)}
    print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "case"}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    dev = torch.device(a.device)
    T.device = dev.type
    small = dev.type != "cuda"
    n = 4096 if small else a.n
    c_rows = 128 if small else C_ROWS
    gen = torch.Generator(device=dev).manual_seed(0)
    cent = torch.randn(KVH, c_rows, G, D, device=dev, generator=gen).to(BF)
    out = torch.empty(1 << 16, device=dev)
    rows = []

    want = cent.float().sum().item()

    def check(name: str, got: float, ref: float) -> None:  # the floors read the bytes they claim to
        if abs(got - ref) > 1e-3 * (abs(ref) + 1e3):
            raise SystemExit(f"{name}: sum {got} != {ref}")

    for bc in (32, 64):
        nb = c_rows // bc
        rows.append(timed(f"stream block_c={bc}", lambda bc=bc, nb=nb: _stream_kernel[(nb, KVH)](
            cent, out, nb, BLOCK_C=bc, D=D, G=G, **stamp_args("stream"), num_warps=4), a.reps, dev))
        check(rows[-1]["case"], out[: nb * KVH].sum().item(), want)
    total = KVH * c_rows
    for p, bc, st in ((132, 16, 3), (132, 32, 2), (264, 16, 2), (264, 16, 3)):
        rows.append(timed(f"stream_loop programs={p} block_c={bc} stages={st}", lambda p=p, bc=bc, st=st: (
            _stream_loop_kernel[(p,)](cent, out, total // bc, BLOCK_C=bc, D=D, G=G, STAGES=st,
                                      **stamp_args("stream_loop"), num_warps=4)), a.reps, dev))
        check(rows[-1]["case"], out[:p].sum().item(), want)
    if not small:
        ms, _ = T.graph_ms(lambda: cent.amax(), reps=a.reps)
        rows.append({"case": "torch_amax (graph replay, not stamped)", "graph_us": ms * 1e3})
        print(rows[-1], flush=True)

    ck = torch.randn(KVH, n, D, device=dev, generator=gen).to(BF)
    cv = torch.randn(KVH, n, D, device=dev, generator=gen).to(BF)
    width = 9 * 128
    pos = torch.stack([torch.randperm(n, device=dev, generator=gen)[:width] for _ in range(KVH)]).int()
    # the same number of rows, scattered over the whole context (in random or in ascending order), within
    # one 2 MB-per-head window, or one contiguous run (what SDPA over a slice reads)
    win = min(n, 8192)
    orders = {"random": pos, "sorted": pos.sort(dim=1).values,
              "window": torch.stack([torch.randperm(win, device=dev, generator=gen)[:width] for _ in range(KVH)]).int(),
              "contiguous": torch.arange(width, device=dev, dtype=torch.int32).expand(KVH, width).contiguous()}
    for order, p_ in orders.items():
        rows.append(timed(f"gather {order}", lambda p_=p_: _gather_kernel[(9, KVH)](
            p_, ck, cv, out, n, width, KNOWN=False, BLOCK_N=128, D=D, **stamp_args("gather"), num_warps=4),
            a.reps, dev))
        rows_ = (torch.arange(KVH, device=dev)[:, None] * n + p_.long()).flatten()
        ref = ck.view(-1, D)[rows_].float().sum().item() + cv.view(-1, D)[rows_].float().sum().item()
        check(rows[-1]["case"], out[: 9 * KVH].sum().item(), ref)
    rows.append(timed("gather computed (no positions load)", lambda: _gather_kernel[(9, KVH)](
        pos, ck, cv, out, n, width, KNOWN=True, BLOCK_N=128, D=D, **stamp_args("gather"), num_warps=4), a.reps, dev))

    def chain():
        for i in range(5):
            _empty_kernel[(8,)](out, **stamp_args(f"empty{i}"), num_warps=4)
    rows.append(timed("empty_chain", chain, a.reps, dev))

    # ctkvr's probe kernel itself, its parts switched off by its constexprs (the picks: P = 0; the dedup map's
    # zeroing; the FIFO table's pointer select), on unit-norm centroids
    from indexer.kernels.ivf import _ctkvr_probe_kernel
    cn = torch.nn.functional.normalize(cent.float(), dim=-1).to(BF)
    cp, fifo = cn[:, : c_rows - 64].contiguous(), cn[:, c_rows - 64:].contiguous()
    qp = torch.randn(KVH, G, 1, D, device=dev, generator=gen).to(BF)
    pushes = torch.full((1,), 10, dtype=torch.int64, device=dev)
    nb = c_rows // 32
    topv = torch.empty(KVH * nb * 4, device=dev)
    topi = torch.empty(KVH * nb * 4, dtype=torch.int32, device=dev)
    pq = torch.empty(KVH, G, D, dtype=BF, device=dev)
    nw = n * 4 // 32
    bitmap = torch.empty(KVH, nw, dtype=torch.int32, device=dev)
    variants = [(4, True, True, False, False), (0, True, True, False, False), (4, False, True, False, False),
                (4, True, False, False, False), (0, False, False, False, False),
                (4, True, True, True, True), (4, True, True, True, False), (4, True, False, False, True)]
    for picks, dedup, has_fifo, blocks, first in variants:  # blocks, first: FIFO_BLOCKS, LOADS_FIRST (session 32)
        rows.append(timed(f"probe picks={picks} dedup={int(dedup)} fifo={int(has_fifo)} fifo_blocks={int(blocks)} "
                          f"loads_first={int(first)}",
                          lambda picks=picks, dedup=dedup, has_fifo=has_fifo, blocks=blocks, first=first:
                          _ctkvr_probe_kernel[(nb, KVH)](
            qp, cp, fifo, pushes, topv, topi, pq, bitmap, *qp.stride()[:3], *cp.stride()[:3], *fifo.stride()[:3],
            *pq.stride()[:2], 1, c_rows - 64, 64 if has_fifo else 0, nb, nw, -(-nw // nb),
            G=G, G_PAD=G, D=D, BLOCK_C=32, P=picks, P_PAD=4, HAS_FIFO=has_fifo, DEDUP=dedup, BLOCK_Z=256,
            ONE_LOAD=True, FIFO_BLOCKS=blocks, LOADS_FIRST=first, **stamp_args("probe"), num_warps=4), a.reps, dev))

    if not small:  # the real kernels: ctkvr's probe and the split kernel on a 1,024-position plan
        from decoder.kernels.attention import frame_attention
        lk = torch.randn(KVH, M_LOCAL, D, device=dev, generator=gen).to(BF)
        lv = torch.randn(KVH, M_LOCAL, D, device=dev, generator=gen).to(BF)
        q = torch.randn(KVH, G, 1, D, device=dev, generator=gen).to(BF)
        q_pos = torch.tensor([n + M_LOCAL - 1], device=dev)
        plan = pos[:, None, :1024].contiguous()
        rows.append(timed("split+merge (ctkvr-shaped plan: 1,024 positions, sink 4, window 64)",
                          lambda: frame_attention(q, ck, cv, lk, lv, q_pos, plan, 4, 64, D ** -0.5), a.reps, dev))
        sys.argv = [sys.argv[0]]
        import benchmarks.gpu_timeline as tlm
        row = tlm.run(a.n, "ctkvr", a.reps)
        rows.append({"case": "ctkvr step (gpu_timeline.run)", "kernels": row["kernels"], "gaps_us": row["gaps_us"],
                     "graph_ms_plain": row["graph_ms_plain"]})
        print({k: {kk: round(vv, 2) for kk, vv in v.items() if kk in ("first_start_us", "last_end_us", "prog_us_median")}
               for k, v in row["kernels"].items()}, flush=True)

    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton.__version__, "device": torch.cuda.get_device_name() if not small else "cpu", "n": n,
            "centroid_bytes": cent.numel() * 2}
    o = Path(a.out)
    o.mkdir(parents=True, exist_ok=True)
    (o / "gpu_floors.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
