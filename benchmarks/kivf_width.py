"""kivf's static candidate width against the keys a step really probes, on `gpu_decode.py`'s synthetic
layer (the same generator and seeds, on the CPU): how much of the fixed-width row the fused plan's rerank
and select would spend on padding if they did not stop at the probed keys (benchmarks/RESULTS.md,
"kivf stops at its probed keys", session 27).

    python benchmarks/kivf_width.py --lengths 32768 131072 [--out results/kivf_width.json]

Per length: the kivf index built from a one-layer capture (k-means over the de-RoPE'd keys, C =
4·sqrt(N)), the planner's nprobe at ratio 0.05 (scan 4), the static width (`selection.probe_width`:
the nprobe largest clusters, max over KV heads) and, for the step's query (the request's last token),
the keys of the clusters each KV head probes (`kivf.probe_scores`, top-nprobe).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import benchmarks.gpu_decode as gd  # noqa: E402
from benchmarks._gpu_timing import KVH, G, D  # noqa: E402
from indexer.base import PrefillCapture  # noqa: E402
from indexer.kivf import probe_scores  # noqa: E402
from indexer.selection import probe_width  # noqa: E402
from synthetic import Mixture  # noqa: E402


def measure(n: int) -> dict:
    gd.DEV = "cpu"
    mix = Mixture(gd.spec(2), "cpu", seed=0)  # gpu_decode's mixture and seeds
    q, k, v = gd.make_inputs(n, mix, seed=1)
    method, params = gd.method_params("kivf", None, 0.05)
    cap = PrefillCapture(q=q[None, :, :n], k=k[None, :, :n], v=v[None, :, :n], positions=torch.arange(n),
                         spec=gd.spec(1))
    t0 = time.perf_counter()
    arrays = method.build(cap, params)
    build_s = time.perf_counter() - t0
    offsets, cent = arrays["offsets"][0], arrays["centroids"][0].float()
    c = offsets.shape[-1] - 1
    k_sel = params.budget(n)
    nprobe = params.probes(k_sel, n, c)
    width = probe_width(offsets, nprobe)
    sizes = offsets[:, 1:] - offsets[:, :-1]  # [KVH, C]
    q_step = q[:, -1:].reshape(KVH, G, 1, D)  # the step's query (the request's last token), per KV head
    probed = torch.topk(probe_scores(q_step, cent), nprobe, dim=-1).indices[:, 0]  # [KVH, nprobe]
    keys = torch.gather(sizes, 1, probed).sum(1)  # [KVH]
    return {"n": n, "clusters": c, "k": k_sel, "nprobe": nprobe, "width": int(width),
            "probed_keys_per_head": keys.tolist(), "width_over_probed": round(width / float(keys.float().mean()), 2),
            "build_s": round(build_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for n in args.lengths:
        row = measure(n)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
