"""k-means (L2): faiss's algorithm, the one k-means of `kivf`'s build and of SAAP's offline training.

Where it runs, by the device of the points (`kmeans`, `kmeans_with_assignment`):
  * CPU: `faiss.Kmeans` (the reference). Below `SERIAL_BELOW` points faiss runs on one OpenMP
    thread, set around the call and restored after: for a small k-means OpenMP's thread start-up
    costs more than it saves (measured for kivf's 2K-key build: benchmarks/RESULTS_ctkvr_kivf.md,
    "k-means threads").
  * GPU, faiss built with GPU support (faiss-gpu: `faiss.get_num_gpus() > 0`):
    `faiss.Kmeans(gpu=True)`, the same algorithm with its distance search on the GPU(s).
  * GPU, faiss-cpu: `kmeans_torch`, faiss's algorithm written in torch, with faiss's own random
    numbers (faiss-gpu wheels need CUDA 12 libraries, which a torch built for another CUDA does
    not bring).
Every call is seeded and runs `iters` Lloyd iterations over all points (no subsampling: faiss's
`max_points_per_centroid` is lifted), so the same points and seed give the same centroids.

csattn's `cosine_kmeans` (`indexer/csattn.py`) is not this algorithm with normalised points: it
seeds with k-means++ on a sample, batches many small problems, keeps an empty cluster's centroid
instead of splitting a large one, and draws from a torch generator; it stays with its method.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

SERIAL_BELOW = 1 << 16  # points under which faiss runs on one thread (see the module docstring)


def backend(device: torch.device) -> str:
    """Which implementation `kmeans` uses for points on `device`: faiss-cpu, faiss-gpu or torch."""
    import faiss

    if device.type != "cuda":
        return "faiss-cpu"
    return "faiss-gpu" if faiss.get_num_gpus() > 0 else "torch"


def kmeans(x: torch.Tensor, c: int, iters: int, seed: int) -> torch.Tensor:
    """x [n, D] -> centroids [C, D] fp32 on x's device (L2, `iters` iterations, seeded)."""
    if backend(x.device) == "torch":
        return kmeans_torch(x, c, iters, seed)
    return _faiss_kmeans(x, c, iters, seed, search=False)[0]


def kmeans_with_assignment(x: torch.Tensor, c: int, iters: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D] -> (centroids [C, D] fp32, assignment [n] int64: each point's nearest final
    centroid), both on x's device. With faiss, the assignment is faiss's own search of its final
    centroids (lowest index on ties)."""
    if backend(x.device) == "torch":
        cent = kmeans_torch(x, c, iters, seed)
        return cent, nearest(x.float().contiguous(), cent)
    return _faiss_kmeans(x, c, iters, seed, search=True)


@contextmanager
def _faiss_threads(n: int):
    """One OpenMP thread for faiss while a k-means of `n` points runs, when n < SERIAL_BELOW."""
    import faiss

    threads = faiss.omp_get_max_threads()
    if n < SERIAL_BELOW:
        faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(threads)


def _faiss_kmeans(x: torch.Tensor, c: int, iters: int, seed: int,
                  search: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    import faiss

    a = np.ascontiguousarray(x.detach().float().cpu().numpy())
    gpu = x.device.type == "cuda"
    # faiss warns below 39 points per centroid and subsamples above 256; neither changes the result's meaning
    km = faiss.Kmeans(a.shape[1], c, niter=iters, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=1 << 30, **({"gpu": True} if gpu else {}))
    assign = None
    with _faiss_threads(a.shape[0]):
        km.train(a)
        if search:  # after `train` faiss's index holds the final centroids
            _, found = km.index.search(a, 1)
            assign = torch.from_numpy(found[:, 0].astype(np.int64)).to(x.device)
    return torch.from_numpy(km.centroids.copy()).to(x.device), assign


def nearest(x: torch.Tensor, cent: torch.Tensor, chunk: int = 1 << 16, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, D], cent [C, D] (fp32) -> index of each point's nearest centroid in L2 [n] int64, ranked
    by |c|^2 - 2 x·c (faiss's formula for large inputs), [chunk, C] distances at a time."""
    c_sq = (cent * cent).sum(1)
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device) if out is None else out
    for s0 in range(0, x.shape[0], chunk):
        out[s0:s0 + chunk] = torch.addmm(c_sq[None], x[s0:s0 + chunk], cent.T, alpha=-2).argmin(1)
    return out


def kmeans_torch(x: torch.Tensor, c: int, iters: int, seed: int, chunk: int = 1 << 16) -> torch.Tensor:
    """faiss.Kmeans's algorithm (faiss/Clustering.cpp: `Clustering::train`, nredo 1, no subsampling)
    in torch, on x's device: x [n, D] -> centroids [C, D] fp32.

    Hand-written because faiss-cpu has no GPU code and faiss-gpu cannot be installed next to a torch
    built for another CUDA. It follows faiss step by step, with faiss's own random numbers:
      * init: the points perm[:C] of faiss's `rand_perm(n, seed + 1)` (called through faiss);
      * `iters` Lloyd iterations: each point to its nearest centroid in L2 (lowest index on ties),
        then each centroid = the mean of its points (sum x 1/count, as faiss);
      * empty clusters: faiss's `split_clusters`, with its `RandomGenerator(1234)` (through faiss):
        an empty cluster takes a copy of a large one drawn with probability (count - 1) / (n - C),
        the two pulled apart by a 1/1024 relative perturbation, and the count split in two.
    The same init and the same steps; the distances are faiss's formula for large inputs (its BLAS
    path ranks by |c|^2 - 2 x·c), summed in another order, so a point within float rounding of a
    tie between two centroids can take the other one (split pairs, or duplicated points, make such
    ties) and the runs drift apart from there. How close it comes to faiss (tests/test_saap_device.py
    on the CPU; benchmarks/gpu_saap_train.py on a GPU) is in benchmarks/RESULTS_saap.md,
    "Training on a GPU".
    """
    import faiss

    n, d = x.shape
    if n < c:
        raise ValueError(f"k-means: {n} points for {c} clusters")
    x = x.float().contiguous()
    if n == c:  # faiss's corner case: the points are the centroids
        return x.clone()
    perm = np.empty(n, dtype=np.int32)
    faiss.rand_perm(faiss.swig_ptr(perm), n, seed + 1)
    cent = x[torch.from_numpy(perm[:c].astype(np.int64)).to(x.device)].clone()  # [C, D]
    assign = torch.empty(n, dtype=torch.long, device=x.device)
    for _ in range(iters):
        nearest(x, cent, chunk, out=assign)
        count = torch.bincount(assign, minlength=c).float()  # faiss's `hassign`
        norm = torch.where(count > 0, 1 / count.clamp_min(1), 0.0)
        cent = torch.zeros(c, d, device=x.device).index_add_(0, assign, x) * norm[:, None]
        if bool((count == 0).any()):
            cent = _split_clusters(cent, count, n)
    return cent


def _split_clusters(cent: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """faiss's `split_clusters` (Clustering.cpp) on the host, float32 as there: a new centroid for
    every empty cluster, split off a large one. cent [C, D], count [C] -> cent."""
    import faiss

    cen = cent.cpu().numpy().copy()
    h = count.cpu().numpy().astype(np.float32)
    k, d = cen.shape
    rng = faiss.RandomGenerator(1234)
    eps = np.float32(1 / 1024)
    sign = np.where(np.arange(d) % 2 == 0, np.float32(1), np.float32(-1))
    grow, shrink = np.float32(1) + eps * sign, np.float32(1) - eps * sign  # even dims: ci up, cj down
    denom = float(np.float32(n - k))
    for ci in range(k):
        if h[ci] != 0:
            continue
        cj = 0
        while True:  # faiss: p = (hassign[cj] - 1.0) / (float)(n - k) in double, stored as a float
            p = np.float32((float(h[cj]) - 1.0) / denom)
            if np.float32(rng.rand_float()) < p:
                break
            cj = (cj + 1) % k
        cen[ci] = cen[cj]
        cen[ci] *= grow
        cen[cj] *= shrink
        h[ci] = h[cj] / np.float32(2)
        h[cj] -= h[ci]
    return torch.from_numpy(cen).to(cent.device)
