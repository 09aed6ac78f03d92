"""GPU: csattn CPU<->GPU decode with and without the overlap (indexer/csattn.py, `overlap`), against
All-GPU csattn and SDPA full attention, in a multi-layer decode loop, plus equivalence checks.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_csattn_overlap.py [--lengths 32768 131072] [--layers 8]

Model stand-in: Llama-3.1-8B layer shapes (hidden 4096, 32 q heads, 8 kv heads, d 128, SwiGLU MLP
14336), bf16, random weights shared by the layers (each layer still reads its 436 MB of weights
from HBM: they do not fit in L2), random context K/V and csattn tables per layer, no RoPE, no LM
head, B = 1, one token per step. Per layer: RMS norm, Q/K/V projections, attention (the variant),
O projection, RMS norm, MLP; the next layer's query depends on this layer's output, as in a model.

Variants (same weights, same context, same run):
* full: SDPA over the layer's KV cache in HBM (N + request tokens, GQA).
* gpu: csattn All-GPU (mode "gpu": select + merge_selection + sparse_attention, tables in HBM).
* off-sync: mode "offload", overlap "off": tables and context K/V in host memory; host search,
  host gather, H2D copy and the streaming update all on the critical path.
* off-updates: overlap "updates": the streaming update on the session's worker thread.
* off-lookahead: overlap "lookahead" with one worker: the update and the next step's search (with
  this step's query: one step stale), host gather and H2D copy (side stream, event) on the worker;
  "w2"/"w4"/"w8": host_workers 2/4/8 (layers spread over workers, intra-op threads split between
  them; 4 is the default).
* offload again with the schedule 0.20-step-8 (search every 8th step).
* full-sdpa-default: "full" with PyTorch's default SDPA backend choice (see FULL_BACKENDS).
Per variant: 3 warm-up steps, then --steps timed steps; wall clock per step with a device sync at
its end (a token is sampled there); median, the host time spent inside session.attend and the
worker threads' busy time. A variant named twice in --variants runs twice ("name#2").
Results of 2026-11-22: benchmarks/RESULTS_csattn.md, "CPU↔GPU overlap".

Checks (first length): over --check-steps steps and all layers, (1) the selection the lookahead
path used at step t equals a synchronous search given step t-1's query (set overlap); (2) its
output equals the offload-sync path's output given the same selection (same code path with the
selection forced; rel. L2, expected 0: same kernels, same rows; a race on the copies would show)
and All-GPU sparse attention over the same selection (rel. L2 < 1e-2, bf16).
Results: a table on stdout and $OUT/gpu_csattn_overlap.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from decoder.attention import merge_selection, sparse_attention  # noqa: E402
from indexer.base import IndexReader, KVView, get_method  # noqa: E402
from indexer.csattn import CSAttnParams, build_layer, search  # noqa: E402

HID, H, KVH, D, FF = 4096, 32, 8, 128, 14336
G = H // KVH
BF = torch.bfloat16
DEV = torch.device("cuda", 0)
WARMUP = 3
VARIANTS = {  # name -> csattn params overrides (None: SDPA full)
    "full": None,
    "full-sdpa-default": None,
    "gpu": {"mode": "gpu"},
    "off-sync": {"mode": "offload", "overlap": "off"},
    "off-updates": {"mode": "offload", "overlap": "updates"},
    "off-lookahead": {"mode": "offload", "overlap": "lookahead", "host_workers": 1},
    "off-lookahead w2": {"mode": "offload", "overlap": "lookahead", "host_workers": 2},
    "off-lookahead w4": {"mode": "offload", "overlap": "lookahead", "host_workers": 4},
    "off-lookahead w8": {"mode": "offload", "overlap": "lookahead", "host_workers": 8},
    "off-sync P8": {"mode": "offload", "overlap": "off", "schedule": "0.20-step-8"},
    "off-lookahead P8": {"mode": "offload", "overlap": "lookahead", "schedule": "0.20-step-8", "host_workers": 1},
    "off-lookahead P8 w4": {"mode": "offload", "overlap": "lookahead", "schedule": "0.20-step-8", "host_workers": 4},
    "off-lookahead P8 w8": {"mode": "offload", "overlap": "lookahead", "schedule": "0.20-step-8", "host_workers": 8},
}
# SDPA's backend for "full": without cuDNN attention, which builds a new plan for every new
# sequence length (one per decode step; "full-sdpa-default" keeps PyTorch's default choice)
FULL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class Bench:
    def __init__(self, n: int, layers: int, alpha: float, max_steps: int):
        self.n, self.layers, self.m_max = n, layers, max_steps + 8
        g = torch.Generator(device=DEV).manual_seed(n)

        def w(fan_in, fan_out):
            return (torch.randn(fan_in, fan_out, device=DEV, generator=g) / fan_in ** 0.5).to(BF)

        self.w = {"q": w(HID, H * D), "k": w(HID, KVH * D), "v": w(HID, KVH * D), "o": w(H * D, HID),
                  "up": w(HID, FF), "gate": w(HID, FF), "down": w(FF, HID)}
        self.p = CSAttnParams(alpha=alpha, sink=4, window=32)
        self.ctx_gpu, self.ctx_host, self.cache, tabs = [], [], [], []
        self.build_s = 0.0
        for _ in range(layers):
            k = torch.randn(KVH, n, D, device=DEV, generator=g).to(BF)
            v = torch.randn(KVH, n, D, device=DEV, generator=g).to(BF)
            q_pre = torch.randn(H, n, D, device=DEV, generator=g).to(BF)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tabs.append(build_layer(q_pre, k, self.p, torch.Generator().manual_seed(0)))
            torch.cuda.synchronize()
            self.build_s += time.perf_counter() - t0
            del q_pre
            self.ctx_gpu.append((k, v))
            self.ctx_host.append((k.cpu(), v.cpu()))  # pageable host memory, as a DRAM tier holds it
            kc = torch.zeros(KVH, n + self.m_max, D, device=DEV, dtype=BF)  # SDPA's cache: context + request
            vc = torch.zeros_like(kc)
            kc[:, :n], vc[:, :n] = k, v
            self.cache.append((kc, vc))
        names = ("centroids", "idx", "score")
        self.arr_gpu = {nm: torch.stack([t[j] for t in tabs]) for j, nm in enumerate(names)}
        self.arr_host = {nm: a.cpu() for nm, a in self.arr_gpu.items()}
        self.loc = [(torch.zeros(KVH, self.m_max, D, device=DEV, dtype=BF),
                     torch.zeros(KVH, self.m_max, D, device=DEV, dtype=BF)) for _ in range(layers)]
        self.x0 = torch.randn(1, HID, device=DEV, generator=g).to(BF)

    def session(self, overrides: dict):
        p = self.p.with_overrides(overrides)
        arr = self.arr_gpu if p.mode == "gpu" else self.arr_host
        return get_method("csattn").open(IndexReader(lambda nm, layer: arr[nm][layer], sorted(arr)), p, self.n), p

    def run(self, name: str, steps: int, record: list | None = None, sess_p=None) -> dict:
        """Decode `steps` tokens with one variant; per-step wall clock (device-synced) and host time in attend."""
        over = VARIANTS[name]
        sess, p = sess_p if sess_p is not None else (self.session(over) if over is not None else (None, self.p))
        offload = over is not None and over["mode"] == "offload"
        busy: list[float] = []  # worker task durations (s), all steps
        if offload and p.overlap_level != "off":
            for fn_name in ("_plan_ahead", "_update"):
                def timed(*a, _fn=getattr(sess, fn_name)):
                    t0 = time.perf_counter()
                    try:
                        return _fn(*a)
                    finally:
                        busy.append(time.perf_counter() - t0)
                setattr(sess, fn_name, timed)
        x = self.x0.clone()
        times, attend_s = [], []
        for step in range(steps):
            m = step  # request tokens before this one
            q_pos = torch.arange(self.n + m, self.n + m + 1, device=DEV)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            in_attend = 0.0
            for layer in range(self.layers):
                h = rms(x)
                q = (h @ self.w["q"]).view(KVH, G, 1, D)  # head i*G + j belongs to kv head i
                k = (h @ self.w["k"]).view(KVH, 1, D)
                v = (h @ self.w["v"]).view(KVH, 1, D)
                lk, lv = self.loc[layer]
                lk[:, m], lv[:, m] = k[:, 0], v[:, 0]
                if sess is None:  # full
                    kc, vc = self.cache[layer]
                    kc[:, self.n + m], vc[:, self.n + m] = k[:, 0], v[:, 0]
                    s = self.n + m + 1
                    if name == "full":
                        with sdpa_kernel(FULL_BACKENDS):
                            o = F.scaled_dot_product_attention(q.reshape(1, H, 1, D), kc[None, :, :s], vc[None, :, :s],
                                                               enable_gqa=True)
                    else:
                        o = F.scaled_dot_product_attention(q.reshape(1, H, 1, D), kc[None, :, :s], vc[None, :, :s],
                                                           enable_gqa=True)
                else:
                    ck, cv = self.ctx_host[layer] if offload else self.ctx_gpu[layer]
                    kv = KVView(ck, cv, lk[:, :m + 1], lv[:, :m + 1], q_pos)
                    ta = time.perf_counter()
                    if offload:
                        o, _ = sess.attend(layer, q, kv)
                    else:
                        idx = merge_selection(sess.select(layer, q, kv), q_pos, p.sink, p.window)
                        o = sparse_attention(q, idx, ck, cv, kv.loc_k, kv.loc_v, D ** -0.5)
                    in_attend += time.perf_counter() - ta
                    if record is not None:
                        record.append({"step": step, "layer": layer, "q": q.clone(), "k": k.clone(), "kv": kv,
                                       "sel": sess._last[layer][0].clone(), "out": o.clone()})
                    sess.append(layer, k, v, q_pos)
                x = x + o.reshape(1, H * D) @ self.w["o"]
                h = rms(x)
                x = x + (F.silu(h @ self.w["gate"]) * (h @ self.w["up"])) @ self.w["down"]
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            attend_s.append(in_attend * 1e3)
        if sess is not None and sess_p is None:
            sess.close()
        t, a = times[WARMUP:], attend_s[WARMUP:]
        return {"step_ms": statistics.median(t) if t else None, "step_ms_min": min(t) if t else None,
                "step_ms_max": max(t) if t else None, "attend_host_ms": statistics.median(a) if a else None,
                "first_step_ms": times[0], "worker_busy_ms_per_step": sum(busy) * 1e3 / steps if busy else None}

    def check(self, steps: int) -> dict:
        """Lookahead == synchronous search with the previous query; outputs == offload-sync and All-GPU."""
        rec: list = []
        sess_p = self.session(VARIANTS["off-lookahead"])
        self.run("off-lookahead", steps, record=rec, sess_p=sess_p)
        sess_p[0].close()
        sync, _ = self.session(VARIANTS["off-sync"])  # replays the same appends, fed the previous query
        forced, _ = self.session(VARIANTS["off-sync"])  # the sync path with the selection forced
        prev_q: dict = {}
        overlaps, rel_sync, rel_gpu = [], [], []
        for r in rec:  # in decode order: (step, layer)
            layer, kv = r["layer"], r["kv"]
            q_search = prev_q.get(layer, r["q"])  # step 0 searches with its own query
            ref_sel = sync.select(layer, q_search, kv).cpu()
            sync.append(layer, r["k"], r["k"], kv.q_pos)
            prev_q[layer] = r["q"]
            a, b = r["sel"], ref_sel
            overlaps.append(float((a[..., :, None] == b[..., None, :]).any(-1).float().mean()))
            forced._plan = lambda layer, q, kv, ship, sel=r["sel"]: (sel, None)
            out_sync, _ = forced.attend(layer, r["q"], kv)
            rel_sync.append(float((r["out"].float() - out_sync.float()).norm() / out_sync.float().norm()))
            ck, cv = self.ctx_gpu[layer]
            idx = merge_selection(r["sel"].to(DEV), kv.q_pos, self.p.sink, self.p.window)
            out_gpu = sparse_attention(r["q"], idx, ck, cv, kv.loc_k, kv.loc_v, D ** -0.5)
            rel_gpu.append(float((r["out"].float() - out_gpu.float()).norm() / out_gpu.float().norm()))
        sync.close()
        return {"check_steps": steps, "selection_overlap_min": min(overlaps),
                "selection_exact_share": sum(o == 1.0 for o in overlaps) / len(overlaps),
                "out_vs_offload_sync_rel_l2_max": max(rel_sync), "out_vs_all_gpu_rel_l2_max": max(rel_gpu)}

    def host_parts(self) -> dict:
        """One layer's host search and host gather + copy alone (median ms), for the breakdown."""
        sess, p = self.session(VARIANTS["off-sync"])
        cent, idx, score = sess.tables(0, "cpu")
        q = torch.randn(KVH, G, 1, D).to(BF)
        n_vis = self.n + 1
        q_pos = torch.tensor([self.n])
        from indexer.csattn import ship_rows

        def med(fn, reps=7):
            ts = []
            for _ in range(reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts[1:])

        sel = search(cent, idx, score, q, q_pos, n_vis, p.budget(n_vis), p)
        ck, cv = self.ctx_host[0]
        n_thr, scaling = torch.get_num_threads(), {}
        for k in (1, 4):  # the search's thread scaling (host_workers trades threads per search for layers in flight)
            torch.set_num_threads(k)
            scaling[f"host_search_ms_{k}_threads"] = med(lambda: search(cent, idx, score, q, q_pos, n_vis,
                                                                        p.budget(n_vis), p), reps=4)
        torch.set_num_threads(n_thr)
        return {**scaling, "host_search_ms": med(lambda: search(cent, idx, score, q, q_pos, n_vis, p.budget(n_vis), p)),
                "host_gather_h2d_ms": med(lambda: ship_rows(sel, q_pos, ck, cv, p.sink, p.window, DEV)),
                "rows_per_kv_head": int(merge_selection(sel, q_pos, p.sink, p.window).shape[-1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per variant (after 3 warm-up steps)")
    ap.add_argument("--check-steps", type=int, default=6)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "shape": f"{args.layers} layers, hidden {HID}, {H} q heads, {KVH} kv heads, d={D}, MLP {FF}, bf16, B=1, T=1",
            "params": "m=8, C=64, rho=0.05 (P8: 0.20-step-8), sink 4, window 32; alpha 0.2 at <=32K, 0.1 above",
            "runs": []}
    print(info, flush=True)
    for i, n in enumerate(args.lengths):
        alpha = 0.2 if n <= 32768 else 0.1
        b = Bench(n, args.layers, alpha, WARMUP + max(args.steps, args.check_steps))
        res = {"n_ctx": n, "alpha": alpha, "build_s_all_layers": b.build_s, **b.host_parts()}
        if i == 0:
            res.update(b.check(args.check_steps))
            print(json.dumps({k: v for k, v in res.items()}), flush=True)
        for name in args.variants:  # a name given twice is run twice ("name#2": order effects, spread)
            key = name if name not in res else f"{name}#{sum(k.split('#')[0] == name for k in res) + 1}"
            res[key] = b.run(name, WARMUP + args.steps)
            res.setdefault("order", []).append(key)
            print(n, key, res[key], flush=True)
        info["runs"].append(res)
        del b
        torch.cuda.empty_cache()
    print("\nms per decode step (all layers, median of timed steps; device-synced wall clock); "
          "ratio = full / variant (> 1: faster than full); host = ms inside session.attend per step")
    print(f"{'N':>7} {'variant':>19} {'step ms':>8} {'min':>7} {'max':>7} {'host':>7} {'worker':>7} {'full/x':>7} "
          f"{'sync/x':>7}")
    for r in info["runs"]:
        full = r.get("full", {}).get("step_ms")
        for name in r["order"]:
            v = r[name]
            base = r.get("off-sync P8" if "P8" in name else "off-sync", {}).get("step_ms")
            fx = f"{full / v['step_ms']:.3f}" if full else "n/a"
            sx = f"{base / v['step_ms']:.3f}" if base and name.startswith("off") else ""
            host = f"{v['attend_host_ms']:.2f}" if v["attend_host_ms"] is not None else ""
            wk = f"{v['worker_busy_ms_per_step']:.2f}" if v["worker_busy_ms_per_step"] is not None else ""
            print(f"{r['n_ctx']:>7} {name:>19} {v['step_ms']:>8.2f} {v['step_ms_min']:>7.2f} {v['step_ms_max']:>7.2f} "
                  f"{host:>7} {wk:>7} {fx:>7} {sx:>7}")
        print(f"        host search {r['host_search_ms']:.2f} ms/layer ({r['host_search_ms_1_threads']:.2f} on 1 "
              f"thread, {r['host_search_ms_4_threads']:.2f} on 4), host gather+H2D {r['host_gather_h2d_ms']:.2f} "
              f"ms/layer ({r['rows_per_kv_head']} rows per kv head), build {r['build_s_all_layers']:.2f} s")
    r0 = info["runs"][0]
    ok = (r0["selection_overlap_min"] >= 0.999 and r0["out_vs_offload_sync_rel_l2_max"] <= 1e-3
          and r0["out_vs_all_gpu_rel_l2_max"] < 1e-2)
    print(f"checks at N={r0['n_ctx']}: lookahead selection vs sync search with the previous query: overlap min "
          f"{r0['selection_overlap_min']:.5f} (exact in {r0['selection_exact_share']:.3f} of layer-steps; need >= 0.999); "
          f"output vs offload-sync same selection rel L2 max {r0['out_vs_offload_sync_rel_l2_max']:.2e} (<= 1e-3); "
          f"vs All-GPU {r0['out_vs_all_gpu_rel_l2_max']:.2e} (< 1e-2): {'PASS' if ok else 'FAIL'}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_csattn_overlap.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
