"""GPU check of the sparse methods' torch paths (device tool): each method's index is built on the
CPU and on the GPU from the same random capture, sessions select on both devices, and the
selections and attention outputs are compared. Prints one line per method.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_methods_check.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decoder.attention import merge_selection, sparse_attention  # noqa: E402
from decoder.model import ModelSpec  # noqa: E402
from indexer.base import IndexReader, KVView, PrefillCapture, get_method  # noqa: E402

SPEC = ModelSpec(name="synthetic", fingerprint="0" * 64, tokenizer_fingerprint="0" * 64, num_layers=2, num_heads=8,
                 num_kv_heads=2, head_dim=64, max_positions=65536, rope_theta=1e5, rope_type="default", dtype="float32")


def capture(n: int, device: str) -> PrefillCapture:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(2, 8, n, 64), r(2, 2, n, 64), r(2, 2, n, 64)
    k[:, :, ::97] += 3 * q[:, ::4, ::97]  # a few keys that queries like
    return PrefillCapture(q=q.to(device), k=k.to(device), v=v.to(device), positions=torch.arange(n, device=device), spec=SPEC)


def run(name: str, params: dict, device: str, n: int = 4096, steps: int = 4):
    m = get_method(name)
    p = m.Params().with_overrides(params)
    cap = capture(n, device)
    ctx = PrefillCapture(q=cap.q[:, :, : n - steps], k=cap.k[:, :, : n - steps], v=cap.v[:, :, : n - steps],
                         positions=cap.positions[: n - steps], spec=SPEC)
    arrays = {k: t.to(device) for k, t in m.build(ctx, p).items()} if m.has_index else {}
    sess = m.open(IndexReader(lambda nm, layer: arrays[nm][layer], sorted(arrays)) if arrays else None, p, n - steps)
    sels, outs = [], []
    t0 = time.perf_counter()
    for i in range(steps):
        pos = n - steps + i
        for layer in range(2):
            qq = cap.q[layer, :, pos:pos + 1].reshape(2, 4, 1, 64)
            kv = KVView(cap.k[layer, :, : n - steps], cap.v[layer, :, : n - steps], cap.k[layer, :, n - steps:pos + 1],
                        cap.v[layer, :, n - steps:pos + 1], torch.tensor([pos], device=device))
            custom = sess.attend(layer, qq, kv)
            if custom is not None:
                outs.append(custom[0].float().cpu())
                sels.append(None)
            else:
                sel = sess.select(layer, qq, kv)
                idx = merge_selection(sel, kv.q_pos, p.sink, p.window) if sel is not None else None
                sels.append(None if idx is None else idx.cpu())
                if idx is not None:
                    outs.append(sparse_attention(qq, idx, kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, 0.125).float().cpu())
            sess.append(layer, cap.k[layer, :, pos:pos + 1], cap.v[layer, :, pos:pos + 1], torch.tensor([pos], device=device))
    if device == "cuda":
        torch.cuda.synchronize()
    return sels, outs, time.perf_counter() - t0


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    print(torch.cuda.get_device_name(), torch.__version__)
    cases = [("topk", {}), ("streaming", {}), ("csattn", {"mode": "gpu"}), ("ctkvr", {}), ("psa", {}), ("lfps", {})]
    for name, params in cases:
        try:
            s_cpu, o_cpu, _ = run(name, params, "cpu")
            s_gpu, o_gpu, t = run(name, params, "cuda")
            overlap = []
            for a, b in zip(s_cpu, s_gpu):
                if a is None or b is None:
                    continue
                for h in range(a.shape[0]):
                    sa, sb = set(a[h].flatten().tolist()) - {-1}, set(b[h].flatten().tolist()) - {-1}
                    overlap.append(len(sa & sb) / max(len(sa | sb), 1))
            err = max(((x - y).norm() / y.norm().clamp_min(1e-12)).item() for x, y in zip(o_gpu, o_cpu)) if o_cpu else 0.0
            ov = min(overlap) if overlap else float("nan")
            print(f"{name:10s} ok  selection Jaccard min {ov:.4f}  max rel L2 out err {err:.2e}  gpu {t * 1e3:.1f} ms")
        except Exception as e:  # noqa: BLE001 - report every method
            import traceback

            print(f"{name:10s} FAILED {type(e).__name__}: {e}")
            traceback.print_exc(limit=-3)


if __name__ == "__main__":
    main()
