"""Static SASS of Triton kernels for the H100/H200 (sm_90), compiled ahead of time on a machine
without a GPU: instruction counts, the most frequent opcodes and the layout conversions Triton
inserted; for `step`, also each kernel's registers per thread, spilled bytes and shared memory. A proxy for a latency-bound kernel's cost that needs no device minutes: in session 23 the
attention split kernel's measured time followed its static count (1,712 instructions: 8.2 µs at
128K; 3,304: 11.4 µs), and a dense step's chunk went 3,568 -> 1,416 instructions and 176 -> 140 µs.

    python benchmarks/aot_sass.py split                         # the split kernel, a psa-shaped decode step
    python benchmarks/aot_sass.py split --set HAS_PLAN=0 HAS_LEN=0 ONE_TOKEN=1 BLOCK_N=64 --warps 8  # frame only
    python benchmarks/aot_sass.py psa_select --set BLOCK=1024   # psa's select at 32K (nb = 1024)
    python benchmarks/aot_sass.py split --out /tmp/split         # also writes split.sass and split.ttgir
    python benchmarks/aot_sass.py step --methods psa ctkvr --n 131072 --json out.json
    python benchmarks/aot_sass.py step --methods ctkvr ctkvr:rerank_maxnreg=128   # a kernel knob, as in gpu_decode.py
    python benchmarks/aot_sass.py step --methods ctkvr --out /tmp/sass/s  # also /tmp/sass/s_ctkvr_<kernel>.sass, .ttgir
    python benchmarks/aot_sass.py step --methods ctkvr --n 16384 --only _attend_kernel  # one kernel of the step
    python benchmarks/aot_sass.py step --methods psa --n 131072 --only _split_kernel --backend triton:maxnreg=128

`split` / `psa_select` compile one kernel at the 8B layer's decode shape (G 4, D 128, bf16, one
token) with constexprs overridden by --set. `step` records every Triton launch of one fused decode
step (plan + attention, T = 1) of each method on the CPU without running it (`JITFunction.run` is
replaced: the launch sequence depends on shapes only), with the GPU's choices where a launch makes
others for CPU tensors (the SM count, the pipelined chunk loop, psa's fp16 criticality, lfps'
precise exp, ctkvr's register cap), and compiles each as the JIT would specialise it. Checked
against Nsight Compute on the H200 (session 23): psa's six kernels at 128K have the same static
instruction counts as on the device. Needs only Triton (its bundled ptxas and nvdisasm).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import decoder.kernels.attention as attention  # noqa: E402
import indexer.kernels.psa as psa  # noqa: E402

# kernel -> (function, pointer types, constexprs, ints the JIT specialises as 1, ints divisible by 16, warps, stages)
KERNELS = {
    "split": (
        attention._split_kernel,
        {**{n: "*bf16" for n in ("Q", "CK", "CV", "LK", "LV", "OUT")}, "QPOS": "*i64", "POS": "*i32", "PLEN": "*i32",
         **{n: "*fp32" for n in ("PACC", "PML")}, **{n: "*i64" for n in ("BYP", "RL", "RV", "C_VALS", "C_POS", "C_SLOT",
                                                                           "C_COUNTS")}},
        dict(G=4, TB=4, D=128, BLOCK_M=16, BLOCK_N=128, HAS_PLAN=True, HAS_LEN=True, HAS_BYPASS=False, HAS_REST=False,
             DIRECT=False, ONE_TOKEN=False, BLOCK_IDS=0, DOT_PRECISION="tf32", DOT_FP32=False, NUM_STAGES=2,
             PDL=True, CACHE=0, CACHE_STAGED=False),
        ("sp_k",),
        ("sq_h", "sq_g", "sck_h", "sck_n", "scv_h", "scv_n", "slk_h", "slk_n", "slv_h", "slv_n", "sp_h", "sp_t", "so_h",
         "so_g"),
        4, 2,
    ),
    "psa_select": (
        psa._select_kernel,
        {"X": "*fp32", "PS": "*fp32", "QPOS": "*i64", **{n: "*i32" for n in ("SCR", "CAND", "CKEY", "NCAND")}},
        dict(G=4, G_PAD=4, BLOCK_P=64, BLOCK_C=1024, BLOCK=4096, IN_REGS=True, PRECISE=True, PDL=True),
        (), (), 8, 3,
    ),
}


def cuobjdump(k, flag: str) -> str:
    """cuobjdump's output (`flag`: -sass, -res-usage) on the compiled kernel's cubin."""
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(k.asm["cubin"])
        return subprocess.check_output([knobs.nvidia.cuobjdump.path, flag, path]).decode()
    finally:
        os.remove(path)


def resources(k) -> dict:
    """Registers per thread, spill bytes and static shared memory of the compiled kernel (cuobjdump's
    resource usage of its cubin, what ptxas reports)."""
    out = cuobjdump(k, "-res-usage")
    got = {key: int(m.group(1)) for key, pat in (("registers", r"REG:(\d+)"), ("spill_bytes", r"LOCAL:(\d+)"))
           if (m := re.search(pat, out))}
    return got | {"shared_bytes": k.metadata.shared}


def sass_lines(k) -> list[str]:
    """The compiled kernel's instructions, from cuobjdump on its cubin (Triton's own `asm["sass"]` text
    stops near 4,100 lines, which would cap a larger kernel's count), the NOPs that pad the end
    included, as Nsight Compute's source view lists them."""
    out = cuobjdump(k, "-sass")
    lines = [m.group(1).strip() for m in re.finditer(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(.*?);", out, re.M)]
    return lines


def compile_variant(kernel: str, overrides: dict, num_warps: int | None = None) -> dict:
    fn, ptrs, const, ones, div16, warps, stages = KERNELS[kernel]
    warps = num_warps or warps
    const = {"TS": None, "STAMP": False, **const, **overrides}  # no timeline stamps (indexer/kernels/stamps.py)
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ones:
            sig[name] = "constexpr"
            const[name] = 1
        elif name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": const.get("NUM_STAGES", stages)})
    lines = sass_lines(k)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ln).split(" ")[0] for ln in lines)
    return {"instructions": len(lines), "layout_conversions": k.asm["ttgir"].count("ttg.convert_layout"),
            "ops": ops, "sass": "\n".join(lines), "ttgir": k.asm["ttgir"]}


TL_PTR = {torch.float64: "*fp64", torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
          torch.int64: "*i64",
          torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1"}


def compile_launch(fn, args: tuple, kwargs: dict) -> dict:
    """One recorded launch `fn[grid](*args, **kwargs)` compiled for sm_90 with the JIT's
    specialisation (ints equal to 1 become constexprs, ints and pointers divisible by 16 are
    declared so, except the `do_not_specialize` ints); PDL on, as on a Hopper GPU."""
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg") if k in kwargs}
    opts.pop("launch_pdl", None)
    values = dict(zip(fn.arg_names, args)) | kwargs
    # the choices a launch makes differently for CPU tensors, as a GPU's launch makes them
    if fn.__name__ == "_crit_kernel" and "CDT" in values:  # psa: the metadata's dtype (fp32 on the CPU)
        values["CDT"] = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(values["META"].dtype, tl.float32)
    if "PRECISE" in values and fn.__module__.endswith("lfps"):  # lfps: precise exp / log on a GPU
        values["PRECISE"] = True
    sig, const, attrs = {}, {}, {}
    for i, prm in enumerate(fn.params):
        v = values.get(prm.name, prm.default if prm.has_default else None)
        if prm.is_constexpr:
            sig[prm.name] = "constexpr"
            const[prm.name] = True if prm.name == "PDL" else v
        elif isinstance(v, torch.Tensor):
            sig[prm.name] = TL_PTR[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[prm.name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not prm.do_not_specialize:
                sig[prm.name] = "constexpr"
                const[prm.name] = 1
            else:
                sig[prm.name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0 and not prm.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[prm.name] = "fp32"
        else:
            sig[prm.name] = "constexpr"
            const[prm.name] = v
    options = {"num_warps": opts.get("num_warps", 4), "num_stages": opts.get("num_stages", 3)}
    if "maxnreg" in opts:
        options["maxnreg"] = opts["maxnreg"]
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=options)
    lines = sass_lines(k)
    return {"kernel": fn.__name__, "instructions": len(lines), "num_warps": opts.get("num_warps", 4),
            "layout_conversions": k.asm["ttgir"].count("ttg.convert_layout"), **resources(k),
            "sass": "\n".join(lines), "ttgir": k.asm["ttgir"]}


def step_launches(method: str, n: int, backend_spec: str = "triton") -> list[tuple]:
    """The Triton launches of one fused decode step (plan + attention, T = 1) of `method` at the 8B
    layer's shape over n tokens, recorded on the CPU without running them (`JITFunction.run` is
    replaced: the launch sequence depends on shapes only, never on device values)."""
    from triton.runtime.jit import JITFunction

    import benchmarks.gpu_decode as gd
    from benchmarks._gpu_timing import method_spec
    from indexer.base import PrefillCapture

    gd.DEV = "cpu"
    name, overrides, knobs = method_spec(method)
    backend = gd.backend_for(backend_spec)
    split_maxnreg = getattr(getattr(backend, "cfg", None), "maxnreg", None)
    sp1, sp2 = gd.spec(1), gd.spec(2)
    mix = gd.Mixture(sp2, "cpu", seed=0)
    q_all, k_all, v_all = gd.make_inputs(n, mix, seed=n)
    ctx_k, ctx_v = k_all[:, :n].contiguous(), v_all[:, :n].contiguous()
    loc_k, loc_v = k_all[:, n:].contiguous(), v_all[:, n:].contiguous()
    q_step = q_all[:, -1].reshape(gd.KVH, gd.G, 1, gd.D).contiguous()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        saap_dir = Path(tmp) / "saap-model"
        if name == "saap":
            gd.write_saap_model(saap_dir, sp2, mix, layers=[1], clusters=1024, hidden=1024, sample=16384)
        m, params = gd.method_params(name, saap_dir, 0.1, overrides)
        layers = 2 if name == "saap" else 1
        sp = sp2 if name == "saap" else sp1
        arrays = None
        if m.has_index:
            per_layer = lambda x: x[None].expand(layers, -1, -1, -1)  # noqa: E731
            cap = PrefillCapture(q=per_layer(q_all[:, :n]), k=per_layer(ctx_k), v=per_layer(ctx_v),
                                 positions=torch.arange(n), spec=sp)
            arrays = m.build(cap, params)
        req = gd.Request(ctx_k, ctx_v, loc_k, loc_v, q_step, arrays, m, params, layers - 1, sp, backend)
        for attr in ("fused", "use_kernels"):
            if hasattr(req.planner, attr):
                setattr(req.planner, attr, True)
        recorded = []
        real_run = JITFunction.run
        # the fused paths run here as on a GPU: no "needs CUDA tensors" refusal, a GPU's SM count
        import importlib

        patched = []
        for modname in ("psa", "ivf", "csattn", "lfps", "saap", "select"):
            mod = importlib.import_module(f"indexer.kernels.{modname}")
            if hasattr(mod, "unsupported"):
                orig = mod.unsupported
                mod.unsupported = (lambda orig: lambda *a, **k: [r for r in orig(*a, **k) if "CUDA" not in r])(orig)
                patched.append((mod, "unsupported", orig))
            for fn_name in ("_sm_count",):
                if hasattr(mod, fn_name):
                    patched.append((mod, fn_name, getattr(mod, fn_name)))
                    setattr(mod, fn_name, lambda device: 132)
        patched.append((attention, "_sm_count", attention._sm_count))
        attention._sm_count = lambda device: 132
        plan = attention.launch_plan  # the pipelined chunk loop of a GPU launch (one stage on the CPU)
        patched.append((attention, "launch_plan", plan))
        attention.launch_plan = lambda *a, interpreted_run=False, **k: plan(*a, interpreted_run=False, **k)
        select = importlib.import_module("indexer.kernels.select")
        patched.append((select, "kernel_enabled", select.kernel_enabled))
        select.kernel_enabled = lambda score: True

        ivf = importlib.import_module("indexer.kernels.ivf")

        def record(self, *args, grid, warmup, **kwargs):
            kwargs = dict(kwargs)
            if self.__name__ == "_rerank_kernel" and ivf.DEFAULT_CONFIG.rerank_maxnreg:
                kwargs["maxnreg"] = ivf.DEFAULT_CONFIG.rerank_maxnreg  # a launch option on CUDA tensors only
            if self.__name__ == "_split_kernel" and split_maxnreg:
                kwargs["maxnreg"] = split_maxnreg  # "--backend triton:maxnreg=128", likewise
            recorded.append((self, args, kwargs))

        JITFunction.run = record
        restore = gd.plan_knobs(name, knobs)  # "ctkvr:rerank_maxnreg=128": the kernel config's knobs
        try:
            req.step()
        finally:
            restore()
            JITFunction.run = real_run
            for mod, attr, orig in patched:
                setattr(mod, attr, orig)
    return recorded


def parse_value(v: str):
    if v in ("0", "1"):
        return bool(int(v))
    try:
        return int(v)
    except ValueError:
        return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=sorted(KERNELS) + ["step"])
    ap.add_argument("--methods", nargs="*",
                    default=["psa@max_ratio=0.05", "ctkvr", "saap", "csattn", "lfps", "kivf", "streaming", "full"],
                    help="step: the methods whose decode step is compiled")
    ap.add_argument("--n", type=int, default=32768, help="step: context tokens")
    ap.add_argument("--json", type=Path, default=None, help="step: the rows as JSON")
    ap.add_argument("--set", nargs="*", default=[], help="constexpr overrides NAME=VALUE (0/1 for flags)")
    ap.add_argument("--warps", type=int, default=None, help="num_warps (default: the launch's at this shape)")
    ap.add_argument("--out", type=Path, default=None, help="a path prefix for the .sass and .ttgir files (step: one pair per kernel)")
    ap.add_argument("--backend", default="triton", help="step: the attention backend, with knobs as in gpu_decode.py "
                    "(triton:maxnreg=128)")
    ap.add_argument("--only", nargs="*", default=None, help="step: compile only these kernels (by function name)")
    a = ap.parse_args()
    if a.kernel == "step":
        import json

        rows = []
        for method in a.methods:
            for fn, args, kwargs in step_launches(method, a.n, a.backend):
                if a.only is not None and fn.__name__ not in a.only:
                    continue
                row = {"method": method, "n": a.n, **compile_launch(fn, args, kwargs)}
                sass, ttgir = row.pop("sass"), row.pop("ttgir")
                if a.out:
                    stem = f"{a.out}_{method.replace(':', '_').replace('@', '_')}_{row['kernel']}"
                    Path(stem).parent.mkdir(parents=True, exist_ok=True)
                    Path(stem + ".sass").write_text(sass)
                    Path(stem + ".ttgir").write_text(ttgir)
                rows.append(row)
                print(f"{method:22s} {row['kernel']:28s} {row['num_warps']} warps: {row['instructions']:5d} static "
                      f"instructions, {row['layout_conversions']:2d} layout conversions, {row.get('registers')} "
                      f"registers, {row.get('spill_bytes')} spill bytes, {row['shared_bytes']} B shared", flush=True)
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
        return
    overrides = {k: parse_value(v) for k, _, v in (s.partition("=") for s in a.set)}
    r = compile_variant(a.kernel, overrides, a.warps)
    print(f"{a.kernel} {overrides or ''}: {r['instructions']} static instructions, "
          f"{r['layout_conversions']} layout conversions; {r['ops'].most_common(12)}")
    if a.out:
        a.out.with_suffix(".sass").write_text(r["sass"])
        a.out.with_suffix(".ttgir").write_text(r["ttgir"])


if __name__ == "__main__":
    main()
