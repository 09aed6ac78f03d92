"""Reading a context's K/V from pinned host memory inside GPU kernels (zero-copy over PCIe).

The `offload` backend's premise: a decode step reads a few percent of the context, so the context
can stay in host memory and the GPU's kernels can read the chosen rows in place (pinned memory is
mapped into the device's address space), with no host-side gather, no copy stream and no host
sync, so the step stays graph-capturable. This script measures what that costs on the device
against the same reads from HBM, in one run:

* `copy_` of a whole pinned tensor to the GPU (the PCIe bandwidth a bulk copy gets);
* a Triton row gather (rows of KVH x D, scattered and in 32-row blocks) from a mapped host tensor
  and from a GPU tensor;
* the attention kernel (`decoder.kernels.attention.frame_attention`) over a 5% plan with the
  context in host memory and on the GPU, eager and graph-replayed; the outputs must agree;
* `--sections batch` (session 17): the offload_v shape that runs slowest end to end, eight requests
  on eight contexts whose values are in host memory, each attending ctkvr's 1,024 scattered rows per
  KV head plus its frame (sink 4, window 256), graph-replayed one after another as a runner step
  issues them: the attention over mapped values (default launch, and smaller chunks spread over more
  programs), against gathering the same value rows of all eight requests into HBM in one launch
  first, and against the attention with the values in HBM.
* `--sections pages` (session 18): the same B = 8 attention over mapped values, with each request's
  values for `--layers` layers in one host allocation (the footprint of a real batch: 8 x 30 layers
  is 64 GB at 128K), replayed layer after layer and, against that, one layer over and over (a 2 GB
  footprint). Once with torch's pinned allocator (cudaHostAlloc, 4 KiB pages) and once with
  transparent huge pages (an anonymous mapping advised MADV_HUGEPAGE, faulted in, then
  cudaHostRegister'ed): whether the GPU's address translation of scattered host rows, not PCIe,
  bounds offload_v.
* `--sections granule` (session 19): what a scattered read costs by its size. One kernel reads
  21 MB (offload_v's B = 8 layer) from a 16 GB pinned huge-page allocation in granules of 64 B to
  8 KiB at random aligned offsets (sorted, as plans are), against one contiguous 21 MB region
  read the same way and a copy-engine `copy_` of it: whether the PCIe rate of 256-byte value rows
  is set by the bytes or by the number of reads (which decides whether 8-bit values, 128-byte
  rows, would halve the time or not change it). Then rows at ctkvr's density (1 in 128) over spans
  of 32 MB to 16 GB, and the same reads from host memory mapped through CUDA's virtual memory API
  (`cuMemCreate`, HOST_NUMA, 2 MiB granularity; held until the process exits): whether the
  address translation's reach or its page size sets the rate.

    python benchmarks/gpu_host_reads.py [--n 131072] [--sections base batch pages granule] [--layers 30] [--out DIR]

Writes `host_reads.json` (rows: name, ms, bytes, GB/s) to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_timing import BF, D, G, KVH, M_LOCAL, Timing  # noqa: E402

from decoder import host_memory  # noqa: E402
from decoder.backends.offload import mapped  # noqa: E402
from decoder.kernels.attention import KernelConfig, frame_attention  # noqa: E402


@triton.jit
def _gather(src, rows, out, n_rows, N: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    pos = tl.load(rows + h * n_rows + r, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(src + (h * N + pos)[:, None] * D + d[None, :], mask=ok[:, None])
    tl.store(out + (h * n_rows + r)[:, None].to(tl.int64) * D + d[None, :], x, mask=ok[:, None])


def gather(src, rows, out):
    kvh, n, d = src.shape
    _gather[(triton.cdiv(rows.shape[1], 64), kvh)](src, rows, out, rows.shape[1], n, d, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--frac", type=float, default=0.05)
    ap.add_argument("--sections", nargs="+", choices=["base", "batch", "pages", "granule"], default=["base"])
    ap.add_argument("--layers", type=int, default=30, help="pages: layers per request's host allocation")
    ap.add_argument("--numa", action="store_true", help="pages: also huge pages bound to each NUMA node in turn")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    t = Timing("cuda")
    rows_out = []

    def add(name, ms, nbytes, **kw):
        rows_out.append({"name": name, "ms": ms, "bytes": nbytes, "GB_per_s": nbytes / ms / 1e6, **kw})
        print(f"{name:48s} {ms:8.3f} ms  {nbytes / 1e6:8.1f} MB  {nbytes / ms / 1e6:7.1f} GB/s", flush=True)

    n, kvh, d = a.n, KVH, D
    torch.manual_seed(0)
    if "batch" in a.sections:
        batch_section(t, add, n)
    if "granule" in a.sections:
        granule_section(t, add)
    if "pages" in a.sections:
        nodes = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
        print(f"NUMA nodes {nodes}, the GPU's: {host_memory.numa_node_of()}", flush=True)
        for mode, node in [("cudaHostAlloc", None), ("THP", None)] + ([("THP", k) for k in nodes] if a.numa else []):
            pages_section(t, add, n, a.layers, mode, node)
    if "base" not in a.sections:
        return finish(a, n, rows_out)
    host_k = torch.randn(kvh, n, d, dtype=BF).pin_memory()
    host_v = torch.randn(kvh, n, d, dtype=BF).pin_memory()
    dev_k, dev_v = host_k.cuda(), host_v.cuda()
    map_k, map_v = mapped(host_k), mapped(host_v)
    assert map_k.device.type == "cuda" and map_k.data_ptr() == host_k.data_ptr()
    assert torch.equal(map_k.float().sum(-1), dev_k.float().sum(-1)), "mapped view reads other bytes"

    whole = host_k.numel() * 2
    add("copy_ pinned -> GPU, whole K", t.cuda_ms(lambda: dev_k.copy_(host_k, non_blocking=True), reps=10), whole)

    r = int(n * a.frac)
    scattered = torch.sort(torch.randperm(n, device="cuda")[:r].expand(kvh, r).contiguous(), dim=-1).values
    blk = torch.randperm(n // 32, device="cuda")[: r // 32]
    blocks = torch.sort((blk[:, None] * 32 + torch.arange(32, device="cuda")).reshape(-1)).values
    blocks = blocks.expand(kvh, -1).contiguous()
    for label, rows in (("scattered rows", scattered), ("32-row blocks", blocks)):
        rows = rows.to(torch.int32)
        out = torch.empty(kvh, rows.shape[1], d, dtype=BF, device="cuda")
        nbytes = out.numel() * 2
        gather(dev_k, rows, out)
        ref = out.clone()
        gather(map_k, rows, out)
        assert torch.equal(out, ref)
        add(f"gather {label}, HBM", t.cuda_ms(lambda: gather(dev_k, rows, out)), nbytes)
        add(f"gather {label}, host", t.cuda_ms(lambda: gather(map_k, rows, out), reps=20), nbytes)

    for b in (1, 8):
        tq = 1
        q = torch.randn(b, kvh, G, tq, d, dtype=BF, device="cuda")
        loc_k = torch.randn(kvh, M_LOCAL, d, dtype=BF, device="cuda")
        loc_v = torch.randn_like(loc_k)
        q_pos = torch.tensor([n + M_LOCAL - 1], device="cuda")
        for label, rows in (("scattered", scattered), ("blocks", blocks)):
            pos = rows[:, None, :].to(torch.int32)
            nbytes = b * 2 * pos.numel() * d * 2

            def att(ck, cv):
                return [frame_attention(q[i], ck, cv, loc_k, loc_v, q_pos, pos, 4, 256, d ** -0.5) for i in range(b)]

            ref = att(dev_k, dev_v)
            got = att(map_k, map_v)
            assert all(torch.equal(x, y) for x, y in zip(ref, got)), "attention over host K/V differs"
            add(f"attention B={b} {label}, HBM", t.cuda_ms(lambda: att(dev_k, dev_v)), nbytes, batch=b)
            add(f"attention B={b} {label}, host", t.cuda_ms(lambda: att(map_k, map_v), reps=10), nbytes, batch=b)
            gms, why = t.graph_ms(lambda: att(map_k, map_v), reps=10)
            if gms is not None:
                add(f"attention B={b} {label}, host, graph", gms, nbytes, batch=b)
            else:
                print("graph failed:", why)
    finish(a, n, rows_out)


def finish(a, n, rows_out) -> None:
    Path(a.out).mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(), "n": n, "frac": a.frac, "sections": a.sections,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (Path(a.out) / "host_reads.json").write_text(json.dumps({"info": info, "rows": rows_out}, indent=1))


@triton.jit
def _gather_many(srcs, rows, out, n_rows, N: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row block, kv head, request): rows of request b's source (its address in `srcs`)."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = tl.num_programs(1)
    src = tl.load(srcs + b).to(tl.pointer_type(tl.bfloat16))
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    base = (b * kvh + h) * n_rows
    pos = tl.load(rows + base + r, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(src + (h * N + pos)[:, None] * D + d[None, :], mask=ok[:, None])
    tl.store(out + (base + r)[:, None].to(tl.int64) * D + d[None, :], x, mask=ok[:, None])


def _ctkvr_step(n: int, b: int, k: int, sink: int, window: int) -> tuple:
    """One-token queries of b requests, their local rows and position, and ctkvr-shaped plans (k
    sorted random rows per KV head outside the frame, [KVH, 1, k] int32 each), on the GPU."""
    kvh, d = KVH, D
    q = torch.randn(b, kvh, G, 1, d, dtype=BF, device="cuda")
    loc_k = torch.randn(kvh, M_LOCAL, d, dtype=BF, device="cuda")
    loc_v = torch.randn_like(loc_k)
    q_pos = torch.tensor([n + M_LOCAL - 1], device="cuda")
    plans = [torch.sort(torch.stack([torch.randperm(n - window - sink, device="cuda")[:k] + sink
                                     for _ in range(kvh)]), dim=-1).values.to(torch.int32)[:, None, :]
             for _ in range(b)]
    return q, loc_k, loc_v, q_pos, plans


def batch_section(t: Timing, add, n: int, b: int = 8, k: int = 1024, sink: int = 4, window: int = 256) -> None:
    kvh, d = KVH, D
    host_v = [torch.randn(kvh, n, d, dtype=BF).pin_memory() for _ in range(b)]
    map_v = [mapped(h) for h in host_v]
    dev_v = [h.cuda() for h in host_v]
    dev_k = [torch.randn(kvh, n, d, dtype=BF, device="cuda") for _ in range(b)]
    q, loc_k, loc_v, q_pos, plans = _ctkvr_step(n, b, k, sink, window)
    frame = torch.cat([torch.arange(sink), torch.arange(n - window + 1, n)]).cuda()
    rows = torch.stack([torch.cat([frame.expand(kvh, -1), p[:, 0].long()], dim=1) for p in plans]).to(torch.int32)
    n_rows = rows.shape[-1]
    nbytes = rows.numel() * d * 2  # the value rows read from host memory per layer
    staged = torch.empty(b, kvh, n_rows, d, dtype=BF, device="cuda")
    srcs = torch.tensor([v.data_ptr() for v in map_v], dtype=torch.int64, device="cuda")

    def att(vs, cfg=None):
        return [frame_attention(q[i], dev_k[i], vs[i], loc_k, loc_v, q_pos, plans[i], sink, window, d ** -0.5,
                                cfg=cfg or KernelConfig()) for i in range(b)]

    def gather_all():
        _gather_many[(triton.cdiv(n_rows, 16), kvh, b)](srcs, rows, staged, n_rows, n, d, 16)

    ref = att(dev_v)
    assert all(torch.equal(x, y) for x, y in zip(ref, att(map_v))), "attention over host values differs"
    gather_all()
    want = torch.stack([v.gather(1, r.long()[..., None].expand(-1, -1, d)) for v, r in zip(dev_v, rows)])
    assert torch.equal(staged, want), "the batched gather read other rows"
    variants = [("attention, values in HBM", lambda: att(dev_v)),
                ("attention, values mapped (default launch)", lambda: att(map_v)),
                ("attention, values mapped, chunks of 32, 8 programs per SM",
                 lambda: att(map_v, KernelConfig(block_n=32, programs_per_sm=8))),
                ("attention, values mapped, chunks of 16, 16 programs per SM",
                 lambda: att(map_v, KernelConfig(block_n=16, programs_per_sm=16))),
                ("gather of every request's value rows, one launch", gather_all),
                ("gather, then attention with values in HBM", lambda: (gather_all(), att(dev_v)))]
    for label, fn in variants:
        gms, why = t.graph_ms(fn, reps=20)
        if gms is None:
            print(f"{label}: graph failed: {why}")
            continue
        add(f"B={b} ctkvr-shaped, {label}", gms, nbytes, batch=b, rows_per_head=n_rows)


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _thp_pinned(nbytes: int, node: int | None) -> tuple[torch.Tensor, object]:
    """decoder.host_memory's huge-page mapping (bound to `node` when given), registered with CUDA;
    (uint8 tensor, its mapping: it unregisters itself when the last tensor over it goes)."""
    t, m = host_memory.huge_mapping(nbytes, node)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1 | 2)  # portable | mapped
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    m.registered, m.nbytes = t.data_ptr(), nbytes
    return t, m


def pages_section(t: Timing, add, n: int, n_layers: int, mode: str, node: int | None = None, b: int = 8,
                  k: int = 1024, sink: int = 4, window: int = 256) -> None:
    kvh, d = KVH, D
    per_layer = kvh * n * d * 2
    thp = {"enabled": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
           "defrag": Path("/sys/kernel/mm/transparent_hugepage/defrag").read_text().strip()}
    huge0 = _meminfo("AnonHugePages")
    t0 = time.perf_counter()
    keep = []
    host_v = []
    for _ in range(b):
        if mode == "THP":
            buf, m = _thp_pinned(n_layers * per_layer, node)
            keep.append(m)
        else:
            buf = torch.empty(n_layers * per_layer, dtype=torch.uint8, pin_memory=True)
        host_v.append(buf.view(BF).view(n_layers, kvh, n, d))
    alloc_s = time.perf_counter() - t0
    huge = _meminfo("AnonHugePages") - huge0
    mode = mode if node is None else f"{mode} on node {node}"
    print(f"pages {mode}: {b} x {n_layers} layers, {b * n_layers * per_layer / 1e9:.1f} GB in {alloc_s:.1f} s, "
          f"huge pages {huge / 1e9:.1f} GB, thp {thp}", flush=True)
    src = torch.randn(kvh, n, d, dtype=BF, device="cuda")
    for hv in host_v:
        for layer in range(n_layers):
            hv[layer].copy_(src.roll(layer, dims=1))
    torch.cuda.synchronize()
    map_v = [mapped(hv) for hv in host_v]
    dev_k = torch.randn(kvh, n, d, dtype=BF, device="cuda")
    q, loc_k, loc_v, q_pos, plans = _ctkvr_step(n, b, k, sink, window)
    nbytes = b * kvh * (k + sink + window - 1) * d * 2

    def att(layer):
        return [frame_attention(q[i], dev_k, map_v[i][layer], loc_k, loc_v, q_pos, plans[i], sink, window, d ** -0.5)
                for i in range(b)]

    for layer in (0, n_layers - 1):
        want = [frame_attention(q[i], dev_k, src.roll(layer, dims=1), loc_k, loc_v, q_pos, plans[i], sink, window,
                                d ** -0.5) for i in range(b)]
        assert all(torch.equal(x, y) for x, y in zip(want, att(layer))), f"{mode}: layer {layer} reads other bytes"
    graphs = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        att(0)
    torch.cuda.current_stream().wait_stream(s)
    for layer in range(n_layers):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            att(layer)
        graphs.append(g)
    torch.cuda.synchronize()

    def timed(order, reps=3):
        times = []
        for _ in range(reps):
            for layer in order:
                t.flush_l2()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graphs[layer].replay()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1))
        return statistics.median(times)

    timed(range(n_layers), reps=1)  # warm: every layer's pages touched once
    info = {"batch": b, "layers": n_layers, "pages": mode, "footprint_GB": b * n_layers * per_layer / 1e9,
            "huge_GB": huge / 1e9, "alloc_s": alloc_s, **{f"thp_{k_}": v for k_, v in thp.items()}}
    add(f"B={b} pages {mode}, one layer again and again", timed([0] * n_layers), nbytes, **info)
    add(f"B={b} pages {mode}, layer after layer ({n_layers})", timed(range(n_layers)), nbytes, **info)
    del graphs, map_v, host_v, buf
    torch.cuda.synchronize()
    del keep
    gc.collect()  # the THP mappings go with their last tensor
    torch._C._host_emptyCache()  # torch's pinned blocks go back too


@triton.jit
def _granules(src, offs, out, n, W: tl.constexpr, R: tl.constexpr):
    """out[i] = src[offs[i] : offs[i] + W] (int64 words) for the R granules of this program."""
    i = tl.program_id(0) * R + tl.arange(0, R)
    ok = i < n
    o = tl.load(offs + i, mask=ok, other=0)
    w = tl.arange(0, W)
    x = tl.load(src + o[:, None] + w[None, :], mask=ok[:, None])
    tl.store(out + i[:, None].to(tl.int64) * W + w[None, :], x, mask=ok[:, None])


class _CudaArray:
    """A device pointer torch can wrap (__cuda_array_interface__), kept alive with its owner."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes // 8,), "typestr": "<i8", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _vmm_host(nbytes: int, node: int = 0) -> tuple[torch.Tensor | None, str]:
    """Pinned host memory from CUDA's virtual memory API (cuMemCreate with a HOST_NUMA location,
    mapped at the allocation granularity the driver recommends): an int64 CUDA tensor over it, or
    None and why. The experiment: whether the GPU maps it with larger pages than
    cudaHostRegister'ed memory, so scattered reads miss its address translation less often."""
    import ctypes

    cu = ctypes.CDLL("libcuda.so.1")

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("location", Loc),
                    ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]

    class Access(ctypes.Structure):
        _fields_ = [("location", Loc), ("flags", ctypes.c_int)]

    prop = Prop(1, 0, Loc(3, node), None)  # PINNED, no handle, HOST_NUMA node
    gran = ctypes.c_size_t()
    for kind in (1, 0):  # recommended, then minimum
        rc = cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), kind)
        if rc == 0:
            break
    if rc != 0:
        return None, f"cuMemGetAllocationGranularity {rc}"
    size = -(-nbytes // gran.value) * gran.value
    handle, ptr = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    steps = [("cuMemCreate", lambda: cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                                    ctypes.c_ulonglong(0))),
             ("cuMemAddressReserve", lambda: cu.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size),
                                                                    ctypes.c_size_t(gran.value), ctypes.c_ulonglong(0),
                                                                    ctypes.c_ulonglong(0))),
             ("cuMemMap", lambda: cu.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                                              ctypes.c_ulonglong(0))),
             ("cuMemSetAccess", lambda: cu.cuMemSetAccess(ptr, ctypes.c_size_t(size),
                                                          ctypes.byref(Access(Loc(1, torch.cuda.current_device()), 3)),
                                                          ctypes.c_size_t(1)))]
    for name, call in steps:
        rc = call()
        if rc != 0:
            return None, f"{name} {rc} (granularity {gran.value})"
    host_rc = cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(Access(Loc(3, node), 3)), ctypes.c_size_t(1))
    t = torch.as_tensor(_CudaArray(ptr.value, size, (cu, handle)), device="cuda")
    return t, f"granularity {gran.value}, host access rc {host_rc}"


def _granule_reads(t: Timing, add, src: torch.Tensor, label: str, size: int, n: int, spread: int, g, **info) -> None:
    """n granules of `size` bytes at sorted random aligned offsets within the first `spread` bytes of
    src (int64 words, word i holding i), one kernel."""
    w = size // 8
    offs = torch.sort(torch.randperm(spread // size, generator=g)[:n]).values.cuda() * w
    out = torch.empty(n, w, dtype=torch.int64, device="cuda")
    r = max(1, 2048 // w)

    def launch():
        _granules[(triton.cdiv(n, r),)](src, offs, out, n, w, r)

    launch()
    assert torch.equal(out, offs[:, None] + torch.arange(w, device="cuda")), f"{label}: read other words"
    ms = t.cuda_ms(launch, reps=20)
    add(f"granule: {label}", ms, n * size, granule=size, granules=n, spread=spread, reads_per_us=n / ms / 1e3,
        **info)


def granule_section(t: Timing, add, total: int = 21 * 2 ** 20, footprint: int = 16 * 2 ** 30) -> None:
    buf, m = _thp_pinned(footprint, None)
    words = buf.view(torch.int64)
    for i in range(0, words.numel(), 2 ** 27):  # word i holds i: a read checks its own offsets
        torch.arange(i, min(i + 2 ** 27, words.numel()), out=words[i:i + 2 ** 27])
    src = mapped(words)
    region = words[:total // 8]
    dev = torch.empty_like(region, device="cuda")
    add("granule: copy_ of a contiguous 21 MB region (copy engine)",
        t.cuda_ms(lambda: dev.copy_(region, non_blocking=True), reps=20), total, granule=total, footprint=footprint)
    g = torch.Generator().manual_seed(0)
    for size in (64, 128, 256, 512, 1024, 2048, 8192):
        _granule_reads(t, add, src, f"{size}-byte granules scattered over 16 GB", size, total // size, footprint, g,
                       footprint=footprint)
    _granule_reads(t, add, src, "contiguous 21 MB, 256-byte granules", 256, total // 256, total, g,
                   footprint=footprint)
    # ctkvr's density (one 256-byte row in 128) over growing spans: the address translation's reach
    for spread in (2 ** 25, 2 ** 28, 2 ** 31, 2 ** 34):
        for size in (128, 256):
            _granule_reads(t, add, src, f"{size}-byte granules, 1 in {128 * 256 // size}, over {spread >> 20} MB",
                           size, spread // (128 * 256), spread, g, footprint=footprint)
    del src, region, words, buf
    torch.cuda.synchronize()
    del m
    gc.collect()
    # the same reads from host memory mapped through CUDA's virtual memory API
    vm, why = _vmm_host(footprint)
    print(f"cuMemCreate host memory: {why}", flush=True)
    if vm is None:
        add(f"granule: cuMemCreate host memory failed: {why}", float("nan"), 0)
        return
    for i in range(0, vm.numel(), 2 ** 27):
        vm[i:i + 2 ** 27].copy_(torch.arange(i, min(i + 2 ** 27, vm.numel()), dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    for size in (128, 256, 2048):
        _granule_reads(t, add, vm, f"{size}-byte granules scattered over 16 GB, cuMemCreate host", size,
                       total // size, footprint, g, footprint=footprint, vmm=why)
    for spread in (2 ** 28, 2 ** 31, 2 ** 34):
        _granule_reads(t, add, vm, f"256-byte granules, 1 in 128, over {spread >> 20} MB, cuMemCreate host", 256,
                       spread // (128 * 256), spread, g, footprint=footprint, vmm=why)

if __name__ == "__main__":
    main()
