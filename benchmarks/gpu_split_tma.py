"""A probe for the split kernel's next lever (issue 12): attention over psa's budget plan as a block list with each
plan block's K and V rows loaded whole by TMA (host `TensorDescriptor`s over [KVH·N, D], which Triton pipelines with
mbarriers into its stage buffers), against `frame_attention`'s gathers of the same rows (`cp.async` per 16 bytes,
one K/V buffer at two stages: decoder/kernels/NOTES.md). A kernel of its own here, not the backend's: one query
token, one plan block of BS tokens per chunk, the frame (sink, the window's context part, the visible request-local
slots) gathered by the first split, the splits' states merged by `decoder/kernels/attention.py`'s merge kernel.

It checks the probe against `frame_attention` over the same block list (relative L2 error of the outputs) and times
both graph-replayed with a cold L2 (`_gpu_timing.Timing`; `frame_attention` before and after the probe's rows), over
rows per chunk (whole 128-token blocks or halves), pipeline stages, warps and programs per SM, at one Llama-3.1-8B
layer's shape (bf16) and ρ 5% of the blocks (`--lengths`, default 128K and 512K). Rows that fail to compile or launch
are reported with the reason, not dropped.

Why it may pay where `cp.async` did not (compiled for sm_90 without a GPU, Triton 3.6, session 40; the split kernel
keeps one K/V buffer at 2 stages and 74 KB, two buffers at 3 stages and 139.5 KB): the TMA loop is multi-buffered by
its stage count with nothing to gather per row. Whole blocks: 2 stages 74 KB (one buffer each for K and V), 3 stages
139.5 KB (two); half blocks ([64, D] boxes): 3 stages 72 KB (two buffers, two programs per SM), 4 stages 105 KB
(three). 8 warps: 1,504-1,600 static instructions and 96-107 registers; 4 warps: 2,392-2,520 and 160-213 (the
frame's chunk included); no spills.

Measured (session 41, H200, 2026-11-30; benchmarks/RESULTS.md "session 41", raw
`results/gpu_split_tma_rejected_session41.json`): it does not pay. 128K: `frame_attention` 20.2-20.3 µs, the probe
22.9-25.8 over all 16 variants (best: half blocks, 3 stages, one program per SM); 512K: 44.3-44.4 against 46.2-52.0.
Same outputs (bf16 relative error 1.8-2.5e-3 against `frame_attention`, rounding). So the backend keeps its gathers;
the probe stays to re-ask the question of a later Triton or GPU.

    python benchmarks/gpu_split_tma.py                      # on the device tool; JSON to $OUT/gpu_split_tma.json
    TRITON_INTERPRET=1 python benchmarks/gpu_split_tma.py --device cpu   # the kernel's logic on small fp32 shapes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._gpu_timing import BF, D, G, KVH, M_LOCAL, Timing  # noqa: E402
from decoder.kernels.attention import (LOG2E, MERGE_BLOCK_S, NEG_BIG, _merge_kernel, _sm_count,  # noqa: E402
                                      frame_attention)
from indexer.kernels import interpreted  # noqa: E402
from indexer.kernels.pdl import pdl_begin, pdl_launch  # noqa: E402

T = Timing()


@triton.jit
def _update(q, k, v, ok, q_ok, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    """The online softmax over one chunk (the split kernel's arithmetic: base 2, P rounded to the values' dtype)."""
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(q_ok[:, None] & ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None]).to(v.dtype)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)
    if DOT_FP32:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p, v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["n_ctx", "s_end", "window", "n_loc", "n_ids"])
def _tma_split_kernel(
    Q, KDESC, VDESC, CK, CV, LK, LV, QPOS, IDS, PACC, PML,
    sq_h, sq_g, sck_h, sck_n, slk_h, slk_n, si_h,
    n_ctx, s_end, window, n_loc, n_ids, qk_scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BS: tl.constexpr, CH: tl.constexpr, FRAME: tl.constexpr,
    NUM_STAGES: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    split = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n_splits = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    q_ok = offs_m < G
    q = tl.load(Q + h * sq_h + (offs_m % G)[:, None] * sq_g + offs_d[None, :], mask=q_ok[:, None], other=0.0)
    qpos = tl.load(QPOS).to(tl.int64)
    w_lo = tl.minimum(tl.maximum(qpos - window + 1, s_end), n_ctx)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if split == 0:  # the frame: sink rows, the window's context rows [w_lo, N), the visible local slots
        r = tl.arange(0, FRAME)
        n_win = n_ctx - w_lo
        in_sink = r < s_end
        in_win = (r >= s_end) & (r < s_end + n_win)
        j = r - s_end - n_win
        in_loc = (j >= 0) & (j < n_loc) & (n_ctx + j <= qpos)
        ok = in_sink | in_win | in_loc
        ctx_row = tl.where(in_sink | in_win, tl.where(in_sink, r, w_lo + (r - s_end)), 0).to(tl.int64)
        loc_row = tl.where(in_loc, j, 0).to(tl.int64)
        k = tl.load(tl.where(in_loc, LK + h * slk_h + loc_row * slk_n, CK + h * sck_h + ctx_row * sck_n)[:, None]
                    + offs_d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(tl.where(in_loc, LV + h * slk_h + loc_row * slk_n, CV + h * sck_h + ctx_row * sck_n)[:, None]
                    + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_i, l_i, acc = _update(q, k, v, ok, q_ok, m_i, l_i, acc, qk_scale, DOT_FP32)
    SUB: tl.constexpr = BS // CH  # chunks per plan block
    n_ch = n_ids * SUB
    cps = (n_ch + n_splits - 1) // n_splits
    c_lo = split * cps
    c_hi = tl.minimum(c_lo + cps, n_ch)
    for c in tl.range(c_lo, c_hi, num_stages=NUM_STAGES):  # CH rows of one plan block per chunk, loaded whole
        bid = tl.load(IDS + h * si_h + c // SUB)
        first = tl.maximum(bid, 0) * BS + (c % SUB) * CH
        row0 = (h * n_ctx + first).to(tl.int32)
        k = KDESC.load([row0, 0])
        v = VDESC.load([row0, 0])
        pos = first + tl.arange(0, CH)
        ok = (bid >= 0) & (pos >= s_end) & (pos < w_lo)  # -1 ids, and the frame's rows (attended above)
        m_i, l_i, acc = _update(q, k, v, ok, q_ok, m_i, l_i, acc, qk_scale, DOT_FP32)
    part = h * n_splits + split  # the split kernel's workspace layout with one query block
    tl.store(PACC + part * (BLOCK_M * D) + offs_m[:, None] * D + offs_d[None, :], acc)
    tl.store(PML + part * (2 * BLOCK_M) + offs_m, m_i)
    tl.store(PML + part * (2 * BLOCK_M) + BLOCK_M + offs_m, l_i)


def tma_attention(q, ctx_k, ctx_v, loc_k, loc_v, q_pos, ids, sink, window, scale, *, bs, ch, splits, stages, warps):
    """The probe: q [KVH, G, 1, D] over the frame and the block list ids [KVH, 1, n_ids] of bs-token blocks, ch
    rows per chunk (a TMA box of [ch, D])."""
    kvh, g, _, d = q.shape
    n = ctx_k.shape[1]
    assert ctx_v.stride() == ctx_k.stride() and loc_v.stride() == loc_k.stride()  # the kernel takes K's
    n_loc = loc_k.shape[1]
    s_end = min(sink, n)
    frame = triton.next_power_of_2(max(16, s_end + max(window - 1, 0) + n_loc))
    block_m = max(16, triton.next_power_of_2(g))
    kd = TensorDescriptor(ctx_k.view(kvh * n, d), shape=[kvh * n, d], strides=[d, 1], block_shape=[ch, d])
    vd = TensorDescriptor(ctx_v.view(kvh * n, d), shape=[kvh * n, d], strides=[d, 1], block_shape=[ch, d])
    ws = torch.empty(kvh * splits * block_m * (d + 2), dtype=torch.float32, device=q.device)
    pacc, pml = ws[: kvh * splits * block_m * d], ws[kvh * splits * block_m * d:]
    out = torch.empty_like(q)
    pdl = pdl_launch(q.device)
    _tma_split_kernel[(splits, kvh)](
        q, kd, vd, ctx_k, ctx_v, loc_k, loc_v, q_pos, ids, pacc, pml,
        q.stride(0), q.stride(1), ctx_k.stride(0), ctx_k.stride(1), loc_k.stride(0), loc_k.stride(1), ids.stride(0),
        n, s_end, window, n_loc, ids.shape[-1], float(scale) * LOG2E,
        G=g, D=d, BLOCK_M=block_m, BS=bs, CH=ch, FRAME=frame, NUM_STAGES=1 if interpreted() else stages,
        DOT_FP32=interpreted(), PDL=bool(pdl), **pdl, num_warps=warps)
    _merge_kernel[(1, g, kvh)](
        pacc, pml, q_pos, q_pos, out, 0, 0, 0, 0, out.stride(0), out.stride(1), out.stride(2), splits, 1,
        G=g, TB=block_m // g, D=d, BLOCK_M=block_m, BLOCK_S=MERGE_BLOCK_S, HAS_REST=False, PDL=bool(pdl), **pdl,
        num_warps=4)
    return out


def ref_row(rows: list, n: int, ref_fn, reps: int) -> None:
    g_ms, why = T.graph_ms(ref_fn, reps=reps)
    rows.append({"n": n, "variant": "frame_attention (block ids)", "graph_ms": g_ms, "graph": why})
    print(f"n={n} frame_attention over block ids: graph {g_ms if g_ms is None else round(g_ms * 1e3, 1)} us",
          flush=True)


def block_list(gen, kvh, n, bs, ratio, dev):
    """psa's budget row shape: the F = 2 dense-part ids (block 0, the last block) then ceil(ratio · blocks) distinct
    blocks in block order."""
    nb = -(-n // bs)
    k = math.ceil(ratio * nb)
    rows = [torch.cat([torch.tensor([0, nb - 1]), torch.randperm(nb - 2, generator=gen)[:k].sort().values + 1])
            for _ in range(kvh)]
    ids = torch.stack(rows).to(torch.int32).view(kvh, 1, k + 2).to(dev)
    return ids, torch.full((kvh, 1), (k + 2) * bs, dtype=torch.int32, device=dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    dev = torch.device(a.device)
    T.device = dev.type
    cpu = dev.type != "cuda"
    kvh, g, d, bs, m_loc = (2, 4, 32, 16, 8) if cpu else (KVH, G, D, 128, M_LOCAL)
    dtype = torch.float32 if cpu else BF
    lengths = [400, 1000] if cpu else a.lengths
    sink, window, scale = 4, 32 if not cpu else 8, d ** -0.5
    sms = _sm_count(dev)
    # (rows per chunk, programs per SM, stages, warps): whole blocks, two or three buffers in one program per SM
    # (128 / 192 KB); half blocks, up to four buffers in two programs per SM
    variants = [(bs, pps, stages, warps) for pps in (1, 2) for stages in (2, 3) for warps in (4, 8)]
    variants += [(bs // 2, pps, stages, warps) for pps in (1, 2) for stages in (3, 4) for warps in (4, 8)]
    rows = []
    for n in lengths:
        gen = torch.Generator().manual_seed(n)
        r = lambda *s: torch.randn(*s, generator=gen).to(dtype).to(dev)  # noqa: E731
        ctx_k, ctx_v, loc_k, loc_v, q = r(kvh, n, d), r(kvh, n, d), r(kvh, m_loc, d), r(kvh, m_loc, d), r(kvh, g, 1, d)
        q_pos = torch.tensor([n + m_loc - 1], device=dev)
        ids, lens = block_list(gen, kvh, n, bs, a.ratio, dev)
        args = (q, ctx_k, ctx_v, loc_k, loc_v, q_pos, ids, sink, window, scale)
        ref_fn = lambda: frame_attention(*args, lengths=lens, block_size=bs)  # noqa: E731
        ref = ref_fn().float()
        ref_row(rows, n, ref_fn, a.reps)
        for ch, pps, stages, warps in [v for v in variants if v[2] == 3 and v[3] == 4] if cpu else variants:
            splits = max(1, min(pps * sms // kvh, ids.shape[-1] * (bs // ch)))
            fn = lambda c=ch, s=splits, st=stages, w=warps: tma_attention(*args, bs=bs, ch=c, splits=s,  # noqa: E731
                                                                           stages=st, warps=w)
            row = {"n": n, "variant": "tma", "rows_per_chunk": ch, "programs_per_sm": pps, "splits": splits,
                   "num_stages": stages, "num_warps": warps}
            try:
                out = fn().float()
            except Exception as e:  # shared memory: reported as the row's outcome
                row.update(graph_ms=None, graph=f"{type(e).__name__}: {str(e)[:160]}")
                rows.append(row)
                print(f"  tma rows {ch} pps {pps} stages {stages} warps {warps}: {row['graph']}", flush=True)
                continue
            err = float((out - ref).norm() / ref.norm())
            g_ms, why = T.graph_ms(fn, reps=a.reps)
            row.update(graph_ms=g_ms, graph=why, rel_err_vs_frame_attention=err)
            rows.append(row)
            print(f"  tma rows {ch} pps {pps} splits {splits} stages {stages} warps {warps}: graph "
                  f"{g_ms if g_ms is None else round(g_ms * 1e3, 1)} us, err {err:.1e}", flush=True)
            if cpu:
                assert err < 1e-5, err
        ref_row(rows, n, ref_fn, a.reps)  # again: the drift over the probe's rows
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "triton": triton.__version__, "device": torch.cuda.get_device_name() if not cpu else "cpu",
            "ratio": a.ratio, "block_size": bs}
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_split_tma.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
