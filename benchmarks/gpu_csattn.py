"""GPU timing of `csattn` decode (search + attention) vs torch SDPA full attention, one layer of the
Llama-3.1-8B shape (32 query heads, 8 kv heads, d=128, bf16, random tensors: the timing does not
depend on the values), plus CPU/GPU equivalence checks. Imports torch and the project's
indexer/decoder modules only (pydantic for the params).

    PYTHONUNBUFFERED=1 python benchmarks/gpu_csattn.py [--lengths 32768 131072]

Per context length N (with 64 request-local tokens, 63 of them appended to the index):
* build: `build_layer` on the GPU (k-means over 32768 sampled queries per kv head, scoring of all N keys).
* decode step, one token: All-GPU `select` + the frame (`merge_selection` + `sparse_attention`),
  eager and replayed from a CUDA graph; the select and attention parts alone; SDPA over all N + 64
  keys measured in the same run (eager and graph). Ratios are full / csattn (> 1: csattn faster).
* schedules 0.15-step-4 / 0.20-step-8: eager cost per step averaged over P steps.
* CPU<->GPU (offload): host tables and host K/V, host search, selected rows shipped; host clock.
* checks: the sparse output equals SDPA with a mask built from the same selection; the GPU
  selection equals the CPU selection from the same tables (overlap, 16 random queries).
Timings: median of CUDA-event-timed repetitions after warm-up, rotating between 4 query sets.
Results: a table on stdout and $OUT/gpu_csattn.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_timing import RotatingInput, Timing  # noqa: E402
from decoder.attention import merge_selection, sparse_attention  # noqa: E402
from indexer.base import IndexReader, KVView, get_method  # noqa: E402
from indexer.csattn import CSAttnParams, build_layer  # noqa: E402

H, KVH, D = 32, 8, 128
G = H // KVH
M_LOCAL = 64
BF = torch.bfloat16
DEV = "cuda"  # --device cpu: a smoke run of this script's logic on a machine without a GPU
T = Timing(DEV)  # its device follows --device (set in main)
PROFILE = False  # --profile: print the kernels a decode step spends its time in


def run(n: int, alpha: float) -> dict:
    dev = DEV
    torch.manual_seed(n)
    p = CSAttnParams(alpha=alpha, sink=4, window=32)  # decode defaults: rho 0.05, step 1
    q_pre = torch.randn(H, n, D, device=dev, dtype=BF)
    k = torch.randn(KVH, n, D, device=dev, dtype=BF)
    v = torch.randn(KVH, n, D, device=dev, dtype=BF)
    build_layer(q_pre[:, :4096], k[:, :4096], p, torch.Generator().manual_seed(0))  # warm-up
    T.sync()
    t0 = time.perf_counter()
    tables = build_layer(q_pre, k, p, torch.Generator().manual_seed(0))
    T.sync()
    build_s = time.perf_counter() - t0
    del q_pre
    arrays = {name: t[None] for name, t in zip(("centroids", "idx", "score"), tables)}
    arrays_cpu = {name: t.cpu() for name, t in arrays.items()}
    reader = IndexReader(lambda name, layer: arrays[name][layer], sorted(arrays))
    reader_cpu = IndexReader(lambda name, layer: arrays_cpu[name][layer], sorted(arrays_cpu))
    method = get_method("csattn")

    loc_k = torch.randn(KVH, M_LOCAL, D, device=dev, dtype=BF)
    loc_v = torch.randn(KVH, M_LOCAL, D, device=dev, dtype=BF)
    app_pos = torch.arange(n, n + M_LOCAL - 1, device=dev)
    q_pos = torch.tensor([n + M_LOCAL - 1], device=dev)

    def session(params, rdr, adev):
        s = method.open(rdr, params, n)
        s.append(0, loc_k[:, :-1].to(adev), loc_v[:, :-1].to(adev), app_pos.to(adev))
        return s

    gpu = session(p.with_overrides({"mode": "gpu"}), reader, dev)
    rq = RotatingInput([torch.randn(KVH, G, 1, D, device=dev, dtype=BF) for _ in range(4)])
    q, next_q = rq.buf, rq.next  # the static input buffer (for graphs), rotated between query sets
    kv = KVView(k, v, loc_k, loc_v, q_pos)
    scale = D ** -0.5
    k_all = torch.cat([k, loc_k], 1)[None]  # a contiguous KV cache for SDPA
    v_all = torch.cat([v, loc_v], 1)[None]

    def full():
        return F.scaled_dot_product_attention(q.reshape(1, H, 1, D), k_all, v_all, scale=scale, enable_gqa=True)

    def select():
        return gpu.select(0, q, kv)

    def step():
        idx = merge_selection(gpu.select(0, q, kv), q_pos, p.sink, p.window)
        return sparse_attention(q, idx, k, v, loc_k, loc_v, scale)

    idx_fixed = merge_selection(select(), q_pos, p.sink, p.window)

    def attention():
        return sparse_attention(q, idx_fixed, k, v, loc_k, loc_v, scale)

    # correctness of the timed path: == SDPA with a mask built from the same selection
    idx = merge_selection(select(), q_pos, p.sink, p.window)
    out = sparse_attention(q, idx, k, v, loc_k, loc_v, scale)
    mask = torch.zeros(KVH, n + M_LOCAL + 1, dtype=torch.bool, device=dev)  # last column: empty slots
    mask.scatter_(1, torch.where(idx[:, 0] >= 0, idx[:, 0], n + M_LOCAL), True)
    mask = mask[:, None, None, :-1]  # [KVH, 1, 1, N + M]
    k_ref = k_all[0, :, None].float().expand(-1, G, -1, -1)  # [KVH, G, N + M, D]
    v_ref = v_all[0, :, None].float().expand(-1, G, -1, -1)
    ref = F.scaled_dot_product_attention(q.float(), k_ref, v_ref, attn_mask=mask, scale=scale)
    mask_rel = float((out.float() - ref).norm() / ref.norm())
    n_sel = int((idx >= 0).sum(-1).float().mean())

    res = {"n_ctx": n, "alpha": alpha, "list_len": tables[1].shape[-1], "k_selected": p.budget(n + M_LOCAL),
           "attended_per_head": n_sel, "build_s": build_s, "build_ms_per_1k": build_s * 1e3 / (n / 1000),
           "sparse_vs_masked_sdpa_rel_l2": mask_rel}

    def timed(fn):
        def wrapped():
            next_q()
            return fn()
        return wrapped

    for name, fn in (("full_sdpa", full), ("csattn_step", step), ("csattn_select", select),
                     ("csattn_attention", attention)):
        res[f"{name}_eager_ms"] = T.cuda_ms(timed(fn))
        res[f"{name}_graph_ms"], res[f"{name}_graph_status"] = T.graph_ms(timed(fn))
    res["ratio_full_over_csattn_eager"] = res["full_sdpa_eager_ms"] / res["csattn_step_eager_ms"]
    if res["csattn_step_graph_ms"] and res["full_sdpa_graph_ms"]:
        res["ratio_full_over_csattn_graph"] = res["full_sdpa_graph_ms"] / res["csattn_step_graph_ms"]

    if PROFILE:  # which kernels a decode step spends its GPU time in (eager, one layer)
        from torch.profiler import ProfilerActivity, profile

        try:
            for _ in range(3):
                step()
            T.sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
                T.sync()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
        except Exception as e:  # the profile is a side product: report and go on
            table = f"profiler failed: {type(e).__name__}: {e}"
        print(f"--- kernels of 10 csattn steps, N={n}, alpha={alpha}\n{table}")
        res["profile_top_kernels"] = table

    # schedules: P steps with one search, eager, per step
    for sched in ("0.15-step-4", "0.20-step-8"):
        ps = p.with_overrides({"mode": "gpu", "schedule": sched})
        s = session(ps, reader, dev)
        period = ps.search_period

        def run_p():  # P consecutive steps hold exactly one search
            for _ in range(period):
                idx = merge_selection(s.select(0, q, kv), q_pos, ps.sink, ps.window)
                sparse_attention(q, idx, k, v, loc_k, loc_v, scale)
        res[f"schedule_{sched}_eager_ms_per_step"] = T.cuda_ms(timed(run_p), reps=20) / period

    # CPU<->GPU: host tables and K/V, host search, only selected rows go to the GPU
    off = session(p.with_overrides({"mode": "offload", "overlap": "off"}), reader_cpu, "cpu")
    kv_off = KVView(k.cpu(), v.cpu(), loc_k, loc_v, q_pos)
    res["offload_step_ms"] = T.host_ms(timed(lambda: off.attend(0, q, kv_off)))
    res["offload_select_ms"] = T.host_ms(timed(lambda: off.select(0, q, kv_off)))

    # equivalence: same tables, same queries, CPU vs GPU search
    cpu = session(p, reader_cpu, "cpu")
    kv_cpu = KVView(k.cpu(), v.cpu(), loc_k.cpu(), loc_v.cpu(), q_pos.cpu())
    overlaps = []
    for _ in range(16):
        qq = torch.randn(KVH, G, 1, D, device=dev, dtype=BF)
        a = gpu.select(0, qq, kv).cpu()
        b = cpu.select(0, qq.cpu(), kv_cpu)
        overlaps.append(float((a[..., :, None] == b[..., None, :]).any(-1).float().mean()))
    res["cpu_gpu_selection_overlap_min"] = min(overlaps)
    res["cpu_gpu_selection_overlap_mean"] = sum(overlaps) / len(overlaps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    global DEV, PROFILE
    DEV, PROFILE = args.device, args.profile
    T.device = DEV
    if DEV == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (--device cpu runs a smoke test of the logic)")
    info = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "shape": f"{H} q heads, {KVH} kv heads, d={D}, bf16, one layer, B=1, T=1, +{M_LOCAL} local tokens",
            "params": "m=8, C=64, rho=0.05, sink 4, window 32, backoff 0.7 tau 2, query_norm + list_min", "runs": []}
    print(info)
    configs = [(n, a) for n in args.lengths for a in ((0.2, 0.1) if n <= 32768 else (0.1,))]
    for n, alpha in configs:
        r = run(n, alpha)
        info["runs"].append(r)
        print(json.dumps(r), flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    hdr = (f"{'N':>7} {'alpha':>5} {'build s':>7} {'full eager':>10} {'cs eager':>9} {'ratio':>6} {'full graph':>10} "
           f"{'cs graph':>9} {'ratio':>6} {'select g':>8} {'attn g':>7} {'0.15-4':>7} {'0.20-8':>7} {'offload':>8} "
           f"{'overlap':>7} {'maskerr':>8}")
    print("\nms per decode step of one layer (median); ratio = full / csattn (> 1: csattn faster)")
    print(hdr)
    for r in info["runs"]:
        def f(x):
            return f"{x:.3f}" if isinstance(x, float) else "n/a"
        print(f"{r['n_ctx']:>7} {r['alpha']:>5} {r['build_s']:>7.2f} {f(r['full_sdpa_eager_ms']):>10} "
              f"{f(r['csattn_step_eager_ms']):>9} {r['ratio_full_over_csattn_eager']:>6.2f} "
              f"{f(r['full_sdpa_graph_ms']):>10} {f(r['csattn_step_graph_ms']):>9} "
              f"{f(r.get('ratio_full_over_csattn_graph')):>6} {f(r['csattn_select_graph_ms']):>8} "
              f"{f(r['csattn_attention_graph_ms']):>7} {f(r['schedule_0.15-step-4_eager_ms_per_step']):>7} "
              f"{f(r['schedule_0.20-step-8_eager_ms_per_step']):>7} {f(r['offload_step_ms']):>8} "
              f"{r['cpu_gpu_selection_overlap_min']:>7.4f} {r['sparse_vs_masked_sdpa_rel_l2']:>8.1e}")
        for key in ("full_sdpa", "csattn_step", "csattn_select", "csattn_attention"):
            if r[f"{key}_graph_status"] != "ok":
                print(f"   graph capture of {key} failed: {r[f'{key}_graph_status']}")
    ok = all(r["cpu_gpu_selection_overlap_min"] >= 0.99 and r["sparse_vs_masked_sdpa_rel_l2"] < 2e-2
             for r in info["runs"])
    print(f"checks (CPU/GPU selection overlap >= 0.99; bf16 sparse attention vs fp32 masked SDPA rel L2 < 2e-2): "
          f"{'PASS' if ok else 'FAIL'}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_csattn.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
