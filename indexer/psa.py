"""`psa`: Progressive Sparse Attention (papers/psa.txt §3.2, Algorithm 1).

Prefill (`build`): the context keys are cut into blocks of `block_size` tokens [32]; per block and
KV head we persist its bounding cuboid and mean, `block_meta` [L, KVH, blocks, 3, D] fp16 with rows
(min, max, mean). fp16 rounding is directed (min rounded down, max rounded up), so the cuboid still
contains every key of the block and the criticality below stays an upper bound. The last block may
be partial.

Decode, per layer, KV head and query token:

1. Criticality of each block. `criticality="cuboid"` (default): the exact upper bound of q·k over
   the cuboid, sum_d max(q_d·min_d, q_d·max_d) = q⁺·max + q⁻·min (Quest-style); `"center"`:
   q·(min + max)/2 (our reading of ArkVale's "cuboid-mean", which the paper names as its default
   without defining it); `"mean"`: q·mean of the block's keys (InfLLM-style).
   GQA pooling (the G query heads of a KV head share one block order, because a block is loaded per
   KV head): per head, softmax over blocks of the scaled bound (c_hb·scale), summed over the
   group's heads -- the same pooling as `topk`'s group attention mass, so heads with different
   logit scales stay comparable. Measured on the captured 2K document (8 queries x 30 layers,
   eps 0.9 / 0.95, recall of the exact top-5%): this pooling 0.870 / 0.908 recall, 0.071 / 0.052
   output error; the alternative "max over heads of the logit relative to the head's best block"
   0.862 / 0.903 and 0.075 / 0.056, at the same KV touched (0.41 / 0.51).
2. The dense part is processed first (microbatch 0): every block holding a sink token or a token
   of the recent window, plus the request-local tail that is not yet a full block. It adds to
   AS_acc but not to AS_min (it is not part of the ranked order).
3. The remaining blocks are processed in descending criticality, `microbatch` blocks at a time,
   with the running softmax merge: running max logit m, AS_acc = sum exp(s - m) of everything
   processed, O_acc = sum exp(s - m)·v, and AS_min = the smallest block sum seen so far (a partial
   block's sum is scaled to a full block first, so it never pulls AS_min down by being short).
   After each microbatch, per query head, P_acc = AS_acc / (AS_acc + AS_min·N_left); the KV head
   stops when every query head of its group has P_acc >= eps [0.95]. Stopping per group (not per
   query head) is what a block loader shared by the group does; each head then has P_acc >= eps.
   eps = 1 processes every block, i.e. exact attention (AS_min can underflow to 0, so eps = 1 is
   special-cased to "until no block is left").

   AS_min·N_left is the paper's estimate of the unprocessed mass. It is an upper bound only when
   blocks arrive in decreasing order of their true exp-sums (tested on synthetic data where they
   do). The cuboid bound of 64-dim keys is loose, so on real data the order is only approximate:
   on the captured 2K document at eps 0.95 (16 queries x 30 layers x 9 heads) the estimate at stop
   averages 0.982 but the true mass of the processed set 0.944; 32% of (head, step) pairs end
   under eps, 10% under 0.883, the worst at 0.056 (a head whose peak block has 60 blocks with a
   larger bound ranked before it). Details and a block-size sweep: benchmarks/RESULTS_psa_lfps.md.

Fit to the decode frame: `execute="select"` (default) returns the tokens of every processed block;
exact attention over sink + window + that set (the frame's `sparse_attention`) *is* the progressive
output, because the dense part covers sink + window. `execute="progressive"` returns the merged
output O_acc / AS_acc itself through `attend()` (no second pass; the recall harness then has no
token set to score). Both give the same output (tested).

Request-local tokens: as they fill whole blocks (a block is complete once all its tokens precede
this step's first query) the session builds their cuboid metadata privately (fp32) and ranks them
like context blocks; the not-yet-full tail is always attended (part of the dense part). The
persisted metadata is read-only and shared.

Budget reporting: `session.stats()` gives the mean number of blocks touched per (layer, KV head,
token) step and per layer, and the mean estimated mass P_acc at stop.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from indexer._select import gather_positions
from indexer.base import MethodParams, MethodSession, SparseMethod, register

META_MIN, META_MAX, META_MEAN = 0, 1, 2
FP16_MAX = 65504.0


class PSAParams(MethodParams):
    block_size: int = Field(32, ge=1, le=4096, description="tokens per KV block (build)")
    eps: float = Field(0.95, gt=0.0, le=1.0, description="stop once the estimated attention mass reaches eps")
    microbatch: int = Field(4, ge=1, le=1 << 16, description="blocks processed per progressive iteration")
    criticality: Literal["cuboid", "center", "mean"] = Field(
        "cuboid", description="block score: cuboid upper bound, q·cuboid center, or q·mean"
    )
    execute: Literal["select", "progressive"] = Field(
        "select", description="select: return the processed tokens; progressive: return the merged output"
    )

    build_fields = frozenset({"block_size"})


# ---------------------------------------------------------------------------------------------
# Build


def _round_half(x: torch.Tensor, direction: float) -> torch.Tensor:
    """fp16 copy of x rounded toward `direction` (-inf: every value <= x; +inf: >= x)."""
    x = x.clamp(-FP16_MAX, FP16_MAX)
    h = x.half()
    wrong = (h.float() > x) if direction < 0 else (h.float() < x)
    toward = torch.full_like(h, direction)
    return torch.where(wrong, torch.nextafter(h, toward), h).clamp(-FP16_MAX, FP16_MAX)


def block_metadata(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """k [KVH, N, D] -> [KVH, blocks, 3, D] fp32 (min, max, mean); the last block may be partial."""
    kvh, n, d = k.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    kf = k.float()
    kmin = F.pad(kf, (0, 0, 0, pad), value=float("inf")).view(kvh, nb, block_size, d).amin(2)
    kmax = F.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(kvh, nb, block_size, d).amax(2)
    cnt = torch.full((nb,), float(block_size), device=k.device)
    cnt[-1] = n - (nb - 1) * block_size
    mean = F.pad(kf, (0, 0, 0, pad)).view(kvh, nb, block_size, d).sum(2) / cnt[None, :, None]
    return torch.stack([kmin, kmax, mean], dim=2)


# ---------------------------------------------------------------------------------------------
# Decode: the progressive pass


def block_criticality(q: torch.Tensor, meta: torch.Tensor, kind: str) -> torch.Tensor:
    """q [KVH, G, T, D], meta [KVH, B, 3, D] -> per-head score [KVH, G, T, B] (q·k scale, unscaled)."""
    meta = meta.to(q.dtype)
    if kind == "mean":
        return torch.einsum("hgtd,hbd->hgtb", q, meta[:, :, META_MEAN])
    if kind == "center":
        return torch.einsum("hgtd,hbd->hgtb", q, 0.5 * (meta[:, :, META_MIN] + meta[:, :, META_MAX]))
    return torch.einsum("hgtd,hbd->hgtb", q.clamp(min=0), meta[:, :, META_MAX]) + torch.einsum(
        "hgtd,hbd->hgtb", q.clamp(max=0), meta[:, :, META_MIN]
    )


def group_order(crit: torch.Tensor, scale: float) -> torch.Tensor:
    """[KVH, G, T, B] per-head criticality -> [KVH, T, B] group score: sum over the group's heads of
    softmax over blocks of the scaled bound (see the module docstring)."""
    return torch.softmax(crit * scale, dim=-1).sum(1)


class ProgressiveResult:
    __slots__ = ("positions", "out", "blocks_used", "mass_est", "tokens")

    def __init__(self, positions, out, blocks_used, mass_est, tokens):
        self.positions = positions  # [KVH, T, P] every processed position, -1 = none
        self.out = out  # [KVH, G, T, D] or None
        self.blocks_used = blocks_used  # [KVH, T] blocks touched (dense part's blocks + ranked ones)
        self.mass_est = mass_est  # [KVH, G, T] P_acc at stop
        self.tokens = tokens  # [KVH, T] positions processed


@torch.no_grad()
def progressive_attention(
    q: torch.Tensor,  # [KVH, G, T, D]
    ctx_k: torch.Tensor,  # [KVH, N, D]
    ctx_v: torch.Tensor,
    loc_k: torch.Tensor,  # [KVH, M, D]
    loc_v: torch.Tensor,
    q_pos: torch.Tensor,  # [T]
    meta: torch.Tensor,  # [KVH, B, 3, D]: context blocks then complete local blocks
    block_size: int,
    *,
    eps: float,
    microbatch: int,
    sink: int,
    window: int,
    criticality: str = "cuboid",
    with_output: bool = True,
) -> ProgressiveResult:
    """Algorithm 1 of the PSA paper, batched over KV heads and query tokens (rows that have reached
    eps stop changing; the loop ends when every row is done)."""
    dev = q.device
    kvh, g, t, d = q.shape
    n = ctx_k.shape[1]
    nb = meta.shape[1]
    nb_ctx = -(-n // block_size)
    nb_loc = nb - nb_ctx
    scale = d ** -0.5
    ar = torch.arange(block_size, device=dev)
    bidx = torch.arange(nb, device=dev)
    start = torch.where(bidx < nb_ctx, bidx * block_size, n + (bidx - nb_ctx) * block_size)  # [B]
    length = torch.where(bidx < nb_ctx, (n - start).clamp(max=block_size), torch.full_like(bidx, block_size))
    blocked_end = n + nb_loc * block_size  # positions >= this are the request-local tail
    blk_tok = torch.where(ar < length[:, None], start[:, None] + ar, -1)  # [B, bs] positions, -1 = none
    full_scale = block_size / length.clamp(min=1).float()  # [B] scales a partial block's sum to full size

    # -- dense part: blocks holding a sink or window token, + the tail ------------------------
    lo = (q_pos - window + 1).clamp(min=0)  # [T] first window position
    end = start + length  # [B] one past the block's last position
    forced = (start < sink)[None, :].expand(t, nb)  # [T, B]
    if window > 0:
        forced = forced | ((end > lo[:, None]) & (start <= q_pos[:, None]))
    n_forced = forced.sum(-1)  # [T]
    f_max = int(n_forced.max()) if nb else 0
    f_ids = torch.sort(torch.where(forced, bidx[None], nb), dim=-1).values[:, :f_max]  # [T, F], nb = none
    f_ok = f_ids < nb
    f_ids_c = f_ids.clamp(max=max(nb - 1, 0))
    f_pos = start[f_ids_c][..., None] + ar  # [T, F, bs]
    f_pos = torch.where(f_ok[..., None] & (ar < length[f_ids_c][..., None]), f_pos, -1).reshape(t, -1)
    tail_len = int((q_pos.max() - blocked_end + 1).clamp(min=0))
    tail = blocked_end + torch.arange(tail_len, device=dev)
    tail = torch.where(tail[None, :] <= q_pos[:, None], tail[None, :], -1)  # [T, tail]
    pos0 = torch.cat([f_pos, tail], dim=-1).expand(kvh, t, -1)  # [KVH, T, P0]

    def process(pos, maybe_local=True):  # pos [KVH, T, P] -> logits [KVH, G, T, P] (masked), values or None
        kk = gather_positions(pos, ctx_k, loc_k, maybe_local)
        s = torch.einsum("hgtd,htpd->hgtp", q, kk).float() * scale
        s = s.masked_fill((pos < 0)[:, None], float("-inf"))
        vv = gather_positions(pos, ctx_v, loc_v, maybe_local) if with_output else None
        return s, vv

    s0, v0 = process(pos0)
    m_run = s0.amax(-1)  # [KVH, G, T]; finite: a query's own position is in the tail (never in a block)
    p0 = torch.exp(s0 - m_run[..., None])
    l_acc = p0.sum(-1)
    o_acc = torch.einsum("hgtp,htpd->hgtd", p0, v0.float()) if with_output else None
    as_min = torch.full_like(l_acc, float("inf"))

    # -- ranked blocks ------------------------------------------------------------------------
    crit = block_criticality(q, meta, criticality)  # [KVH, G, T, B]
    crit = crit.masked_fill(forced[None, None], float("-inf"))
    score = group_order(crit, scale).masked_fill(forced[None], float("-inf"))  # [KVH, T, B]
    order = torch.sort(score, dim=-1, descending=True).indices  # [KVH, T, B]
    n_ranked = (nb - n_forced)[None].expand(kvh, t)  # [KVH, T]
    done = n_ranked <= 0
    used = torch.zeros(kvh, t, dtype=torch.long, device=dev)  # ranked blocks processed per row
    mass = torch.ones_like(l_acc)
    chunks: list[torch.Tensor] = []
    i = 0
    max_ranked = int(n_ranked.max()) if nb else 0
    while i < max_ranked and not bool(done.all()):
        ids = order[..., i:i + microbatch]  # [KVH, T, mb]
        mb = ids.shape[-1]
        rank = i + torch.arange(mb, device=dev)
        live = (~done)[..., None] & (rank < n_ranked[..., None])  # [KVH, T, mb]
        pos = torch.where(live[..., None], blk_tok[ids], -1).view(kvh, t, mb * block_size)
        s, vv = process(pos, maybe_local=nb_loc > 0)
        m_new = torch.maximum(m_run, s.amax(-1))
        alpha = torch.exp(m_run - m_new)
        p = torch.exp(s - m_new[..., None])  # [KVH, G, T, mb*bs]
        blk = p.view(kvh, g, t, mb, block_size).sum(-1)  # [KVH, G, T, mb]
        blk_min = (blk * full_scale[ids][:, None]).masked_fill(~live[:, None], float("inf")).amin(-1)
        l_acc = l_acc * alpha + p.sum(-1)
        as_min = torch.minimum(as_min * alpha, blk_min)
        if with_output:
            o_acc = o_acc * alpha[..., None] + torch.einsum("hgtp,htpd->hgtd", p, vv.float())
        m_run = m_new
        used = used + live.sum(-1)
        chunks.append(pos)
        n_left = (n_ranked - used).to(l_acc.dtype)[:, None]  # [KVH, 1, T]
        rest = torch.where(n_left > 0, as_min * n_left, torch.zeros_like(as_min))
        mass = l_acc / (l_acc + rest)
        if eps >= 1.0:
            head_ok = n_left.expand_as(mass) <= 0
        else:
            head_ok = mass >= eps
        done = done | head_ok.all(1) | (used >= n_ranked)
        i += microbatch
    positions = torch.cat([pos0, *chunks], dim=-1)
    out = (o_acc / l_acc[..., None]).to(q.dtype) if with_output else None
    tokens = (positions >= 0).sum(-1)
    return ProgressiveResult(positions, out, used + n_forced[None], mass, tokens)


# ---------------------------------------------------------------------------------------------
# Session


class _PSASession(MethodSession):
    def __init__(self, index, params: PSAParams, n_ctx: int):
        self.index = index
        self.params = params
        self.n_ctx = n_ctx
        self._loc_meta: dict[int, torch.Tensor] = {}  # layer -> [KVH, blocks, 3, D] request-local blocks
        self._blocks_sum: dict[int, float] = {}
        self._steps: dict[int, int] = {}
        self._mass_sum = 0.0
        self._mass_n = 0
        self.last: dict[int, ProgressiveResult] = {}

    def _meta(self, layer: int, kv) -> torch.Tensor:
        bs = self.params.block_size
        ctx_meta = self.index.layer("block_meta", layer)  # persisted, shared: read only
        n_full = max(int(kv.q_pos.min()) - kv.n_ctx, 0) // bs  # local blocks entirely before the first query
        have = self._loc_meta.get(layer)
        n_have = 0 if have is None else have.shape[1]
        if n_full > n_have:
            new = block_metadata(kv.loc_k[:, n_have * bs:n_full * bs], bs)
            have = new if have is None else torch.cat([have, new], dim=1)
            self._loc_meta[layer] = have
        if have is None or n_full == 0:
            return ctx_meta
        return torch.cat([ctx_meta.to(have.dtype), have[:, :n_full]], dim=1)

    def _run(self, layer, q, kv, with_output):
        p = self.params
        res = progressive_attention(
            q, kv.ctx_k, kv.ctx_v, kv.loc_k, kv.loc_v, kv.q_pos, self._meta(layer, kv), p.block_size,
            eps=p.eps, microbatch=p.microbatch, sink=p.sink, window=p.window, criticality=p.criticality,
            with_output=with_output,
        )
        self.last[layer] = res
        self._blocks_sum[layer] = self._blocks_sum.get(layer, 0.0) + float(res.blocks_used.double().mean())
        self._steps[layer] = self._steps.get(layer, 0) + 1
        self._mass_sum += float(res.mass_est.double().sum())
        self._mass_n += res.mass_est.numel()
        return res

    def attend(self, layer, q, kv):
        if self.params.execute != "progressive":
            return None
        res = self._run(layer, q, kv, with_output=True)
        return res.out, res.tokens.double() / (kv.q_pos[None, :].double() + 1)

    def select(self, layer, q, kv):
        return self._run(layer, q, kv, with_output=False).positions

    def stats(self) -> dict:
        per_layer = {l: self._blocks_sum[l] / self._steps[l] for l in sorted(self._steps)}
        return {
            "blocks_per_step": sum(per_layer.values()) / max(len(per_layer), 1),
            "blocks_per_step_per_layer": [round(v, 2) for v in per_layer.values()],
            "mass_est_mean": self._mass_sum / max(self._mass_n, 1),
        }


@register
class PSA(SparseMethod):
    name = "psa"
    Params = PSAParams
    has_index = True

    def build(self, prefill, params, env=None):
        k = prefill.k  # [L, KVH, N, D]
        metas = []
        for layer in range(k.shape[0]):  # per layer: bounded temporary memory
            m = block_metadata(k[layer], params.block_size)
            metas.append(torch.stack([
                _round_half(m[:, :, META_MIN], -math.inf),
                _round_half(m[:, :, META_MAX], math.inf),
                m[:, :, META_MEAN].clamp(-FP16_MAX, FP16_MAX).half(),
            ], dim=2))
        return {"block_meta": torch.stack(metas)}  # [L, KVH, blocks, 3, D] fp16

    def open(self, index, params, n_ctx, env=None):
        if index is None:
            raise ValueError("psa needs its index (block metadata); build it at prefill")
        return _PSASession(index, params, n_ctx)
