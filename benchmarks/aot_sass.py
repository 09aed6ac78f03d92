"""Static SASS of a Triton kernel variant for the H100/H200 (sm_90), compiled ahead of time on a
machine without a GPU: the instruction count, the most frequent opcodes and the layout conversions
Triton inserted. A proxy for a latency-bound kernel's cost that needs no device minutes: in session
23 the attention split kernel's measured time followed its static count (1712 instructions: 8.2 us
at 128K, 3304: 11.4 us), so a change that adds instructions can be rejected before a device run.

    python benchmarks/aot_sass.py split                         # the split kernel, a psa-shaped decode step
    python benchmarks/aot_sass.py split --set HAS_PLAN=0 HAS_LEN=0 ONE_TOKEN=1 BLOCK_N=64 --warps 8  # frame only
    python benchmarks/aot_sass.py psa_select --set BLOCK=1024   # psa's select at 32K (nb = 1024)
    python benchmarks/aot_sass.py split --out /tmp/split         # also writes split.sass and split.ttgir

Kernels are compiled at the 8B layer's decode shape (G 4, D 128, bf16, one token); pointers are
declared 16-byte aligned and the strides the JIT would find divisible by 16 are declared so, as the
JIT specialises them on the device. Needs only Triton (its bundled ptxas and nvdisasm).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import triton
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
             DIRECT=False, ONE_TOKEN=False, DOT_PRECISION="tf32", DOT_FP32=False, NUM_STAGES=2, PDL=True, CACHE=0,
             CACHE_STAGED=False),
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


def compile_variant(kernel: str, overrides: dict, num_warps: int | None = None) -> dict:
    fn, ptrs, const, ones, div16, warps, stages = KERNELS[kernel]
    warps = num_warps or warps
    const = {**const, **overrides}
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
    lines = [ln.split("\t", 1)[1] for ln in k.asm["sass"].splitlines() if "\t" in ln]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ln).split(" ")[0].rstrip(";") for ln in lines)
    return {"instructions": len(lines), "layout_conversions": k.asm["ttgir"].count("ttg.convert_layout"),
            "ops": ops, "sass": k.asm["sass"], "ttgir": k.asm["ttgir"]}


def parse_value(v: str):
    if v in ("0", "1"):
        return bool(int(v))
    try:
        return int(v)
    except ValueError:
        return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", choices=sorted(KERNELS))
    ap.add_argument("--set", nargs="*", default=[], help="constexpr overrides NAME=VALUE (0/1 for flags)")
    ap.add_argument("--warps", type=int, default=None, help="num_warps (default: the launch's at this shape)")
    ap.add_argument("--out", type=Path, default=None, help="a path prefix for the .sass and .ttgir files")
    a = ap.parse_args()
    overrides = {k: parse_value(v) for k, _, v in (s.partition("=") for s in a.set)}
    r = compile_variant(a.kernel, overrides, a.warps)
    print(f"{a.kernel} {overrides or ''}: {r['instructions']} static instructions, "
          f"{r['layout_conversions']} layout conversions; {r['ops'].most_common(12)}")
    if a.out:
        a.out.with_suffix(".sass").write_text(r["sass"])
        a.out.with_suffix(".ttgir").write_text(r["ttgir"])


if __name__ == "__main__":
    main()
