"""SAAP training on a GPU: the `full` preset through the real `train_saap`, timed, with this
machine's CPU on the same pieces for the ratio.

The default model (98 MB GGUF) does not travel to the device machine, so the LM is a random-weight
LlamaForCausalLM of SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads, head_dim 64,
intermediate 1536, rope_theta 1e5, vocab 49152, 8,192 positions; `tests/test_saap_device.py::random_lm`)
reading the built-in corpus through a byte tokenizer. Every timed piece depends on shapes only
(windows, heads, C, batch, steps), not on the weights or the text; the KL values it prints mean
nothing for a real model.

One run (`--device cuda`):
  1. `train_saap` with the `full` preset (C = 1024, hidden 1024, batch 1000, 40 windows of 8,192
     tokens, min_distance 1024) on `--layers` (default 1, 15, 29) with `--steps` Adam steps per
     layer (default 4,000 of the preset's 40,000): the corpus capture through 30 layers (what a
     29-layer run captures), and per layer loading + de-RoPE, k-means of the 3 KV heads, the target
     table and the steps (the manifest's timings);
  2. with `--full-layer` (default on, if the time left allows it), layer 2 with the preset's 40,000
     steps, on the same capture cache: checks the per-step extrapolation;
  3. this machine's CPU (torch's default threads: its cores) on the same inputs: one window captured through
     2 layers (the GPU too); one full-size k-means (40 x 8,191 keys of layer 1, KV head 0) with
     faiss-cpu vs the GPU's k-means on the same keys (inertia compared); `--cpu-steps` Adam steps on
     the per-step target path (the full preset's CPU path: its 3.5 GB target table is over the CPU
     budget) and the same path on the GPU;
  4. the extrapolation to 29 layers, printed last (measured vs extrapolated named per line).

    python benchmarks/gpu_saap_train.py --json /tmp/gpu_saap_train.json
    python benchmarks/gpu_saap_train.py --device cpu --tiny        # a smoke test of this script on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from indexer.rope import undo_rope  # noqa: E402
from indexer.clustering import kmeans  # noqa: E402
from training import loop  # noqa: E402
from training.capture import capture_first_layers, load_layer  # noqa: E402
from training.settings import TrainSettings, resolve_device, settings_from  # noqa: E402
from tests.test_saap_device import random_lm  # noqa: E402

SMOLLM2_135M = {"layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536,
                "vocab": 49152, "max_positions": 8192, "rope_theta": 1e5}
TINY_SHAPE = {"layers": 4, "hidden": 96, "heads": 6, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "vocab": 256,
              "max_positions": 1024, "rope_theta": 1e4}


def sh(cmd: str) -> str:
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001 - informational only
        return f"unavailable: {e}"


def machine(dev: torch.device) -> dict:
    out = {"date": sh("date"), "lscpu_model": sh("lscpu | grep 'Model name'"), "nproc": sh("nproc"),
           "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        import faiss

        out["faiss"] = f"{faiss.__version__}, GPUs seen by faiss: {faiss.get_num_gpus()}"
    except ImportError as e:
        out["faiss"] = f"unavailable: {e}"
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["nvidia_smi"] = sh("nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv")
    return out


def timed(fn, dev: torch.device):
    loop._sync(dev)
    t0 = time.perf_counter()
    out = fn()
    loop._sync(dev)
    return out, time.perf_counter() - t0


def run_train(lm, settings, out_dir: Path) -> dict:
    t0 = time.perf_counter()
    path = loop.train_saap(lm, settings, out_dir=out_dir, keep_cache=True, progress=False,
                         on_progress=lambda ev: print(json.dumps({"t": round(time.perf_counter() - t0, 1), **ev}),
                                                      flush=True))
    m = json.loads((path / "manifest.json").read_text())
    return {"wall_s": time.perf_counter() - t0, "capture_s": m["timings"]["capture_s"], "trained_on": m["trained_on"],
            "steps": settings.steps, "corpus_windows": m["corpus"]["windows"], "corpus_tokens": m["corpus"]["tokens"],
            "layers": {k: {f: v[f] for f in ("load_s", "kmeans_s", "targets_s", "steps_s", "train_s", "kl_first",
                                              "kl_last", "balance_train")} for k, v in m["layers"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", default="1,15,29")
    ap.add_argument("--steps", type=int, default=4000, help="Adam steps per layer in the timed run")
    ap.add_argument("--full-layer", type=int, default=2, help="layer trained with the preset's steps (0 = none)")
    ap.add_argument("--cpu-steps", type=int, default=3)
    ap.add_argument("--gpu-perstep-steps", type=int, default=100)
    ap.add_argument("--budget-s", type=float, default=420, help="skip --full-layer if it would end after this")
    ap.add_argument("--out", type=Path, default=Path("/tmp/saap-gpu-train"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny model and small preset (smoke test on a CPU)")
    ap.add_argument("--threads", type=int, help="torch threads [torch's default: this machine's cores]")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    dev = resolve_device(args.device)
    shape = TINY_SHAPE if args.tiny else SMOLLM2_135M
    preset = "small" if args.tiny else "full"
    layers = tuple(int(x) for x in args.layers.split(",")) if not args.tiny else (1, 2)
    res: dict = {"machine": machine(dev), "shape": shape, "preset": preset,
                 "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(res["machine"]), flush=True)
    shutil.rmtree(args.out, ignore_errors=True)

    t0 = time.perf_counter()
    lm = random_lm(**shape, device=str(dev))
    res["model_build_s"] = time.perf_counter() - t0
    full = settings_from(preset, device=str(dev))
    overrides = {"n_docs": 4, "doc_tokens": 512} if args.tiny else {}

    # 1. the timed run: capture of every window through max(layers) + 1 layers, then each layer
    s1 = full.model_copy(update={"layers": layers, "steps": args.steps if not args.tiny else 40, **overrides})
    assert s1.model_dump() == TrainSettings(**s1.model_dump()).model_dump()  # model_copy does not validate
    res["run"] = run_train(lm, s1, args.out)
    print(json.dumps({"run": res["run"]}), flush=True)
    per_step = [v["steps_s"] / s1.steps for v in res["run"]["layers"].values()]

    # 2. one layer with the preset's steps, if the time left allows it
    steps_full = full.steps if not args.tiny else 200
    fixed = max(v["kmeans_s"] + v["targets_s"] for v in res["run"]["layers"].values())
    need = fixed + max(per_step) * steps_full * 1.2 + 10
    left = args.budget_s - (time.perf_counter() - t_start)
    if args.full_layer and need < left:
        s2 = full.model_copy(update={"layers": (args.full_layer,), "steps": steps_full, **overrides})
        res["full_layer"] = run_train(lm, s2, args.out)
        print(json.dumps({"full_layer": res["full_layer"]}), flush=True)
    else:
        res["full_layer"] = {"skipped": f"needs ~{need:.0f} s, {left:.0f} s left of --budget-s"}
        print(json.dumps(res["full_layer"]), flush=True)

    # 3. the same pieces on this machine's CPU (and the GPU), on the captured inputs
    spec = lm.spec
    caps = sorted((args.out / ".captures").glob("window_*.safetensors"))
    q1, k1 = load_layer(caps[0], 1)
    n = k1.shape[1]
    pos = torch.arange(n)
    qd1, kd1 = undo_rope(q1, pos, spec.rope_theta), undo_rope(k1, pos, spec.rope_theta)
    cmp: dict = {"cpu_threads": torch.get_num_threads()}
    ids = [(7 + 31 * i) % 256 for i in range(n)]  # any n token ids: the cost does not depend on them
    lm_cpu = random_lm(**shape, device="cpu") if dev.type == "cuda" else lm
    capture_first_layers(lm, ids[:256], 2)  # warm-up
    _, cmp["capture_1_window_2_layers_dev_s"] = timed(lambda: capture_first_layers(lm, ids, 2), dev)
    _, cmp["capture_1_window_2_layers_cpu_s"] = timed(lambda: capture_first_layers(lm_cpu, ids, 2), torch.device("cpu"))
    del lm_cpu
    xs = []  # de-RoPE'd keys of layer 1, KV head 0, every window, sink left out: what train_saap clusters
    for c in caps:
        k = load_layer(c, 1)[1]
        xs.append(undo_rope(k, torch.arange(k.shape[1]), spec.rope_theta)[0, s1.sink_exclude:])
    x = torch.cat(xs)
    cent_dev, cmp["kmeans_one_head_dev_s"] = timed(lambda: kmeans(x.to(dev), s1.clusters, s1.kmeans_iters, 1), dev)
    cent_cpu, cmp["kmeans_one_head_cpu_faiss_s"] = timed(lambda: kmeans(x, s1.clusters, s1.kmeans_iters, 1),
                                                          torch.device("cpu"))
    cmp["kmeans_points"] = x.shape[0]

    def inertia(cent):
        xs, cs = x.to(dev).double(), cent.to(dev).double()
        return float(sum(torch.cdist(xs[i:i + 32768], cs).min(1).values.pow(2).sum() for i in range(0, len(xs), 32768)))

    cmp["kmeans_inertia_dev"], cmp["kmeans_inertia_cpu_faiss"] = inertia(cent_dev), inertia(cent_cpu)
    cent = torch.stack([kmeans(kd1[h, 1:], s1.clusters, 2, h) for h in range(spec.num_kv_heads)])  # any centroids
    min_dist = s1.min_distance_for(n)
    gen = torch.Generator().manual_seed(0)
    old = loop._TABLE_BYTES, loop._TABLE_BYTES_CUDA
    loop._TABLE_BYTES = loop._TABLE_BYTES_CUDA = 0  # the per-step target path, on both devices
    try:
        t: dict = {}
        loop._train_layer([q1], [k1], [kd1], [qd1], cent, s1.model_copy(update={"steps": args.cpu_steps}), min_dist,
                        spec.group_size, gen, timings=t)
        cmp["step_perstep_targets_cpu_s"] = t["steps_s"] / args.cpu_steps
        on = [v.to(dev) for v in (q1, k1, kd1, qd1, cent)]
        t = {}
        loop._train_layer([on[0]], [on[1]], [on[2]], [on[3]], on[4], s1.model_copy(update={"steps": 10}), min_dist,
                        spec.group_size, gen)  # warm-up
        loop._train_layer([on[0]], [on[1]], [on[2]], [on[3]], on[4], s1.model_copy(update={"steps": args.gpu_perstep_steps}),
                        min_dist, spec.group_size, gen, timings=t)
        cmp["step_perstep_targets_dev_s"] = t["steps_s"] / args.gpu_perstep_steps
    finally:
        loop._TABLE_BYTES, loop._TABLE_BYTES_CUDA = old
    res["compare"] = cmp
    print(json.dumps({"compare": cmp}), flush=True)

    # 4. extrapolation to every layer (1..L-1) and the preset's steps
    n_layers = spec.num_layers - 1
    lay = res["run"]["layers"].values()
    mean = lambda key: sum(v[key] for v in lay) / len(lay)  # noqa: E731
    step_s = sum(per_step) / len(per_step)
    kv_heads = spec.num_kv_heads
    est = {
        "capture_s (measured: every window through all layers)": res["run"]["capture_s"],
        "load+de-RoPE+k-means per layer s (measured, mean)": mean("kmeans_s"),
        "k-means only per layer s (measured, mean)": mean("kmeans_s") - mean("load_s"),
        "target table per layer s (measured, mean)": mean("targets_s"),
        "step s (measured, mean over the timed layers)": step_s,
        "layer with the preset's steps s (measured)": (res["full_layer"]["layers"][str(args.full_layer)]["train_s"]
                                                       + res["full_layer"]["layers"][str(args.full_layer)]["kmeans_s"])
        if "layers" in res["full_layer"] else None,
        "total h (extrapolated: capture + L-1 x (k-means + table + steps x step s))":
            (res["run"]["capture_s"] + n_layers * (mean("kmeans_s") + mean("targets_s") + full.steps * step_s)) / 3600,
        "total h (extrapolated: capture + L-1 x the layer with the preset's steps)":
            (res["run"]["capture_s"] + n_layers * (res["full_layer"]["layers"][str(args.full_layer)]["train_s"]
                                                   + res["full_layer"]["layers"][str(args.full_layer)]["kmeans_s"])) / 3600
        if "layers" in res["full_layer"] else None,
        "CPU total h (extrapolated, this machine: capture 2 layers x L/2 x windows + faiss k-means x heads "
        "+ per-step targets x steps x layers)":
            (cmp["capture_1_window_2_layers_cpu_s"] * spec.num_layers / 2 * full.n_docs
             + cmp["kmeans_one_head_cpu_faiss_s"] * n_layers * kv_heads
             + cmp["step_perstep_targets_cpu_s"] * full.steps * n_layers) / 3600,
    }
    res["estimate"] = est
    res["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print("\n| what | value |\n|---|---|")
    for k, v in {**cmp, **est}.items():
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(f"elapsed {res['elapsed_s']:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
