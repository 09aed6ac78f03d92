"""One decode step per method on a GPU: plan + run for one Llama-3.1-8B-shaped layer, against torch
SDPA measured in the same run. Eager (host clock, synchronized) and CUDA-graph-replayed (events).

    PYTHONUNBUFFERED=1 python benchmarks/gpu_decode.py --lengths 32768 131072 --batches 1 8
    python benchmarks/gpu_decode.py --device cpu --lengths 2048 --reps 3     # smoke run of the logic

Layer shape: 32 query heads, 8 KV heads (GQA group 4), head dim 128, bf16 K/V and queries, RoPE
theta 500000. Inputs are seeded and structured so that selections mean something: per KV head,
de-RoPE'd keys are an offset + one of 512 mixture centres (Zipf 0.8 weights) + noise, RoPE'd at
their positions (what a capture holds); queries are drawn the same way from the same centres (so a
query prefers the keys of its centre); values are Gaussian. The request holds 64 tokens (a static
buffer of 64 slots), the step's query is its last one (T = 1).

Per length N and method: the index is built on the GPU from a one-layer capture (SAAP: a synthetic
trained model written in its format by tests/synthetic.py, k-means on de-RoPE'd keys + a classifier
at random init; layer 0 is SAAP's dense layer, so SAAP's timed layer is layer 1), its
build time is recorded next to the prefill time of that layer (SDPA causal over N + the layer's
GEMMs at random weights), the planner is opened, and the step `backend.run(q, kv, planner.plan(...))`
is timed with each backend (torch_ref, and triton when it is installed). Baselines in the same run:
SDPA over all N + 64 keys, SDPA over a contiguous 5% slice (the floor a perfect gather reaches
at that budget with SDPA's own kernel), and (B = 1) the triton backend over a given random 5% plan
(`triton_plan_5pct`: issue 12's "≤ 1.3× SDPA over a contiguous 5% slice"; `time_over_slice`).
B = 8: eight requests on eight contexts (the same values
copied to distinct memory), each request's step on its own side stream inside one graph
(`decoder.streams.fork_join`, as the runner does; `--serial`: one after another on one stream);
SDPA B = 8 is one batched call. Every step's output is checked against `torch_ref` over the same plan.

Budgets (rho 5% where the method has a ratio): topk, csattn (alpha 0.1, the paper's 64-128K
setting), kivf, lfps ratio 0.05; ctkvr at its paper operating point (k = 1024, lists 2560, probe 4);
psa eps 0.95 with at most `--psa-max-ratio` of the blocks; saap C = 1024, nprobe 32 (~3%). A method
argument "name@param=value" runs another operating point in the same run (`_gpu_timing.method_spec`;
e.g. psa@max_ratio=0.05, psa capped at rho; psa@rule=budget,max_ratio=0.05, its fixed budget of the rho best
blocks; psa@rule=budget,max_ratio=0.05,block_size=128, the same over blocks of 128 tokens, a build field), its rows
named so.

Fused searches against their torch path (`--torch-plans`, B = 1, the triton backend): the same request
is opened a second time with the planner's fused kernels switched off (`planner.fused = False`, saap:
`use_kernels = False`) and timed the same way (rows with planner "torch"; the default rows are
planner "auto": fused where the method has kernels); `plan_agreement` = the mean over plan rows of
|fused row ∩ torch row| / |torch row| (positions as sets, -1 ignored): 1.0 = the same plan.

L2: every timed GPU call starts with a cold L2 (`benchmarks/_gpu_timing.py`: a 256 MiB buffer is
zeroed before it, untimed), as each layer's step finds it in a real model's decode. `--l2 both` also
times every graph with the L2 left warm by the previous replay (mode `graph_warm_l2`), the protocol
of the runs before 2026-11-23, to show how much of a sparse step a warm L2 served. `--l2 clean` also
times every graph after a flush that reads the buffer instead of zeroing it (mode `graph_clean_l2`: an
L2 of clean lines, which a step's misses need not write back first; `_gpu_timing` says why).

Rows (JSON, $OUT/gpu_decode.json): n, batch, method, backend, planner, mode (eager|graph|graph_warm_l2|
graph_clean_l2),
ms, sdpa_ms (full SDPA, same batch and mode), sdpa_slice_ms, ratio = sdpa_ms / ms (> 1: faster than
dense), l2 (cold|warm|clean). With `--profile` on a GPU the file also holds `kernel_regs`: registers, spilled
registers and warps of every Triton kernel the run compiled (`_gpu_timing.triton_kernel_regs`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._gpu_timing import (BF, D, G, H, KVH, M_LOCAL, THETA, Timing, kernel_profile, method_spec,  # noqa: E402
                                    triton_kernel_regs)
from decoder.backends import backend_names, get_backend  # noqa: E402
from decoder.streams import fork_join  # noqa: E402
from indexer.rope import apply_rope  # noqa: E402
from indexer.base import DecodeContext, IndexReader, KVView, PrefillCapture, get_method  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from synthetic import Mixture, llama8b_spec, write_saap_model  # noqa: E402

DEV = "cuda"
T = Timing(DEV)
MODES = ["eager", "graph"]  # + "graph_warm_l2" with --l2 both, "graph_clean_l2" with --l2 clean


def l2_of(mode: str) -> str:
    return {"graph_warm_l2": "warm", "graph_clean_l2": "clean"}.get(mode, "cold")


def graph_modes(fn, reps: int, reasons: dict | None = None) -> dict[str, float | None]:
    """Graph-replay ms of fn per graph mode: "graph" (cold L2), and "graph_warm_l2" when asked for;
    `reasons` gets each mode's capture outcome ("ok" or why not)."""
    out = {}
    for mode in MODES[1:]:
        T.cold = mode != "graph_warm_l2"
        T.flush = "read" if mode == "graph_clean_l2" else "zero"
        out[mode], why = T.graph_ms(fn, reps=reps)
        if reasons is not None:
            reasons[mode] = why
    T.cold, T.flush = True, "zero"
    return out
# psa twice: its progressive rule (capped by --psa-max-ratio) and its fixed budget of the rho = 5% best blocks
METHODS = ["streaming", "topk", "csattn", "ctkvr", "kivf", "lfps", "psa", "psa@rule=budget,max_ratio=0.05",
           "psa@rule=budget,max_ratio=0.05,block_size=128", "saap"]


def spec(layers: int):
    return llama8b_spec(layers)


def make_inputs(n: int, mix: Mixture, seed: int):
    """q [H, N + M, D], k / v [KVH, N + M, D] bf16: context then the request's tokens."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pos = torch.arange(n + M_LOCAL, device=DEV)
    k = apply_rope(mix.sample(n + M_LOCAL, g), pos, THETA).to(BF)
    q = apply_rope(mix.sample(n + M_LOCAL, g, heads=H), pos, THETA).to(BF)
    v = torch.randn(KVH, n + M_LOCAL, D, device=DEV, generator=g).to(BF)
    return q, k, v


def method_params(name: str, saap_dir: Path | None, psa_max_ratio: float, overrides: dict | None = None):
    """The method and its operating point (the module docstring's budgets), `overrides` on top
    ("psa@max_ratio=0.05": `method_spec`)."""
    m = get_method(name)
    kw = {
        "topk": {"ratio": 0.05},
        "csattn": {"alpha": 0.1, "rho": 0.05},
        "ctkvr": {"k": 1024, "list_size": 2560},
        "kivf": {"ratio": 0.05},
        "lfps": {"ratio": 0.05},
        "psa": {"eps": 0.95, "max_ratio": psa_max_ratio},
        "saap": {"model_dir": str(saap_dir), "nprobe": 32},
    }.get(name, {})
    if name == "psa" and "max_ratio" not in m.Params.model_fields:
        kw.pop("max_ratio")
    kw.update(overrides or {})
    return m, m.Params(**kw)


def prefill_layer_ms(n: int) -> float:
    """One 8B layer's prefill over n tokens at random weights: QKV/O projections, causal SDPA, MLP."""
    hid, inter = H * D, 14336
    x = torch.randn(n, hid, device=DEV, dtype=BF)
    wqkv = torch.randn(hid, hid + 2 * KVH * D, device=DEV, dtype=BF) * 0.01
    wo = torch.randn(hid, hid, device=DEV, dtype=BF) * 0.01
    wup = torch.randn(hid, 2 * inter, device=DEV, dtype=BF) * 0.01
    wdown = torch.randn(inter, hid, device=DEV, dtype=BF) * 0.01

    def layer():
        qkv = x @ wqkv
        q = qkv[:, :hid].view(n, H, D).transpose(0, 1)[None]
        k = qkv[:, hid:hid + KVH * D].view(n, KVH, D).transpose(0, 1)[None]
        v = qkv[:, hid + KVH * D:].view(n, KVH, D).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = o[0].transpose(0, 1).reshape(n, hid) @ wo
        out = torch.empty_like(h)
        for a in range(0, n, 1 << 16):  # the MLP in row chunks (512K rows x 28672 would be 28 GiB at once)
            up = h[a:a + (1 << 16)] @ wup
            out[a:a + (1 << 16)] = (F.silu(up[:, :inter]) * up[:, inter:]) @ wdown
        return out

    return T.cuda_ms(layer, reps=3, warmup=1)


class Request:
    """One request on one context: static buffers a graph can read, the planner, the backend."""

    def __init__(self, ctx_k, ctx_v, loc_k, loc_v, q, arrays, method, params, layer, sp, backend, torch_plan=False,
                 solo=True):
        # the planner may attend its plan where the runner lets it: a request alone in its step
        self.kv = KVView(ctx_k, ctx_v, loc_k, loc_v, torch.tensor([ctx_k.shape[1] + M_LOCAL - 1], device=DEV),
                         attend_scale=D ** -0.5 if solo and backend.takes_attended else None)
        self.q = q
        self.layer = layer
        reader = None if arrays is None else IndexReader(lambda nm, l: arrays[nm][l], sorted(arrays))
        self.planner = method.open(reader, params, DecodeContext(ctx_k.shape[1], sp, M_LOCAL))
        if torch_plan:  # the planner's torch path (the reference its fused kernels are checked against)
            for attr in ("fused", "use_kernels"):
                if hasattr(self.planner, attr):
                    setattr(self.planner, attr, False)
        self.sink, self.window = params.frame(ctx_k.shape[1])
        self.backend = backend
        self.plan = None

    def step(self):
        self.plan = self.planner.plan(self.layer, self.q, self.kv)
        return self.backend.run(self.q, self.kv, self.plan, self.sink, self.window, D ** -0.5)


def with_knobs(cfg, knobs: str, spec: str):
    """A copy of the config dataclass `cfg` with "knob=value,..." applied (ints; 0/1 for flags)."""
    import dataclasses

    kw = {}
    for item in knobs.split(","):
        key, _, val = item.partition("=")
        if not hasattr(cfg, key):
            raise SystemExit(f"unknown {type(cfg).__name__} knob {key!r} in {spec!r}")
        kw[key] = bool(int(val)) if isinstance(getattr(cfg, key), bool) else int(val)
    return dataclasses.replace(cfg, **kw)


def backend_for(spec: str):
    """A registered backend by name, or "triton:knob=value,..." for the triton backend with
    `KernelConfig` knobs changed (A/B rows in one run, e.g. "triton:pdl=0")."""
    name, _, knobs = spec.partition(":")
    if not knobs:
        return get_backend(name)
    from decoder.backends.triton import TritonAttention
    from decoder.kernels.attention import KernelConfig

    return TritonAttention(with_knobs(KernelConfig(), knobs, spec))


def plan_knobs(method: str, knobs: str):
    """ "psa:regs_select=0", "ctkvr:chunks_per_prog=1": the method's fused plan with its kernel config's
    knobs changed (its module's DEFAULT_CONFIG: `PsaConfig`, `IvfConfig` for ctkvr and kivf,
    `CsattnConfig`, `LfpsConfig`) while this method's rows run (A/B rows in one run); returns the
    function that restores the defaults."""
    if not knobs:
        return lambda: None
    modules = {"psa": "psa", "ctkvr": "ivf", "kivf": "ivf", "csattn": "csattn", "lfps": "lfps"}
    if method not in modules:
        raise SystemExit(f"plan knobs are supported for {', '.join(modules)}, not {method!r}")
    kp = importlib.import_module(f"indexer.kernels.{modules[method]}")

    old = kp.DEFAULT_CONFIG
    kp.DEFAULT_CONFIG = with_knobs(old, knobs, f"{method}:{knobs}")

    def restore():
        kp.DEFAULT_CONFIG = old
    return restore


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def repeatability(step, req, out0: torch.Tensor, repeats: int = 20) -> dict:
    """The same step run `repeats` more times (eager): how many gave the first run's plan rows bit for
    bit (order included), the same sets of positions, and the same attention output bit for bit. A
    plan whose row order follows a race between programs (an atomic counter, a dedup bit) keeps its
    sets and changes its order, and the bf16 attention over another order rounds otherwise."""
    pos0 = None if req.plan.positions is None else req.plan.positions.clone()
    set0 = None if pos0 is None else pos0.sort(dim=-1).values
    out0 = out0.clone()
    same_rows = same_sets = same_out = 0
    for _ in range(repeats):
        out = step()[0]
        pos = req.plan.positions
        if pos0 is None or torch.equal(pos, pos0):
            same_rows += 1
        if pos0 is None or torch.equal(pos.sort(dim=-1).values, set0):
            same_sets += 1
        same_out += int(torch.equal(out, out0))
    return {"repeats": repeats, "same_rows": same_rows, "same_sets": same_sets, "same_output": same_out}


def repeat_text(repeat: dict | None) -> str:
    if repeat is None:
        return ""
    return (f" repeats (rows/sets/output) {repeat['same_rows']}/{repeat['same_sets']}/{repeat['same_output']}"
            f" of {repeat['repeats']}")


def has_fused_path(planner) -> bool:
    return hasattr(planner, "fused") or hasattr(planner, "use_kernels")


def plan_agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over rows of |got ∩ want| / |want| (positions as sets, -1 ignored; 1.0 for two empty rows)."""
    g, w = got.reshape(-1, got.shape[-1]).long(), want.reshape(-1, want.shape[-1]).long()
    scores = []
    for a, b in zip(g.cpu(), w.cpu()):
        sa, sb = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
        scores.append(1.0 if not sb and not sa else len(sa & sb) / max(len(sb), 1))
    return sum(scores) / max(len(scores), 1)


def run_length(n: int, batches: list[int], methods: list[str], backends: list[str], reps: int, psa_max_ratio: float,
               workdir: Path, profile: bool = False, torch_plans: bool = False,
               parallel: bool = True) -> tuple[list[dict], list[dict]]:
    rows, builds = [], []
    sp1, sp2 = spec(1), spec(2)
    mix = Mixture(sp2, DEV, seed=0)
    q_all, k_all, v_all = make_inputs(n, mix, seed=n)
    saap_dir = workdir / "saap-model"
    if "saap" in methods and not (saap_dir / "manifest.json").exists():
        write_saap_model(saap_dir, sp2, mix, layers=[1], clusters=1024, hidden=1024, sample=65536)
    ctx_k, ctx_v = k_all[:, :n].contiguous(), v_all[:, :n].contiguous()
    loc_k, loc_v = k_all[:, n:].contiguous(), v_all[:, n:].contiguous()
    q_step = q_all[:, n + M_LOCAL - 1].reshape(KVH, G, 1, D).contiguous()  # the request's last token
    scale = D ** -0.5
    t_prefill = prefill_layer_ms(n)
    print(f"n={n}: prefill of one 8B layer {t_prefill:.1f} ms", flush=True)

    # --- SDPA baselines, per batch size, eager and graph
    sdpa: dict[tuple[int, str], float] = {}
    sdpa_slice: dict[tuple[int, str], float] = {}
    ks = max(1, int(0.05 * n))

    def baselines(b: int) -> dict[str, tuple]:
        qb = q_step.reshape(1, H, 1, D).expand(b, H, 1, D).contiguous()
        kb = k_all[None].expand(b, -1, -1, -1).contiguous()
        vb = v_all[None].expand(b, -1, -1, -1).contiguous()
        kbs, vbs = kb[:, :, :ks].contiguous(), vb[:, :, :ks].contiguous()
        full = lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)  # noqa: E731
        part = lambda: F.scaled_dot_product_attention(qb, kbs, vbs, enable_gqa=True)  # noqa: E731
        out = {"eager": (T.host_ms(full, reps=reps), T.host_ms(part, reps=reps))}
        g_full, g_part = graph_modes(full, reps), graph_modes(part, reps)
        for mode in g_full:
            out[mode] = (g_full[mode], g_part[mode])
        return out

    for b in batches:
        for mode, (t_full, t_part) in baselines(b).items():
            sdpa[b, mode], sdpa_slice[b, mode] = t_full, t_part
        for mode in MODES:
            rows.append({"n": n, "batch": b, "method": "sdpa_full", "backend": "sdpa", "mode": mode, "ms": sdpa[b, mode],
                         "sdpa_ms": sdpa[b, mode], "sdpa_slice_ms": sdpa_slice[b, mode], "ratio": 1.0,
                         "l2": l2_of(mode)})
            rows.append({"n": n, "batch": b, "method": "sdpa_slice_5pct", "backend": "sdpa", "mode": mode,
                         "ms": sdpa_slice[b, mode], "sdpa_ms": sdpa[b, mode], "sdpa_slice_ms": sdpa_slice[b, mode],
                         "ratio": ratio(sdpa[b, mode], sdpa_slice[b, mode]), "l2": l2_of(mode)})
        torch.cuda.empty_cache() if DEV == "cuda" else None
        print(f"  sdpa B={b}: full {sdpa[b, 'eager']:.3f} / {sdpa[b, 'graph']} ms (eager/graph), "
              f"5% slice {sdpa_slice[b, 'eager']:.3f} / {sdpa_slice[b, 'graph']}"
              + "".join(f"; {m}: full {sdpa[b, m]}, slice {sdpa_slice[b, m]}" for m in MODES[2:]), flush=True)

    ref_backend = get_backend("torch_ref")
    if 1 in batches and "triton" in backends:
        rows += given_plan_rows(n, ctx_k, ctx_v, loc_k, loc_v, q_step, ks, sdpa, sdpa_slice, ref_backend, reps)
    for spec_name in methods:
        name, overrides, knobs = method_spec(spec_name)
        restore = plan_knobs(name, knobs)
        try:
            method, params = method_params(name, saap_dir, psa_max_ratio, overrides)
            layers = 2 if name == "saap" else 1
            layer = layers - 1
            sp = sp2 if name == "saap" else sp1
            arrays = None
            if method.has_index:
                cap = PrefillCapture(q=q_all[None, :, :n].expand(layers, -1, -1, -1),
                                     k=ctx_k[None].expand(layers, -1, -1, -1), v=ctx_v[None].expand(layers, -1, -1, -1),
                                     positions=torch.arange(n, device=DEV), spec=sp)
                T.sync()
                t0 = time.perf_counter()
                arrays = {k: v.to(DEV) for k, v in method.build(cap, params).items()}
                T.sync()
                b_s = time.perf_counter() - t0
                nbytes = sum(a[layer].numel() * a[layer].element_size() for a in arrays.values())
                builds.append({"n": n, "method": spec_name, "build_s": b_s, "prefill_layer_ms": t_prefill,
                               "build_over_prefill": b_s * 1e3 / t_prefill, "index_bytes_per_layer": nbytes})
                print(f"  {name}: build {b_s:.2f} s ({b_s * 1e3 / t_prefill:.1f}x the layer's prefill), "
                      f"{nbytes / 2**20:.1f} MiB per layer", flush=True)
            for be_name in backends:
                be = backend_for(be_name)
                for b in batches:
                    reqs = []
                    for i in range(b):  # distinct memory per request (same values)
                        own = (lambda x: x.clone()) if i else (lambda x: x)
                        arr_i = None if arrays is None else {k: own(v) for k, v in arrays.items()}
                        reqs.append(Request(own(ctx_k), own(ctx_v), own(loc_k), own(loc_v), own(q_step), arr_i,
                                            method, params, layer, sp, be, solo=b == 1))

                    streams = None
                    if b > 1 and parallel and DEV == "cuda":
                        streams = [torch.cuda.Stream() for _ in reqs]

                    def step(reqs=reqs, streams=streams):
                        return fork_join(streams, [r.step for r in reqs])

                    outs = step()
                    repeat = repeatability(step, reqs[0], outs[0]) if b == 1 else None
                    want = ref_backend.run(reqs[0].q, reqs[0].kv, reqs[0].plan, reqs[0].sink, reqs[0].window, scale)
                    err = rel(outs[0], want)
                    k_plan = None if reqs[0].plan.positions is None else int(reqs[0].plan.positions.shape[-1])
                    valid = None if k_plan is None else float((reqs[0].plan.positions >= 0).float().mean())
                    eager = T.host_ms(step, reps=reps)
                    graphs = graph_modes(step, reps, reasons := {})
                    graph, why = graphs["graph"], reasons["graph"]
                    prof = None
                    if profile and b == 1 and DEV == "cuda":
                        try:
                            prof = kernel_profile(step, sync=T.sync)
                        except Exception as e:  # noqa: BLE001 - the profile is extra information only
                            prof = {"error": f"{type(e).__name__}: {e}"[:200], "kernels_per_call": 0,
                                    "device_us_per_call": 0.0, "top": []}
                    for mode, ms in (("eager", eager), *graphs.items()):
                        rows.append({"n": n, "batch": b, "method": spec_name, "backend": be_name, "planner": "auto",
                                     "streams": "parallel" if streams else "one", "mode": mode, "ms": ms,
                                     "sdpa_ms": sdpa[b, mode], "sdpa_slice_ms": sdpa_slice[b, mode],
                                     "ratio": ratio(sdpa[b, mode], ms), "plan_k": k_plan,
                                     "plan_filled": valid, "err_vs_torch_ref": err, "l2": l2_of(mode),
                                     "graph": reasons.get(mode), "repeat": repeat,
                                     "profile": prof if mode == "graph" else None})
                    g_txt = "not captured" if graph is None else f"{graph:.3f} ms ({ratio(sdpa[b, 'graph'], graph)}x sdpa)"
                    if prof:
                        print(f"    {prof['kernels_per_call']:.0f} kernels, {prof['device_us_per_call']:.1f} us of device "
                              f"time per step; top: {prof['top'][:3]}", flush=True)
                    w_txt = "".join(f" ({what} L2 {graphs[m]:.4f} ms, {ratio(sdpa[b, m], graphs[m])}x)"
                                    for what, m in (("warm", "graph_warm_l2"), ("clean", "graph_clean_l2"))
                                    if graphs.get(m) is not None)
                    print(f"  {spec_name:9s} {be_name:9s} B={b}: eager {eager:.3f} ms ({sdpa[b, 'eager'] / eager:.2f}x sdpa), "
                          f"graph {g_txt}{w_txt}, K={k_plan} filled={valid if valid is None else round(valid, 3)} err={err:.1e}"
                          f"{'' if why == 'ok' else ' graph: ' + why}{repeat_text(repeat)}", flush=True)
                    if torch_plans and b == 1 and be_name == "triton" and has_fused_path(reqs[0].planner):
                        rows += torch_plan_rows(reqs[0], method, params, arrays, layer, sp, be, n, sdpa, reps, spec_name)
                    del reqs
            del arrays
            torch.cuda.empty_cache() if DEV == "cuda" else None
        except Exception as e:  # noqa: BLE001 - one method failing must not hide the others' numbers
            traceback.print_exc()
            rows.append({"n": n, "method": spec_name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        finally:
            restore()
    return rows, builds


def given_plan_rows(n, ctx_k, ctx_v, loc_k, loc_v, q_step, ks, sdpa, sdpa_slice, ref_backend, reps) -> list[dict]:
    """Issue 12's first target: the triton backend over a given plan of ks (5%) context positions per KV head (random,
    ascending, drawn once; the frame of topk's parameters at this length, whose duplicates the backend masks) against
    SDPA over a contiguous 5% slice, B = 1: rows "triton_plan_5pct" with `time_over_slice` = ms / the slice's ms
    (the target: <= 1.3)."""
    from indexer.base import Plan

    g = torch.Generator(device=DEV).manual_seed(n + 1)
    pos = torch.stack([torch.randperm(n, generator=g, device=DEV)[:ks].sort().values for _ in range(KVH)])
    plan = Plan(pos.to(torch.int32)[:, None], lengths=torch.full((KVH, 1), ks, dtype=torch.int32, device=DEV))
    kv = KVView(ctx_k, ctx_v, loc_k, loc_v, torch.tensor([n + M_LOCAL - 1], device=DEV))
    sink, window = get_method("topk").Params(ratio=0.05).frame(n)
    be, scale = backend_for("triton"), D ** -0.5

    def step():
        return be.run(q_step, kv, plan, sink, window, scale)

    err = rel(step(), ref_backend.run(q_step, kv, plan, sink, window, scale))
    times = {"eager": T.host_ms(step, reps=reps), **graph_modes(step, reps)}
    print(f"  triton over a given 5% plan B=1: eager {times['eager']:.3f} ms, graph {times['graph']} ms "
          f"({ratio(times['graph'], sdpa_slice[1, 'graph'])}x the time of SDPA over a contiguous 5% slice; "
          f"{ratio(sdpa[1, 'graph'], times['graph'])}x faster than SDPA full) err={err:.1e}", flush=True)
    return [{"n": n, "batch": 1, "method": "triton_plan_5pct", "backend": "triton", "mode": mode, "ms": ms,
             "sdpa_ms": sdpa[1, mode], "sdpa_slice_ms": sdpa_slice[1, mode], "ratio": ratio(sdpa[1, mode], ms),
             "time_over_slice": ratio(ms, sdpa_slice[1, mode]), "plan_k": ks, "err_vs_torch_ref": err,
             "l2": l2_of(mode)} for mode, ms in times.items()]


def torch_plan_rows(fused_req, method, params, arrays, layer, sp, be, n, sdpa, reps, name) -> list[dict]:
    """The same request with the planner's torch path: time it and compare its plan with the fused one."""
    kv = fused_req.kv
    req = Request(kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, fused_req.q, arrays, method, params, layer, sp, be,
                  torch_plan=True)
    req.step()
    fp, tp = fused_req.plan.positions, req.plan.positions
    agree = None if fp is None or tp is None else plan_agreement(fp, tp)
    eager = T.host_ms(req.step, reps=reps)
    graph, why = T.graph_ms(req.step, reps=reps)  # cold L2, as the fused rows' "graph" mode
    print(f"  {name:9s} torch plan: eager {eager:.3f} ms, graph {graph if graph is None else round(graph, 3)} ms, "
          f"plan agreement with the fused plan {agree}", flush=True)
    return [{"n": n, "batch": 1, "method": name, "backend": be.name, "planner": "torch", "mode": mode, "ms": ms,
             "sdpa_ms": sdpa[1, mode], "ratio": ratio(sdpa[1, mode], ms), "plan_agreement": agree,
             "l2": l2_of(mode), "graph": why if mode == "graph" else None} for mode, ms in (("eager", eager), ("graph", graph))]


def main() -> None:
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--backends", nargs="+", default=None,
                    help='backend names, or "triton:knob=value,..." for KernelConfig variants (A/B rows)')
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--psa-max-ratio", type=float, default=0.1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="kernels per step and the top kernels (B = 1)")
    ap.add_argument("--serial", action="store_true",
                    help="B > 1: step the requests one after another on one stream (default: each on its own "
                         "side stream, as decoder.runner does)")
    ap.add_argument("--torch-plans", action="store_true",
                    help="also time each fused planner's torch path and compare the plans (B = 1, triton backend)")
    ap.add_argument("--l2", choices=["cold", "both", "clean"], default="cold",
                    help="both: also time every graph with a warm L2 (mode graph_warm_l2); clean: also after a "
                         "flush that leaves the L2 clean (mode graph_clean_l2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    DEV = a.device
    T.device = a.device
    if a.l2 == "both":
        MODES.append("graph_warm_l2")
    elif a.l2 == "clean":
        MODES.append("graph_clean_l2")
    backends = a.backends or [b for b in ("torch_ref", "triton") if b in backend_names()]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if DEV == "cuda" else platform.processor(),
            "python": platform.python_version(), "backends": backends}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(info), flush=True)
    rows, builds = [], []
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        for n in a.lengths:
            r, b = run_length(n, a.batches, a.methods, backends, a.reps, a.psa_max_ratio, Path(tmp), a.profile,
                                  a.torch_plans, not a.serial)
            rows += r
            builds += b
            (out / "gpu_decode.json").write_text(json.dumps({"info": info, "rows": rows, "builds": builds}, indent=1))
    if a.profile and DEV == "cuda":  # registers and spills of the kernels this run compiled
        regs = triton_kernel_regs()
        print("kernel registers [regs, spills, warps]:", json.dumps(regs), flush=True)
        (out / "gpu_decode.json").write_text(json.dumps({"info": info, "rows": rows, "builds": builds,
                                                         "kernel_regs": regs}, indent=1))
    print("\n| n | B | method | backend | eager ms | x SDPA | graph ms | x SDPA |")
    print("|---|---|---|---|---|---|---|---|")
    by = {}
    for r in rows:
        if "error" not in r:
            by.setdefault((r["n"], r["batch"], r["method"], r["backend"] + ("" if r.get("planner", "auto") == "auto"
                                                                            else " (torch plan)")), {})[r["mode"]] = r
    for (n, b, m, be), d in by.items():
        e, g = d.get("eager", {}), d.get("graph", {})
        f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        fr = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"| {n} | {b} | {m} | {be} | {f(e.get('ms'))} | {fr(e.get('ratio'))} | {f(g.get('ms'))} | {fr(g.get('ratio'))} |")
    for r in rows:
        if "error" in r:
            print(f"ERROR n={r['n']} {r['method']}: {r['error']}")


if __name__ == "__main__":
    main()
