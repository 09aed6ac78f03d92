"""End-to-end decode on a GPU: ms/token and tokens/s of a whole model, per method, against the HBM floor.

Long because it is one self-contained run for the device tool (model, prefill, each method's
index, three kinds of timed rows and their floors): a single file to carry and read top to bottom.

    # on the device tool (carry .whl: pydantic, faiss-cpu, zarr, ... as benchmarks/device_run.sh installs them)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_e2e.py --lengths 32768 --batches 1 8
    ... --lengths 131072 --batches 1 8 --methods hf full csattn ctkvr kivf
    ... --lengths 131072 --batches 1 8 --methods saap psa lfps
    ... --lengths 131072 --batches 8 --methods csattn ctkvr --backends offload --tokens 3
    python benchmarks/gpu_e2e.py --device cpu --model tiny --lengths 512 --batches 1 2 --backends torch_ref offload
                                 # CPU smoke run of every code path (tiny random model)

Model: random weights of the Llama-3.1-8B shape (32 layers, hidden 4096, 32 q / 8 kv heads, d 128,
MLP 14336, vocab 128256, untied head, RoPE theta 500000 without llama3 scaling so SAAP's
default-RoPE check holds; the timing does not depend on it), built on the device with transformers'
LlamaConfig in bf16 (no download), attention implementation `ctxcache`. Context: N random token ids,
prefilled on the device by the same model (`prefill_layer_major`: layer by layer over all N tokens,
the runner's own layer functions and flash SDPA, exact causal attention; checked against
`decoder.prefill.prefill` at 256 tokens with --check-prefill) so the K/V are the model's own; each
method's index is built from that capture on the device, one layer at a time (kivf's faiss k-means
runs on the CPU at ~24 s per layer at 128K, so by default its index is built from layer 0 and served
to every layer: same shapes and widths, `index_layers` 1 in the row; --tile-index with no names builds all).
SAAP gets a model in its on-disk format with k-means on this model's de-RoPE'd keys and a classifier
at random init (tests/synthetic.py's writer): C 1024, hidden 1024, nprobe 32.

Rows (one per n, batch, runner, method, backend), written to $OUT/gpu_e2e.json after each one:
* `transformers_eager`: today's path, `decoder.generate.generate` with `full` and the backend
  (triton); B = 1 measured; the B = 8 row is derived (the decode worker serves requests one after
  another: each request gets the B = 1 rate, so ms/token = 8 x B = 1's and tokens/s are B = 1's).
* `runner_graph`: `decoder.runner.Runner`, B requests on the one context (each with its own
  planner), one-token steps replayed from a CUDA graph (`graph` says what happened); ms_per_token =
  median wall time between consecutive step() calls returning, back to back (each returns once its
  tokens are read, as a server streams them; every request gets one token per call), tokens_per_s =
  B x 1000 / ms_per_token; ms_wall_mean = the timed calls' mean including the wait for a step left in
  flight. `pipelined` (--pipelined, the runner's default on CUDA): each call issues the next step
  before reading its tokens. Before 2026-11-28 (session 17) each timed step was preceded by a device
  sync, which for the runner without pipelining measured the same thing.
* `runner_eager` (B = 1, --eager-tokens): the same runner with graphs off.
* backend `offload` (--offload-methods x --offload-batches): the same graph runner with the context's
  K/V pinned in host memory and read in place by the kernels (`decoder/backends/offload.py`), index
  arrays on the GPU. The B requests share one host context, as the other rows share one GPU context
  (eight distinct 128K contexts, 17 GB each, fit neither this GPU nor the device's host memory);
  each request still reads its own rows over PCIe.
* floor_ms: bytes one step must read / measured HBM copy bandwidth: the weights (every matrix and
  the lm_head, not the embedding table; 15.0 GB for the 8B shape) + for each request the K/V rows it
  attends (kv_fraction, the fraction of visible rows read, measured on the warm-up step x
  (n + request tokens) x layers x kv heads x d x 2 (K, V) x 2 bytes). Index reads are not counted.
  Offload rows also give pcie_floor_ms (the K/V rows over the measured pinned H2D bandwidth).

Budgets as in gpu_decode.py: csattn alpha 0.1 rho 5%, ctkvr k 1024 lists 2560, kivf / lfps 5%, psa
eps 0.95 capped at 10% of the blocks, saap nprobe 32. A method argument "name@param=value,..." runs
another operating point in the same run (e.g. psa@max_ratio=0.05: psa capped at rho), its rows
labelled so (`benchmarks/_gpu_timing.method_spec`). Rows planned ahead (--plan-ahead on) plan with
that budget × --ahead-widen (`MethodParams.widened`; default 1.5, the service's `plan_ahead_widen`;
from 2026-11-29, session 22: earlier plan-ahead rows used the row's own params); the offload
plan-ahead rows keep their own. Question 16 tokens; 16 timed steps after
the question, one eager warm-up step and the capture. --budget-s stops starting new measurements
after that many seconds (rows are saved as they come), so one call survives a 10-minute limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import platform
import statistics
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
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks._gpu_timing import kernel_profile, method_spec, stream_overlap  # noqa: E402
from decoder import host_memory  # noqa: E402
from decoder.backends import get_backend  # noqa: E402
from decoder.backends.offload import mapped  # noqa: E402
from decoder.generate import ContextKV, generate  # noqa: E402
from indexer.rope import undo_rope  # noqa: E402
from decoder.layers import apply_rope, mlp, rms_norm, rope_cos_sin  # noqa: E402
from decoder.runner import Runner  # noqa: E402
from decoder.weights import ModelWeights, fuse_weights  # noqa: E402
from indexer.base import DecodeContext, IndexReader, Plan, Planner, PrefillCapture, get_method  # noqa: E402

MODELS = {  # name -> LlamaConfig fields
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, max_position_embeddings=1 << 20),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=1 << 20),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1024, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, max_position_embeddings=1 << 20),
}
METHOD_PARAMS = {  # the same operating points as benchmarks/gpu_decode.py
    "full": {}, "topk": {"ratio": 0.05}, "streaming": {},
    "csattn": {"alpha": 0.1, "rho": 0.05},
    "ctkvr": {"k": 1024, "list_size": 2560},
    "kivf": {"ratio": 0.05},
    "lfps": {"ratio": 0.05},
    "psa": {"eps": 0.95, "max_ratio": 0.1},
    "saap": {"nprobe": 32},
}
NEEDS_Q = {"csattn", "ctkvr", "lfps"}  # builds that read the prefill queries


def backend_of(spec: str):
    """A registered backend by name, or "triton:knob=value,..." for the triton backend with `KernelConfig`
    knobs changed (A/B rows in one run, as gpu_decode.py's --backends)."""
    if ":" not in spec:
        return get_backend(spec)
    from benchmarks.gpu_decode import backend_for

    return backend_for(spec)


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# Model, prefill, indexes


def build_model(name: str, layers: int | None, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoder.attention import ATTN_IMPLEMENTATION, register_attention
    from decoder.model import LoadedModel
    from synthetic import model_spec

    register_attention()
    fields = dict(MODELS[name])
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = LlamaConfig(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype).eval()
    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    spec = dataclasses.replace(
        model_spec(cfg.num_hidden_layers, h, kvh, cfg.hidden_size // h, fields["rope_theta"], f"random-{name}"),
        dtype=str(dtype).removeprefix("torch."))
    return LoadedModel(spec=spec, tokenizer=None, model=model, eos_token_ids=())


@torch.inference_mode()
def prefill_layer_major(w: ModelWeights, ids: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                        on_layer=None, chunk: int = 8192) -> None:
    """One exact causal forward over ids [N], layer by layer: K/V (post-RoPE) into ctx_k/ctx_v
    [L, KVH, N, D]; on_layer(layer, q [H, N, D]) sees each layer's queries. Dense parts in chunks
    of `chunk` tokens, attention per kv head with flash SDPA over all N (is_causal)."""
    n = ids.shape[0]
    h, kvh, d, g = w.n_heads, w.n_kv_heads, w.head_dim, w.group
    x = F.embedding(ids, w.embed)  # [N, C]
    cos, sin = rope_cos_sin(torch.arange(n, device=ids.device), w.inv_freq, w.rope_scaling, x.dtype)  # [N, D]
    q = torch.empty(h, n, d, dtype=x.dtype, device=x.device)
    o = torch.empty(n, h * d, dtype=x.dtype, device=x.device)
    for layer, lw in enumerate(w.layers):
        k, v = ctx_k[layer], ctx_v[layer]  # [KVH, N, D] written in place
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            qkv = F.linear(rms_norm(x[s:e], lw.ln1, w.eps), lw.wqkv, lw.bqkv)
            qc, kc, vc = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            q[:, s:e] = apply_rope(qc.view(-1, h, d), cos[s:e], sin[s:e]).transpose(0, 1)
            k[:, s:e] = apply_rope(kc.view(-1, kvh, d), cos[s:e], sin[s:e]).transpose(0, 1)
            v[:, s:e] = vc.view(-1, kvh, d).transpose(0, 1)
        for j in range(kvh):  # q heads j*G .. j*G+G-1 read kv head j
            kj = k[j:j + 1].expand(g, n, d).contiguous()[None]
            vj = v[j:j + 1].expand(g, n, d).contiguous()[None]
            out = F.scaled_dot_product_attention(q[None, j * g:(j + 1) * g], kj, vj, is_causal=True, scale=lw.scale)
            o[:, j * g * d:(j + 1) * g * d] = out[0].transpose(0, 1).reshape(n, g * d)
            del kj, vj, out
        if on_layer is not None:
            on_layer(layer, q)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            xs = x[s:e] + F.linear(o[s:e], lw.wo, lw.bo)
            x[s:e] = xs + mlp(rms_norm(xs, lw.ln2, w.eps), lw)


def check_prefill(lm, w: ModelWeights, device: str, n: int = 256) -> float:
    """Relative error of prefill_layer_major's K against decoder.prefill.prefill (the HF forward)."""
    from decoder.prefill import prefill

    ids = torch.randint(0, lm.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(5))
    ref = prefill(lm, ids.tolist(), keep_q=False).k.float()
    k = torch.empty(len(w.layers), w.n_kv_heads, n, w.head_dim, dtype=w.embed.dtype, device=device)
    v = torch.empty_like(k)
    prefill_layer_major(w, ids.to(device), k, v)
    return float((k.float().cpu() - ref).norm() / ref.norm())


class RealKeys:
    """What tests/synthetic.write_saap_model samples from: here the de-RoPE'd keys of the captured
    context, one layer per call (in the order the writer asks for them)."""

    def __init__(self, ctx_k: torch.Tensor, theta: float, layers: list[int]):
        self.ctx_k, self.theta, self.device = ctx_k, theta, ctx_k.device
        self._layers = iter(layers)

    def sample(self, n: int, g: torch.Generator, heads=None) -> torch.Tensor:
        layer = next(self._layers)
        pos = torch.randint(0, self.ctx_k.shape[2], (n,), device=self.device, generator=g)
        return undo_rope(self.ctx_k[layer][:, pos].float(), pos, self.theta)  # [KVH, n, D]


def method_params(name: str, saap_dir: Path | None, overrides: dict | None = None):
    """The method and its operating point (METHOD_PARAMS), `overrides` on top ("psa@max_ratio=0.05":
    `method_spec`)."""
    m = get_method(name)
    kw = dict(METHOD_PARAMS.get(name, {}))
    if name == "saap":
        kw["model_dir"] = str(saap_dir)
    for k in list(kw):
        if k not in m.Params.model_fields:
            kw.pop(k)
    return m, m.Params(**{**kw, **(overrides or {})})  # an unknown override is an error, not dropped


def build_index(method, params, spec, ctx_k, ctx_v, q_host, positions, tile: bool, device):
    """Per-layer index arrays on `device` (list over layers of {name: tensor}); built one layer at
    a time from a one-layer capture (SAAP: from all layers at once, it maps capture layer i to its
    model's layer i). tile: layer 0's arrays for every layer."""
    L = ctx_k.shape[0]
    if method.name == "saap":
        arrays = method.build(PrefillCapture(None, ctx_k, ctx_v, positions, spec), params)
        return [{k: v[i].to(device) for k, v in arrays.items()} for i in range(L)]
    out = []
    for layer in range(1 if tile else L):
        q = None if q_host is None else q_host[layer:layer + 1].to(ctx_k.device)
        cap = PrefillCapture(q, ctx_k[layer:layer + 1], ctx_v[layer:layer + 1], positions, spec)
        arrays = method.build(cap, params)
        out.append({k: v[0].to(device) for k, v in arrays.items()})
        del q, cap, arrays
    return out * L if tile else out


# ---------------------------------------------------------------------------------------------
# Measurements


class Bench:
    def __init__(self, args, lm, w: ModelWeights, info: dict, out: Path):
        self.a, self.lm, self.w, self.info, self.out = args, lm, w, info, out
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        self.dev = torch.device(args.device)

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.a.budget_s

    def add(self, row: dict) -> None:
        self.rows.append(row)
        (self.out / "gpu_e2e.json").write_text(json.dumps({"info": self.info, "rows": self.rows}, indent=1))
        ms, tps, fl = row.get("ms_per_token"), row.get("tokens_per_s"), row.get("floor_ms")
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        log(f"  n={row['n']} B={row['batch']} {row['runner']:18s} {row['method']:8s} {row.get('backend', ''):9s} "
            f"{f(ms)} ms/token  {f(tps)} tok/s  floor {f(fl)} ms  {row.get('graph') or ''} {row.get('error') or ''}"
            f"{'' if row.get('fused_layer', True) else ' (torch layer ops)'}")

    def floor(self, n: int, b: int, frac: float, local: int) -> tuple[float, float]:
        """(HBM floor ms, K/V bytes) of one step of b requests reading `frac` of n + local rows."""
        w = self.w
        kv_bytes = frac * (n + local) * len(w.layers) * w.n_kv_heads * w.head_dim * 2 * w.embed.element_size() * b
        return (self.info["weight_bytes"] + kv_bytes) / self.info["hbm_bytes_per_s"] * 1e3, kv_bytes

    def questions(self, b: int, seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, self.w.embed.shape[0], (self.a.question,), generator=g).tolist() for _ in range(b)]

    def hf(self, n: int, ctx: ContextKV, backend_name: str) -> None:
        """transformers eager: generate() with full attention, B = 1 (and the derived serial B rows)."""
        full = get_method("full")
        params = full.Params()
        be = backend_of(backend_name)
        (q,) = self.questions(1, n)
        k = self.a.hf_tokens
        generate(self.lm, ctx, full.open(None, params, DecodeContext(n, self.lm.spec, len(q) + 2)), params, q,
                 backend=be, max_tokens=2)  # warm-up: kernels of T = len(q) and T = 1
        res = generate(self.lm, ctx, full.open(None, params, DecodeContext(n, self.lm.spec, len(q) + k)), params, q,
                       backend=be, max_tokens=k)
        ms = res.decode_s * 1e3 / max(len(res.token_ids) - 1, 1)
        for b in self.a.batches:
            fl, _ = self.floor(n, 1, 1.0, len(q) + k)
            self.add({"n": n, "batch": b, "runner": "transformers_eager", "method": "full", "backend": backend_name,
                      "ms_per_token": ms * b, "tokens_per_s": 1e3 / ms, "floor_ms": fl * b, "kv_fraction": 1.0,
                      "ttft_ms": res.ttft_s * 1e3, "derived_from_b1": b != 1,
                      "note": None if b == 1 else f"{b} requests served one after another (the decode worker today)"})

    def runner(self, n: int, ctx: ContextKV, name: str, method, params, reader, backend_name: str, b: int,
               graphs: bool, tokens: int, extra: dict, fused_layer: bool | None = None,
               contexts: str | None = None, plan_ahead: bool = False, pipelined: bool = True,
               parallel: bool = True, programs_per_sm: int | None = None, stage_values: bool | None = None,
               cache_rows: bool | None = None, plan_overlap: float | None = None) -> None:
        be = backend_of(backend_name)
        if programs_per_sm is not None:  # the attention kernel's launch: programs per SM it aims at
            from decoder.kernels.attention import KernelConfig
            be = type(be)(KernelConfig(programs_per_sm=programs_per_sm))
        qs = self.questions(b, n + b)
        prof_steps = 4 if self.a.profile and graphs and b in self.a.profile_batches else 0
        max_new = tokens + 4 + prof_steps  # + 1: the last timed step still issues the next (pipelined)
        local = self.a.question + max_new
        run = Runner(self.lm, be, self.dev, graphs=graphs, track_fraction=True, fused_layer=fused_layer,
                     plan_ahead=plan_ahead, pipelined=pipelined, parallel=parallel, stage_values=stage_values,
                     cache_rows=cache_rows)
        if plan_ahead and self.a.ahead_priority and self.dev == "cuda":  # planning (and staging) streams first
            run.ahead_streams = [torch.cuda.Stream(self.dev, priority=self.a.ahead_priority) for _ in range(2)]
            run.ahead_side = [[torch.cuda.Stream(self.dev, priority=self.a.ahead_priority) for _ in range(b)]
                              for _ in range(2)]
        if contexts is None:  # B = 1 shares the context it was given, except an offload row in "copies" mode,
            # which was given the GPU-resident context and must copy it to where the backend keeps it
            copies = be.host_arrays and self.a.offload_contexts == "copies"
            contexts = "copies" if copies else "shared" if b == 1 else \
                self.a.offload_contexts if be.host_arrays else self.a.contexts
        for j, q in enumerate(qs):
            c, rd = (ctx, reader) if contexts == "shared" else rotated(ctx, reader, j, len(self.w.layers))
            if contexts == "copies":
                try:
                    c = own_copy(c, be.host_arrays, len(self.w.layers))
                except torch.OutOfMemoryError:
                    del run, c
                    self.add({"n": n, "batch": b, "runner": "runner_graph", "method": name, "backend": backend_name,
                              "contexts": contexts, "error": f"does not fit: {j} of {b} context copies placed"})
                    return
            planner = method.open(rd, params, DecodeContext(n, self.lm.spec, local))
            if plan_overlap is not None:
                planner = OverlappingPlans(planner, plan_overlap)
            run.add(c, planner, params, q, max_new)
        t0 = time.perf_counter()
        run.step()  # the questions, one chunk per request
        t_prompt = time.perf_counter() - t0
        before = [(r.touched.clone(), r.counted) for r in run.requests.values()]
        t0 = time.perf_counter()
        run.step()  # eager warm-up step: kernels of T = 1 compile, lazy planner state, the K/V fraction
        t_warm = time.perf_counter() - t0
        fracs = [float((r.touched - t).sum()) / ((r.counted - c) * len(self.w.layers))
                 for r, (t, c) in zip(run.requests.values(), before)]
        frac = sum(fracs) / len(fracs)
        run.track_fraction = False
        t0 = time.perf_counter()
        run.step()  # captured (graphs) or eager
        t_first = time.perf_counter() - t0
        first_status = run.graph_status
        times = []  # one step() call each: it returns once its tokens are read, as a server streams them
        self.sync()
        t_start = t_last = time.perf_counter()
        for _ in range(tokens):
            run.step()
            now = time.perf_counter()
            times.append((now - t_last) * 1e3)
            t_last = now
        self.sync()  # a pipelined runner has the next step in flight: the mean waits for it too
        wall_mean = (time.perf_counter() - t_start) * 1e3 / tokens
        status = run.graph_status
        prof = None
        if prof_steps:  # the kernels of a replayed step (CUPTI reports a graph's kernels one by one)
            try:
                prof = kernel_profile(run.step, reps=prof_steps - 3, sync=self.sync)
                prof["top"] = prof["top"][:40]
            except Exception as e:  # noqa: BLE001 - extra information only
                prof = {"error": f"{type(e).__name__}: {e}"[:200]}
            log(f"    profile {name} B={b}: {prof.get('kernels_per_call', 0):.0f} kernels, "
                f"{prof.get('device_us_per_call', 0) / 1e3:.2f} ms of device time per token; top {prof.get('top', [])[:6]}")
            try:  # how the replayed step's streams overlap (plan_ahead's side streams)
                prof["overlap"] = stream_overlap(run.step, sync=self.sync)
                log(f"    overlap {name} B={b} plan_ahead={plan_ahead}: "
                    f"{ {k: v for k, v in prof['overlap'].items() if k != 'streams'} }")
            except Exception as e:  # noqa: BLE001 - extra information only
                prof["overlap"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        hits, rows = (sum(x) for x in zip(*(r.cache_counts() for r in run.requests.values())))
        for s in list(run.requests):
            run.remove(s)
        ms = statistics.median(times)
        fl, kv_bytes = self.floor(n, b, frac, local)
        row = {"n": n, "batch": b, "runner": "runner_graph" if graphs else "runner_eager", "method": name,
               "backend": backend_name, "ms_per_token": ms, "tokens_per_s": b * 1e3 / ms, "floor_ms": fl,
               "ms_mean": statistics.fmean(times), "ms_max": max(times), "steps_timed": len(times),
               "kv_fraction": frac, "graph": status, "first_step": first_status, "prompt_ms": t_prompt * 1e3,
               "warmup_ms": t_warm * 1e3, "capture_or_first_ms": t_first * 1e3,
               "fused_layer": run.layer_kernels is not None, "contexts": contexts, "plan_ahead": plan_ahead,
               "pipelined": run.pipelined, "ms_wall_mean": wall_mean, "parallel": run.parallel,
               "programs_per_sm": programs_per_sm,  # None: KernelConfig's default
               "stage_values": run.stage_values and plan_ahead, "ahead_priority": self.a.ahead_priority if plan_ahead else None,
               "cache_rows": run.cache_rows, "cache_hit_rate": hits / rows if rows else None,
               "plan_overlap": plan_overlap, **extra}
        if prof is not None:
            row["profile"] = prof
        host = backend_of(backend_name).host_arrays
        if host:  # the offload backends: the share of the K/V rows read from host memory, over PCIe
            row["pcie_floor_ms"] = kv_bytes * len(host) / 2 / self.info["h2d_bytes_per_s"] * 1e3
        self.add(row)
        if contexts == "copies":  # hand the copies' host memory back before the next row pins its own
            del run, c
            gc.collect()


class OverlappingPlans(Planner):
    """Benchmark only (`--plan-overlap F`): `inner`'s one-token plans with the first F share of
    every KV head's slots holding the positions the layer's first one-token plan put there, so that
    consecutive plans share at least that share of their rows. On the default model consecutive
    plans share 67-81% of their rows (`benchmarks/bench_value_reuse.py`); on this script's random
    weights ctkvr's share ~1% at 128K (chance), so the row cache (`Runner(cache_rows=...)`) would
    be timed at a hit rate no real model has. The plan's work is the inner planner's; the rows
    attended differ (a pinned slot may repeat a position the inner plan also chose: the attention
    counts it twice), so the tokens are not the method's: time only."""

    def __init__(self, inner: Planner, overlap: float):
        self.inner, self.overlap = inner, overlap
        self.graph_safe, self.reads_query = inner.graph_safe, inner.reads_query
        self.first: dict[int, torch.Tensor] = {}  # layer -> [KVH, 1, m], made in the eager warm-up step

    def plan(self, layer, q, kv):
        plan = self.inner.plan(layer, q, kv)
        if q.shape[2] != 1 or plan.is_dense:
            return plan
        m = int(plan.positions.shape[-1] * self.overlap)
        if layer not in self.first:
            self.first[layer] = plan.positions[..., :m].clone()
        pos = plan.positions.clone()
        pos[..., :m] = self.first[layer]
        return Plan(pos, plan.bypass, plan.rest_logit, plan.rest_value, plan.lengths, plan.attended)

    def update(self, layer, k, v, positions):
        self.inner.update(layer, k, v, positions)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self.inner.close()


def rotated(ctx: ContextKV, reader: IndexReader | None, j: int, n_layers: int) -> tuple[ContextKV, IndexReader | None]:
    """Request j's own context: its layer l is layer (l + j) mod L of `ctx`, with that layer's index
    arrays. Within a layer the B requests then read B different layers' bytes, as B distinct
    contexts would (no request finds another's rows in the L2), at the same work per request,
    without B prefills or B copies (eight distinct 128K contexts hold 137 GB of K/V)."""
    def src(layer: int) -> int:
        return (layer + j) % n_layers

    c = ContextKV(ctx.n_tokens, lambda nm, layer: ctx.layer(src(layer))[0 if nm == "kv/k" else 1])
    if reader is None:
        return c, None
    return c, IndexReader(lambda nm, layer: reader.layer(nm, src(layer)), reader.names)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """t copied into pinned host memory, as the service pins it (plain host memory on a CPU smoke run)."""
    return host_memory.pinned_copy(t) if t.is_cuda else t.clone()


def own_copy(ctx: ContextKV, host_arrays: frozenset[str], n_layers: int) -> ContextKV:
    """A request's own copy of `ctx` where the backend keeps it: the arrays in `host_arrays` as pinned
    host copies (mapped), the rest as GPU copies. Raises torch.OutOfMemoryError when the GPU (or
    the pinned host allocator) cannot hold it: a batch of distinct contexts that does not fit."""
    layers = []
    for layer in range(n_layers):
        pair = []
        for name, t in zip(("kv/k", "kv/v"), ctx.layer(layer)):
            if name in host_arrays:
                pair.append(mapped(pinned_copy(t)) if t.is_cuda else pinned_copy(t))
            else:
                pair.append(t.clone())
        layers.append(pair)
    return ContextKV(ctx.n_tokens, lambda nm, layer: layers[layer][0 if nm == "kv/k" else 1])


def host_context(arrays: dict[str, torch.Tensor], host_arrays: frozenset[str], copies: dict, dev: str) -> ContextKV:
    """The context (`arrays`: "kv/k", "kv/v" -> [L, KVH, N, D] on the GPU) as an offload backend serves
    it: the arrays in `host_arrays` pinned in host memory, one allocation per layer (a power of two
    bytes at 128K, which the pinned allocator does not round up), and mapped into the GPU's kernels;
    the rest and the index arrays stay on the GPU. `copies` keeps the host copies of this context, so
    one serves every offload backend."""
    views = {}
    for name, src in arrays.items():
        if name not in host_arrays:
            views[name] = list(src)
            continue
        if name not in copies:
            copies[name] = [pinned_copy(x) for x in src]
        views[name] = [mapped(h) if dev == "cuda" else h for h in copies[name]]
    return ContextKV(arrays["kv/k"].shape[2], lambda nm, layer: views[nm][layer])


def bandwidths(device: str) -> tuple[float, float]:
    """(device copy bytes/s counting read + write, pinned host->device bytes/s)."""
    if device != "cuda":
        return 20e9, 10e9  # a CPU smoke run: nominal numbers, the floors mean nothing there
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    h = torch.empty(1 << 28, dtype=torch.uint8, pin_memory=True)

    def med(fn, reps=10):
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts)

    y.copy_(x)
    hbm = 2 * x.numel() / med(lambda: y.copy_(x))
    h2d = h.numel() / med(lambda: x[:h.numel()].copy_(h, non_blocking=True))
    return hbm, h2d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--methods", nargs="+", default=["hf", "full", "csattn", "ctkvr", "kivf", "saap", "psa", "lfps"],
                    help="'hf' = transformers eager (generate + full); the rest run in the runner")
    ap.add_argument("--backends", nargs="+", default=None, help="default: triton on CUDA, torch_ref on CPU")
    ap.add_argument("--offload-batches", type=int, nargs="+", default=[8], help="batches of the offload backend's rows")
    ap.add_argument("--offload-parallel", nargs="+", choices=["off", "on"], default=["on"],
                    help="offload rows (copies mode): each request's attention on its own stream (on, the runner's "
                         "default) or one after another on the step's stream (off)")
    ap.add_argument("--offload-plan-ahead", nargs="+", default=["off-cached"],
                    choices=["off", "off-cached", "on", "on-cached", "staged"],
                    help="offload rows (copies mode): plan_ahead off or on, the attention reading host memory, "
                         "or (-cached) reading the rows of each layer's last plans from its row cache (cache_rows; "
                         "off-cached is the runner's default); staged: plan_ahead with each plan's value rows "
                         "staged into the row cache during the layer before (stage_values)")
    ap.add_argument("--plan-overlap", type=float, nargs="+", default=[None],
                    help="offload rows (copies mode): pin this share of each one-token plan's slots to the layer's "
                         "first plan (OverlappingPlans: time only, the real model's consecutive plans overlap)")
    ap.add_argument("--ahead-priority", type=int, default=0,
                    help="plan_ahead rows: CUDA priority of the planning side streams (negative = higher)")
    ap.add_argument("--offload-programs-per-sm", type=int, nargs="+", default=[None],
                    help="offload rows (copies mode): the attention kernel's programs per SM (KernelConfig)")
    ap.add_argument("--offload-methods", nargs="+", default=["csattn", "saap", "psa", "ctkvr"],
                    help="methods that get offload rows when the offload backend is asked for")
    ap.add_argument("--tokens", type=int, default=16, help="timed one-token steps per row")
    ap.add_argument("--pipelined", nargs="+", choices=["off", "on"], default=["on"],
                    help="graph rows with the runner issuing each step before reading the last one's tokens "
                         "(on: the runner's default on CUDA), without (off), or both (rows say pipelined)")
    ap.add_argument("--plan-ahead", nargs="+", choices=["off", "on"], default=["off"],
                    help="graph rows of the sparse methods with the runner's plan_ahead too (rows say plan_ahead)")
    ap.add_argument("--ahead-widen", type=float, nargs="+", default=[1.5],
                    help="plan_ahead rows: the method's budget this many times as wide (MethodParams.widened, as the "
                         "service's plan_ahead_widen, default 1.5; 1 = the row's own params); rows say ahead_widen")
    ap.add_argument("--contexts", choices=["distinct", "shared", "copies"], default="distinct",
                    help="B > 1: each request on its own context (layers rotated, see rotated()), all on one, or "
                         "each on its own copy of its rotated context (own_copy(): the memory of B distinct contexts)")
    ap.add_argument("--fit-check", action="store_true",
                    help="also run each GPU-resident B > 1 row on B context copies (a row, or a does-not-fit row)")
    ap.add_argument("--offload-contexts", choices=["distinct", "shared", "copies"], default="distinct",
                    help="--contexts for the offload backends' rows")
    ap.add_argument("--eager-tokens", type=int, default=4, help="timed steps of the eager runner at B = 1 (0: off)")
    ap.add_argument("--hf-tokens", type=int, default=8)
    ap.add_argument("--question", type=int, default=16)
    ap.add_argument("--model", default="llama8b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's (smoke runs)")
    ap.add_argument("--tile-index", nargs="*", default=["kivf"], help="methods whose index is built from layer 0 only")
    ap.add_argument("--check-prefill", type=int, default=256,
                    help="compare the prefill with the HF one at this n (0: off)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no new measurement after this many seconds")
    ap.add_argument("--profile", action="store_true", help="kernels of one replayed step per method, at the "
                    "batch sizes of --profile-batches")
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[1], help="batch sizes --profile profiles")
    ap.add_argument("--layer-ab", action="store_true",
                    help="also time each runner row with the fused layer ops off (torch RMSNorm/RoPE/SiLU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = a.device
    backends = a.backends or (["triton"] if dev == "cuda" else ["torch_ref"])
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    lm = build_model(a.model, a.layers, dev, dtype)
    w = fuse_weights(lm.model)
    hbm, h2d = bandwidths(dev)
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor(),
            "model": a.model, "layers": len(w.layers), "dtype": str(dtype), "weight_bytes": w.read_bytes(),
            "hbm_bytes_per_s": hbm, "h2d_bytes_per_s": h2d, "args": vars(a),
            "model_build_s": time.perf_counter() - t_start}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if a.check_prefill:
        info["prefill_check_rel_err"] = check_prefill(lm, w, dev, a.check_prefill)
    log(json.dumps(info))
    bench = Bench(a, lm, w, info, out)
    spec = lm.spec
    L, kvh, d = len(w.layers), w.n_kv_heads, w.head_dim
    with torch.inference_mode(), tempfile.TemporaryDirectory() as tmp:
        for n in a.lengths:
            if bench.over_budget():
                log(f"time budget spent: n={n} not run")
                break
            ids = torch.randint(0, w.embed.shape[0], (n,), device=dev, generator=torch.Generator(dev).manual_seed(n))
            ctx_k = torch.empty(L, kvh, n, d, dtype=dtype, device=dev)
            ctx_v = torch.empty_like(ctx_k)
            need_q = any(m in NEEDS_Q for m in a.methods)
            q_host = torch.empty(L, w.n_heads, n, d, dtype=dtype) if need_q else None

            def keep_q(layer, q, q_host=q_host):
                if q_host is not None:
                    q_host[layer].copy_(q)

            bench.sync()
            t0 = time.perf_counter()
            prefill_layer_major(w, ids, ctx_k, ctx_v, keep_q)
            bench.sync()
            t_prefill = time.perf_counter() - t0
            log(f"n={n}: prefill {t_prefill:.1f} s ({n / t_prefill:.0f} tokens/s)")
            info.setdefault("prefill_s", {})[str(n)] = t_prefill
            positions = torch.arange(n, device=dev)
            ctx = ContextKV(n, lambda name, layer, k=ctx_k, v=ctx_v: (k if name == "kv/k" else v)[layer])
            host_ctx: dict[str, ContextKV] = {}  # offload backend -> its view of the host copies
            host_copy: dict[str, list[torch.Tensor]] = {}  # "kv/k" / "kv/v" -> per-layer pinned copies
            on_host = [be for be in backends if backend_of(be).host_arrays]
            for label in a.methods:  # "name" or "name@param=value,..." (rows keep the label)
                name, overrides, knobs = method_spec(label)
                if knobs:
                    raise SystemExit(f"{label!r}: gpu_e2e.py takes parameter variants (name@param=value), "
                                     "not kernel knobs (gpu_decode.py does)")
                per_layer = reader = None
                if bench.over_budget():
                    bench.add({"n": n, "batch": None, "runner": "-", "method": label, "error": "skipped: time budget"})
                    continue
                try:
                    if name == "hf":
                        for be in backends:
                            if be not in on_host:
                                bench.hf(n, ctx, be)
                        continue
                    method, params = method_params(name, Path(tmp) / "saap", overrides)
                    if name == "saap" and not (Path(tmp) / "saap" / "manifest.json").exists():
                        from synthetic import write_saap_model

                        big = a.model == "llama8b"
                        layers = list(range(1, L))  # layer 0 stays dense (SAAP's rule)
                        write_saap_model(Path(tmp) / "saap", spec, RealKeys(ctx_k, spec.rope_theta, layers),
                                         layers=layers, clusters=1024 if big else 32, hidden=1024 if big else 64,
                                         sample=65536 if big else min(n, 4096))
                    reasons = method.validate_configuration(spec, params)
                    if reasons:
                        raise ValueError("; ".join(reasons))
                    tile = name in (a.tile_index or [])
                    bench.sync()
                    t0 = time.perf_counter()
                    per_layer = build_index(method, params, spec, ctx_k, ctx_v, q_host, positions, tile, dev) \
                        if method.has_index else None
                    bench.sync()
                    build_s = time.perf_counter() - t0
                    extra = {"build_s": build_s, "index_layers": 1 if tile else L, "prefill_s": t_prefill}
                    if per_layer is not None:
                        extra["index_bytes"] = sum(v.numel() * v.element_size() for v in per_layer[0].values()) * L
                    log(f"  {label}: index built in {build_s:.1f} s")
                    reader = None if per_layer is None else IndexReader(lambda nm, l, p=per_layer: p[l][nm],
                                                                        sorted(per_layer[0]))
                    for be in backends:
                        if be in on_host:
                            continue
                        for b in a.batches:
                            if bench.over_budget():
                                break
                            for pl in a.pipelined:
                                on = pl == "on"
                                for fl in ((None, False) if a.layer_ab else (None,)):
                                    bench.runner(n, ctx, label, method, params, reader, be, b, True, a.tokens, extra,
                                                 fl, pipelined=on)
                                for wide in a.ahead_widen if "on" in a.plan_ahead and name not in ("full", "streaming") \
                                        else ():
                                    if not bench.over_budget():
                                        bench.runner(n, ctx, label, method, params.widened(wide), reader, be, b, True,
                                                     a.tokens, {**extra, "ahead_widen": wide}, plan_ahead=True,
                                                     pipelined=on)
                            if a.fit_check and b > 1 and not bench.over_budget():  # B copies: do they fit?
                                bench.runner(n, ctx, label, method, params, reader, be, b, True, a.tokens, extra,
                                             contexts="copies")
                            if b == 1 and a.eager_tokens and not bench.over_budget():
                                bench.runner(n, ctx, label, method, params, reader, be, b, False, a.eager_tokens, extra)
                    for be in on_host if name in a.offload_methods else ():
                        if a.offload_contexts == "copies":  # each request copies its own context from the GPU's
                            for b, ov, ahead, par, pps in itertools.product(
                                    a.offload_batches, a.plan_overlap, a.offload_plan_ahead, a.offload_parallel,
                                    a.offload_programs_per_sm):
                                if not bench.over_budget():
                                    bench.runner(n, ctx, label, method, params, reader, be, b, True, a.tokens, extra,
                                                 parallel=par == "on", programs_per_sm=pps,
                                                 plan_ahead=ahead not in ("off", "off-cached"),
                                                 stage_values=ahead == "staged",
                                                 cache_rows=ahead in ("off-cached", "on-cached", "staged"),
                                                 plan_overlap=ov)
                            continue
                        if be not in host_ctx:
                            host_ctx[be] = host_context({"kv/k": ctx_k, "kv/v": ctx_v}, backend_of(be).host_arrays,
                                                        host_copy, dev)
                        for b in a.offload_batches:
                            if not bench.over_budget():
                                bench.runner(n, host_ctx[be], label, method, params, reader, be, b, True, a.tokens,
                                             extra)
                except Exception as e:  # noqa: BLE001 - one method failing must not hide the others' numbers
                    traceback.print_exc()
                    bench.add({"n": n, "batch": None, "runner": "-", "method": label,
                               "error": f"{type(e).__name__}: {str(e)[:300]}"})
                del per_layer, reader
                if dev == "cuda":
                    torch.cuda.empty_cache()
            del ctx_k, ctx_v, q_host, ctx, host_ctx, host_copy
            if dev == "cuda":
                torch.cuda.empty_cache()
    print("\n| n | B | runner | method | backend | ms/token | tokens/s | HBM floor ms | x floor | KV fraction "
          "| graph |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in bench.rows:
        if "error" in r:
            continue
        f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        ratio = None if not r.get("floor_ms") else r["ms_per_token"] / r["floor_ms"]
        fl = "" if r.get("fused_layer", True) else " (torch layer ops)"
        if r.get("plan_ahead"):
            fl += f" (plan ahead, budget ×{r['ahead_widen']:g})" if r.get("ahead_widen", 1) != 1 else " (plan ahead)"
        if r.get("pipelined") is False and r["runner"] == "runner_graph":
            fl += " (not pipelined)"
        if r.get("parallel") is False and r.get("batch", 1) > 1:
            fl += " (attention serial)"
        if r.get("stage_values"):
            fl += " (staged values)"
        if r.get("plan_overlap") is not None:
            fl += f" (plans {100 * r['plan_overlap']:.0f}% pinned)"
        if r.get("cache_rows"):
            fl += f" (row cache, {100 * (r.get('cache_hit_rate') or 0):.0f}% hits)"
        if r.get("ahead_priority"):
            fl += f" (side priority {r['ahead_priority']})"
        if r.get("programs_per_sm") is not None:
            fl += f" ({r['programs_per_sm']} programs/SM)"
        print(f"| {r['n']} | {r['batch']} | {r['runner']}{fl} | {r['method']} | {r['backend']} | {f(r['ms_per_token'])} | "
              f"{f(r['tokens_per_s'], 1)} | {f(r['floor_ms'])} | {f(ratio, 1)} | {f(r.get('kv_fraction'), 3)} | "
              f"{r.get('graph') or ('derived' if r.get('derived_from_b1') else '')} |")
    for r in bench.rows:
        if "error" in r:
            print(f"ERROR n={r['n']} {r['method']}: {r['error']}")


if __name__ == "__main__":
    main()
