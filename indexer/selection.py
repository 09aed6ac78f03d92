"""Selection helpers shared by the planners: positions -> K/V rows, the selectable range, candidate
scoring and top-K, duplicate removal, nearest centroids and CSR cluster expansion with a fixed
width. Pure tensor functions over the decode layout (`indexer.base.KVView`): context rows
[KVH, N, D], absolute positions, -1 for an empty slot. Every function keeps shapes fixed by its
arguments and reads nothing back on the host, so a planner built from them is sync-free."""

from __future__ import annotations

import torch

from indexer.base import frame_bounds, frame_rows


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [H, N, ...], idx [H, R] (valid row ids) -> [H, R, ...] = x[h, idx[h]] for every h.

    One `index_select` over x's rows seen as one flat table: on the CPU ~6x faster than `gather`
    with an index expanded over the trailing dims (measured 24 vs 159 µs for 3 x 430 rows of 64
    floats). A view sliced along N (e.g. the context part of a capture) is read in place, never copied.
    """
    h, n = x.shape[:2]
    tail = x.shape[2:]
    if x.is_contiguous():
        rows, step = x.reshape(h * n, *tail), n
    elif h > 0 and x[0].is_contiguous() and x.stride(0) % x.stride(1) == 0:
        step = x.stride(0) // x.stride(1)  # rows between the starts of two heads
        rows = x.as_strided(((h - 1) * step + n, *tail), x.stride()[1:])
    else:
        rows, step = x.contiguous().reshape(h * n, *tail), n
    flat = idx.long() + torch.arange(h, device=idx.device).view(h, *([1] * (idx.dim() - 1))) * step
    return rows.index_select(0, flat.reshape(-1)).view(*idx.shape, *tail)


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N] float32, accumulated in float32. On a GPU, bf16/fp16
    operands stay in their dtype (cuBLAS with a float32 output): no float32 copy of a large b, such
    as a 128K-token context's keys (512 MB per layer at the 8B shape). Elsewhere both are upcast."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def gather_context(ctx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """pos [KVH, T, P] context positions (-1 = none) -> rows [KVH, T, P, D] of ctx [KVH, N, D].
    Invalid slots get an arbitrary row (mask them)."""
    kvh, t, p = pos.shape
    n = ctx.shape[1]
    return gather_rows(ctx, pos.reshape(kvh, t * p).clamp(0, n - 1)).view(kvh, t, p, ctx.shape[-1])


def selectable(pos: torch.Tensor, q_pos: torch.Tensor, n_ctx: int, sink: int, window: int) -> torch.Tensor:
    """pos [..., T, P] positions -> bool: inside the context and outside the frame's sink and
    window for that query token (what a plan may select; `indexer.base.frame_bounds`)."""
    s_end, w_lo = frame_bounds(q_pos, n_ctx, sink, window)
    return (pos >= s_end) & (pos < w_lo[:, None])


def selectable_mask(q_pos: torch.Tensor, n_ctx: int, sink: int, window: int) -> torch.Tensor:
    """[T, N] bool: which context positions a plan may select, per query token."""
    return selectable(torch.arange(n_ctx, device=q_pos.device).expand(q_pos.shape[0], n_ctx), q_pos, n_ctx, sink, window)


def dedup_positions(pos: torch.Tensor, size: int) -> torch.Tensor:
    """[..., U] positions in [0, size) (-1 = empty) -> same shape and order, each position kept in
    one slot only (the others become -1).

    A scatter of slot numbers into an uninitialised [rows, size] table, read back: a slot survives
    when it is the one that wrote its position (exactly one writer wins a duplicate, also on CUDA).
    O(U) work instead of a sort (measured 3 x 4000 ids: ~1.1 ms for `torch.sort` on one CPU core).
    """
    u = pos.shape[-1]
    rows = pos.reshape(-1, u)
    valid = rows >= 0
    at = torch.where(valid, rows, size)  # empty slots all write to a spare column
    slot = torch.arange(u, device=pos.device).expand_as(at)
    owner = torch.empty(rows.shape[0], size + 1, dtype=torch.int64, device=pos.device)
    owner.scatter_(1, at, slot)
    keep = valid & (owner.gather(1, at) == slot)
    return torch.where(keep, rows, -1).view_as(pos)


def frame_logsumexp(q: torch.Tensor, kv, sink: int, window: int) -> torch.Tensor:
    """[KVH, G, T] fp32: log sum exp(q·k / sqrt(D)) per query head over the rows the frame attends
    (the sink, the context part of the recent window, the visible request-local rows). Fixed shape:
    sink + window context rows (masked past the context) and every local slot (masked by q_pos)."""
    kvh, g, t, d = q.shape
    n = kv.n_ctx
    rows, ok, _ = frame_rows(None, kv.q_pos, n, kvh, sink, window)  # [KVH, T, R]
    k_rows = gather_context(kv.ctx_k, rows)  # [KVH, T, R, D]
    qf = q.float()
    s_ctx = torch.einsum("hgtd,htrd->hgtr", qf, k_rows.float()).masked_fill(~ok[:, None], float("-inf"))
    m = kv.loc_k.shape[1]
    loc_ok = (n + torch.arange(m, device=q.device))[None, :] <= kv.q_pos[:, None]  # [T, M]
    loc_k = kv.loc_k.to(q.device).float()  # offload mode: the request's rows live on the GPU, the planner on the host
    s_loc = torch.einsum("hgtd,hmd->hgtm", qf, loc_k).masked_fill(~loc_ok[None, None], float("-inf"))
    return torch.logsumexp(torch.cat([s_ctx, s_loc], dim=-1) * d ** -0.5, dim=-1)


def candidate_mass(q: torch.Tensor, cand: torch.Tensor, ctx_k: torch.Tensor, ok: torch.Tensor,
                   frame_lse: torch.Tensor | None = None) -> torch.Tensor:
    """Group attention mass restricted to a candidate set of context positions.

    q [KVH, G, T, D]; cand [KVH, T, U] context positions; ok [KVH, T, U] which slots count (valid,
    selectable, no duplicates). Returns [KVH, T, U]: sum over the group of softmax(q·k / sqrt(D)),
    each head's softmax taken over its ok candidates and, when `frame_lse` ([KVH, G, T], from
    `frame_logsumexp`) is given, over the frame's rows too; -1 where not ok.

    Pass `frame_lse` when ranking for a plan: the group sum weighs each head by its own normaliser,
    and over the candidates alone a head that puts most of its mass on the sink (common in real
    models) is normalised over its small remainder and outweighs the rest of its group, so the pooled
    ranking departs from the oracle's (`indexer.topk`: softmax over every visible token). With the
    frame in the denominator, candidates = every selectable token gives exactly the oracle's score
    (measured on real captured Q/K: benchmarks/RESULTS_ctkvr_kivf.md, plan/run section).
    """
    kvh, g, t, d = q.shape
    k_sel = gather_context(ctx_k, torch.where(ok, cand, 0))  # [KVH, T, U, D]
    s = torch.einsum("hgtd,htud->hgtu", q.float(), k_sel.float()) * d ** -0.5
    s = s.masked_fill(~ok[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [KVH, G, T]
    if frame_lse is not None:
        lse = torch.logaddexp(lse, frame_lse)
    mass = torch.exp(s - lse[..., None]).sum(dim=1)  # rows with nothing at all give NaN, masked next
    return torch.where(ok, mass, -1.0)


def top_positions(score: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
    """The k candidates of largest score (score < 0 = not a candidate) -> positions
    [KVH, T, min(k, U)] int32, best first, -1 where none is left."""
    k = min(k, cand.shape[-1])
    val, at = torch.topk(score, k, dim=-1, sorted=True)
    return torch.where(val >= 0, cand.gather(-1, at), -1).to(torch.int32)


def nearest_centroid(x: torch.Tensor, cent: torch.Tensor, c_sq: torch.Tensor | None = None) -> torch.Tensor:
    """x [KVH, T, D], cent [KVH, C, D] -> [KVH, T] index of the nearest (L2) centroid.

    argmin |x - c|^2 = argmax x·c - |c|^2 / 2 (one GEMM, no [T, C, D] difference tensor).
    """
    if c_sq is None:
        c_sq = (cent * cent).sum(-1)
    s = torch.einsum("htd,hcd->htc", x.float(), cent) - 0.5 * c_sq[:, None, :]
    return s.argmax(-1)


def probe_width(offsets: torch.Tensor, nprobe: int) -> int:
    """Host int: the most keys `nprobe` clusters can hold, over heads: the sum of the nprobe largest
    cluster sizes. offsets [KVH, C + 1] (any device; read once, when a planner opens a layer)."""
    sizes = (offsets[:, 1:] - offsets[:, :-1]).long()
    p = min(nprobe, sizes.shape[1])
    return int(sizes.topk(p, dim=-1).values.sum(-1).max().item()) if p > 0 else 0


def expand_clusters(probe: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """Key ids of the probed clusters as one padded block of a fixed width.

    probe [KVH, T, P] cluster ids; order [KVH, N]; offsets [KVH, C + 1] -> [KVH, T, width] key ids
    (-1 = padding). `width` should be `probe_width(offsets, P)` (then nothing is cut); a smaller
    width keeps the first `width` keys of the concatenation in probe order.
    """
    kvh, t, p = probe.shape
    dev = probe.device
    if width == 0:
        return torch.full((kvh, t, 0), -1, dtype=torch.int64, device=dev)
    flat = probe.reshape(kvh, t * p)
    offsets = offsets.long()
    start = offsets.gather(1, flat).view(kvh, t, p)
    size = offsets.gather(1, flat + 1).view(kvh, t, p) - start
    end = size.cumsum(-1)  # [KVH, T, P] end of each probed cluster in the concatenation
    j = torch.arange(width, device=dev).expand(kvh, t, width).contiguous()
    which = torch.searchsorted(end.contiguous(), j, right=True).clamp(max=p - 1)  # probed cluster holding slot j
    src = start.gather(-1, which) + j - (end - size).gather(-1, which)
    valid = j < end[..., -1:]
    n = order.shape[1]
    ids = gather_rows(order, src.clamp(0, n - 1).reshape(kvh, t * width)).view(kvh, t, width).long()
    return torch.where(valid, ids, -1)
