"""Held-out check of a trained SAAP layer: how much long-range attention mass the probed buckets
hold, for the trained classifier against centroid probing at the same number of keys read, and
against the best buckets (`bucket_mass_eval`). Used by tests/test_saap.py and
benchmarks/bench_saap.py; its results are in benchmarks/RESULTS_saap.md ("Per layer").
"""

from __future__ import annotations

import torch

from indexer.rope import undo_rope
from indexer.saap_model import SaapModel, bucket_scores
from indexer.selection import nearest_centroid


@torch.no_grad()
def bucket_mass_eval(model: SaapModel, layer: int, q: torch.Tensor, k: torch.Tensor, query_pos: torch.Tensor,
                     nprobe: int, recent: int, sink: int = 1) -> dict:
    """Attention mass beyond the dense part captured by the probed buckets, per method.

    q [H, N, D], k [KVH, N, D] post-RoPE (one layer of a held-out capture); query_pos [T].
    Mass = the group's attention (softmax over every visible key, averaged over the group's heads)
    on keys j in [sink, p - recent], normalized to its total there. `classifier`: the top-`nprobe`
    buckets of f_q (summed over the group), visiting V keys; `centroid`: buckets ranked by centroid
    similarity, taken in order until V keys (the last bucket pro rata), so both read the same number
    of keys; `oracle`: the `nprobe` buckets holding the most mass (same ℓ, not same selectivity).
    Returns means over KV heads and queries, and `selectivity` = V / keys in the range.
    """
    w = model.layer(layer)
    kvh, n, d = k.shape
    g = q.shape[0] // kvh
    c = w["centroids"].shape[1]
    l = min(nprobe, c)
    theta = model.rope_theta
    assign = nearest_centroid(undo_rope(k.float(), torch.arange(n), theta), w["centroids"], w["c_sq"])  # [KVH, N]
    qp = q[:, query_pos].float().reshape(kvh, g, len(query_pos), d)  # [KVH, G, T, D]
    t = len(query_pos)
    s = torch.einsum("hgtd,hnd->hgtn", qp, k.float()) * d ** -0.5
    j = torch.arange(n)
    s = s.masked_fill(j[None, None, None, :] > query_pos[None, None, :, None], float("-inf"))
    mass = torch.softmax(s, dim=-1).mean(1)  # [KVH, T, N]
    region = (j[None, :] >= sink) & (j[None, :] <= query_pos[:, None] - recent)  # [T, N]
    mass = mass * region[None]
    idx = assign[:, None, :].expand(kvh, t, n)
    bmass = torch.zeros(kvh, t, c).scatter_add_(2, idx, mass)
    bsize = torch.zeros(kvh, t, c).scatter_add_(2, idx, region[None].expand(kvh, t, n).float())
    total = bmass.sum(-1).clamp_min(1e-30)

    qd = undo_rope(qp, query_pos, theta)
    top = torch.topk(bucket_scores(qd, w, "classifier"), l, dim=-1).indices
    visited = bsize.gather(-1, top).sum(-1)  # [KVH, T]
    m_cls = bmass.gather(-1, top).sum(-1) / total

    order = torch.argsort(bucket_scores(qd, w, "centroid"), dim=-1, descending=True)
    sz, bm = bsize.gather(-1, order), bmass.gather(-1, order)
    cum = sz.cumsum(-1)
    whole = cum <= visited[..., None]
    nxt = whole.sum(-1, keepdim=True).clamp(max=c - 1)  # first bucket not taken whole
    left = (visited[..., None] - (cum - sz).gather(-1, nxt)).clamp_min(0)
    part = bm.gather(-1, nxt) * (left / sz.gather(-1, nxt).clamp_min(1)).clamp(max=1)
    part = torch.where(whole.all(-1, keepdim=True), torch.zeros_like(part), part)
    m_cen = ((bm * whole).sum(-1) + part[..., 0]) / total

    m_orc = torch.topk(bmass, l, dim=-1).values.sum(-1) / total
    valid = region.sum(-1)[None].expand(kvh, t) > 0
    sel = visited / region.sum(-1)[None].clamp_min(1)
    f = lambda x: float(x[valid].mean())  # noqa: E731
    return {"classifier": f(m_cls), "centroid": f(m_cen), "oracle": f(m_orc), "selectivity": f(sel),
            "nprobe": l, "queries": int(valid.sum())}
