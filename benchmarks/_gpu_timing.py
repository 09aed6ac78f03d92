"""Timing helpers shared by the GPU benchmark scripts (gpu_decode.py), and how they name a method's
variant (`method_spec`).

`Timing(device)`: medians of CUDA-event-timed calls on a GPU, of host-clock calls (synchronized)
elsewhere, so a script's `--device cpu` smoke run exercises the same code; and CUDA-graph replays,
reported as (None, reason) when a function cannot be captured (dynamic shapes, host syncs).

Cold L2 (`Timing.cold`, the default): before every timed GPU call a 256 MiB buffer is zeroed
(outside the timed events), so no call finds its inputs in the L2 left by the previous one, as
Triton's `do_bench` does. A decode step of a real model touches each layer's K/V and index once
per token with every other layer's in between; a benchmark replaying one layer back to back would
otherwise serve a sparse method's working set (at 128K, psa's metadata + candidate keys are ~44 MB;
the H100's L2 is 50 MB) from L2 and flatter it, while SDPA over the whole K/V (512 MB) streams from
HBM either way.

Zeroing leaves the L2 full of dirty lines (~50 MB), which the timed call's first misses must write
back to HBM before their lines can be reused (on the H200 that cost a ctkvr step ~3 µs and SDPA 6-7 µs
at 128K, the ratios the same: benchmarks/RESULTS.md, session 30). `Timing.flush = "read"` flushes by reading the buffer
instead (a reduction over it: the L2 is left holding clean lines of it), which is closer to what a
layer's step finds after the layer's projections have read their weights. gpu_decode.py's
`--l2 clean` times every graph that way too (mode `graph_clean_l2`), gpu_timeline.py's `--l2 clean`
its replays.
"""

from __future__ import annotations

import statistics
import time

import torch

# One Llama-3.1-8B layer, the shape every GPU benchmark times: 32 query heads, 8 KV heads (GQA group
# 4), head dim 128, RoPE theta 500000, bf16; the request holds M_LOCAL tokens.
H, KVH, D = 32, 8, 128
G = H // KVH
M_LOCAL = 64
THETA = 500000.0
BF = torch.bfloat16


L2_FLUSH_BYTES = 256 << 20  # > the L2 of every GPU we time on (H100 50 MB, H200 50 MB, B200 126 MB)


class Timing:
    def __init__(self, device: str = "cuda", cold: bool = True, flush: str = "zero"):
        self.device = device  # scripts set it from --device before timing
        self.cold = cold  # flush L2 before every timed GPU call (module docstring)
        self.flush = flush  # "zero": the L2 left dirty; "read": left clean (module docstring)
        self._flush_buf: torch.Tensor | None = None

    def flush_l2(self) -> None:
        if self._flush_buf is None:
            self._flush_buf = torch.zeros(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
        if self.flush == "read":
            self._flush_buf.view(torch.int64).sum()  # every line read, none written
        else:
            self._flush_buf.zero_()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def host_ms(self, fn, reps: int = 10, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def cuda_ms(self, fn, reps: int = 50, warmup: int = 5) -> float:
        if self.device != "cuda":  # a smoke run: fewer repetitions on the host clock
            return self.host_ms(fn, reps=min(reps, 10), warmup=min(warmup, 2))
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.cold:
                self.flush_l2()  # before the start event: its time is not counted
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    def graph_ms(self, fn, reps: int = 50) -> tuple[float | None, str]:
        """Capture fn into a CUDA graph and time its replays; (None, reason) when capture fails."""
        if self.device != "cuda":
            return None, "no CUDA device"
        try:
            return self.cuda_ms(capture_graph(fn).replay, reps=reps), "ok"
        except Exception as e:  # report, do not hide: the table says which path could not be captured
            torch.cuda.synchronize()
            return None, f"{type(e).__name__}: {str(e)[:160]}"


def capture_graph(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after `warmup` calls on the capture's side stream (compiles and
    workspaces happen there, outside the graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def kernel_profile(fn, reps: int = 5, sync=None) -> dict:
    """Device-side view of `fn` run eagerly: kernels per call, summed device time per call in µs
    (the floor of a graph replay of it) and the kernels by cost ([name, calls, µs per call])."""
    from torch.profiler import ProfilerActivity, profile

    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()

    def dev_us(e) -> float:  # the attribute's name changed across torch versions
        return float(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) or 0.0)

    rows = [(e.key, e.count / reps, dev_us(e) / reps) for e in prof.key_averages() if dev_us(e) > 0]
    kernels = [r for r in rows if not r[0].startswith(("Memcpy", "Memset", "cudaGraph"))]
    return {"kernels_per_call": sum(r[1] for r in kernels), "device_us_per_call": sum(r[2] for r in kernels),
            "top": [[name[:80], round(cnt, 2), round(us, 2)] for name, cnt, us in sorted(kernels, key=lambda r: -r[2])]}


def stream_overlap(fn, sync=None) -> dict:
    """How the kernels of one call of `fn` (e.g. a graph replay) overlap across CUDA streams, from a
    profiler trace (CUPTI reports a replayed graph's kernels one by one, with their streams). The
    main stream is the one with the most kernel time. In µs: `span` (first kernel start to last
    end), `main_busy` (union of the main stream's kernels), `main_gaps` (span - main_busy: launch
    gaps and waits for other streams), `side_busy` (union over the other streams), `side_hidden`
    (side time while a main kernel runs), `side_exposed` (side time while none does), and per
    stream its kernel count and summed kernel time. Caveat: a replayed CUDA graph runs on the
    graph's own streams, to which its parallel branches are mapped, not on the streams it was
    captured from; and kernels that share SMs take longer each. Read `span` against the same step
    without side streams; the per-stream split is indicative only. `timeline` lists every kernel in
    start order (where a layer's time goes: the gaps between one kernel's end and the next's start)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    sync = sync or torch.cuda.synchronize
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/trace.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    evs = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not evs:
        return {"error": "no kernel events in the trace"}
    by_stream: dict = {}
    for e in evs:
        start = float(e["ts"])
        by_stream.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append((start, start + float(e["dur"])))
    main = max(by_stream, key=lambda k: sum(b - a for a, b in by_stream[k]))

    def union(iv):
        out = []
        for a, b in sorted(iv):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def length(iv):
        return sum(b - a for a, b in iv)

    def intersect(x, y):
        i = j = 0
        tot = 0.0
        while i < len(x) and j < len(y):
            a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
            tot += max(0.0, b - a)
            if x[i][1] < y[j][1]:
                i += 1
            else:
                j += 1
        return tot

    m = union(by_stream[main])
    side = union([iv for k, v in by_stream.items() if k != main for iv in v])
    start = min(a for v in by_stream.values() for a, _ in v)
    end = max(b for v in by_stream.values() for _, b in v)
    hidden = intersect(m, side)
    return {"span": end - start, "main_busy": length(m), "main_gaps": end - start - length(m),
            "side_busy": length(side), "side_hidden": hidden, "side_exposed": length(side) - hidden,
            "streams": {str(k): [len(v), round(sum(b - a for a, b in v), 1)] for k, v in by_stream.items()},
            "main_stream": str(main),
            # every kernel in start order: [name, start µs from the first kernel's, duration µs, stream]
            "timeline": [[e["name"][:48], round(float(e["ts"]) - start, 2), round(float(e["dur"]), 2),
                          str(e.get("args", {}).get("stream", e.get("tid")))]
                         for e in sorted(evs, key=lambda e: float(e["ts"]))]}


def triton_kernel_regs() -> dict:
    """Registers and spills of every Triton kernel compiled in this process, from the kernel caches
    of the project's kernel modules: {kernel name: [[registers, spilled registers, warps], ...]} (one
    entry per compiled specialisation). What the ahead-of-time check in each kernel module's docstring
    states, measured by the JIT of the machine that ran the benchmark."""
    import sys

    from triton.runtime.jit import JITFunction

    out: dict[str, list] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("indexer.kernels.", "decoder.kernels.")):
            continue
        for obj in vars(mod).values():
            fn = obj if isinstance(obj, JITFunction) else getattr(obj, "fn", None)  # autotuner wrappers: .fn
            if not isinstance(fn, JITFunction):
                continue
            for caches in getattr(fn, "device_caches", {}).values():
                for k in caches[0].values():
                    n_regs = getattr(k, "n_regs", None)
                    if n_regs is None:
                        continue
                    entry = [n_regs, getattr(k, "n_spills", None), getattr(k.metadata, "num_warps", None)]
                    if entry not in out.setdefault(fn.__name__, []):
                        out[fn.__name__].append(entry)
    return out


class RotatingInput:
    """A static input buffer (what a CUDA graph reads) cycled through several values between timed
    calls, so no timing is of one input only. `buf` is the tensor to pass; `next()` loads the next."""

    def __init__(self, values: list[torch.Tensor]):
        self.values = values
        self.buf = values[0].clone()
        self._i = 0

    def next(self) -> None:
        self._i = (self._i + 1) % len(self.values)
        self.buf.copy_(self.values[self._i])


def method_spec(spec: str) -> tuple[str, dict, str]:
    """A benchmark's method argument: "name[@param=value,...][:knob=value,...]" -> (name, param
    overrides, knobs). "psa@max_ratio=0.05" is psa with that `MethodParams` field changed (a second
    operating point of a method in the same run, e.g. psa capped at the budget rho); the knobs after
    ":" are the kernel config's (gpu_decode.py's `plan_knobs`). Values stay strings: the method's
    Params (pydantic) convert them and refuse unknown fields."""
    head, _, knobs = spec.partition(":")
    name, _, params = head.partition("@")
    overrides = {}
    for item in filter(None, params.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{spec!r}: a parameter needs a value (name@param=value)")
        overrides[key] = value
    return name, overrides, knobs
