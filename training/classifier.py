"""SAAP's query classifier f_q and what it is trained to output.

f_q, one per KV head (`StackedMLP`: every KV head of a layer in stacked weights, trained at once
with `bmm`): Linear(D, hidden) -> BatchNorm -> ReLU -> Linear(hidden, C), plus (`residual`, the
default) the centroid-similarity logits q'·c / sqrt(D). Its input q' is the de-RoPE'd query; it is
trained with Adam on KL(target || f_q(Q)) -- torch's `KLDiv(input=log f_q(Q), target)`, the paper's
Eq. 1 in torch's argument order (`training/loop.py` runs the steps).

Targets (`long_range_target`; `target_table` computes them for every position of a window at
once). Only long-range pairs count: keys j in [sink_exclude, p - min_distance] for a query at
position p (the closer pairs are the decode's dense part), so only positions
p >= sink_exclude + min_distance are sampled. With `query_filter="far_top1"` (`far_top1`) only
long-range *queries* train f_q (the paper's §4: "we discard all queries whose distance to the top-1
matching key is less than 1024 tokens"): a query whose largest q·k over keys sink..p lies at least
min_distance back. With group targets a (KV head, position) row counts when one of the group's
queries is long-range; positions with none in any KV head are not sampled, the others' rows are
weighted 0/1 in the loss. The share kept is recorded per layer (`long_range_rows` in the
manifest). Why the group targets and the residual are the defaults: `training/settings.py`.
"""

from __future__ import annotations

import math

import torch

from indexer.saap_model import BN_EPS


class StackedMLP(torch.nn.Module):
    """M independent f_q: Linear(D, Hd) -> BatchNorm1d(Hd) -> ReLU -> Linear(Hd, C), as stacked weights."""

    def __init__(self, m: int, d: int, hidden: int, c: int, gen: torch.Generator, zero_out: bool = False):
        super().__init__()

        def uniform(*shape, fan_in):  # nn.Linear's default init, from our generator
            bound = 1.0 / math.sqrt(fan_in)
            return torch.nn.Parameter((torch.rand(*shape, generator=gen) * 2 - 1) * bound)

        self.w1, self.b1 = uniform(m, hidden, d, fan_in=d), uniform(m, hidden, fan_in=d)
        self.bn_weight = torch.nn.Parameter(torch.ones(m, hidden))
        self.bn_bias = torch.nn.Parameter(torch.zeros(m, hidden))
        self.register_buffer("bn_mean", torch.zeros(m, hidden))
        self.register_buffer("bn_var", torch.ones(m, hidden))
        self.w2, self.b2 = uniform(m, c, hidden, fan_in=hidden), uniform(m, c, fan_in=hidden)
        if zero_out:  # residual f_q: starts as exactly its centroid-similarity term
            with torch.no_grad():
                self.w2.zero_()
                self.b2.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, B, D] -> logits [M, B, C]; batch statistics (training), running ones updated (momentum 0.1)."""
        z = torch.baddbmm(self.b1[:, None, :], x, self.w1.transpose(1, 2))  # [M, B, Hd]
        mean = z.mean(1)
        var = z.var(1, unbiased=False)
        with torch.no_grad():
            b = z.shape[1]
            self.bn_mean.mul_(0.9).add_(0.1 * mean)
            self.bn_var.mul_(0.9).add_(0.1 * var * b / max(b - 1, 1))
        h = (z - mean[:, None]) / torch.sqrt(var[:, None] + BN_EPS) * self.bn_weight[:, None] + self.bn_bias[:, None]
        return torch.baddbmm(self.b2[:, None, :], torch.relu(h), self.w2.transpose(1, 2))

    def export(self) -> dict[str, torch.Tensor]:
        """Weights and running statistics, copied to the CPU (fp32)."""
        return {k: v.detach().cpu().clone()
                for k, v in {**dict(self.named_parameters()), **dict(self.named_buffers())}.items()}


def long_range_target(q_post: torch.Tensor, k: torch.Tensor, assign: torch.Tensor, p: torch.Tensor, c: int,
                      min_dist: int, sink: int, group: int, target: str) -> torch.Tensor:
    """What f_q is trained to output, for queries q_post [KVH, B, D] (post-RoPE) at positions p [B] of
    one window with keys k [KVH, N, D] in buckets assign [KVH, N]. Long-range keys of position p:
    j in [sink, p - min_dist]. Returns [KVH, B, C] (`query_mass`) or [KVH, B // G, C] (group targets:
    the batch holds the G heads of each group at each position, consecutively), rows summing to 1.

    * `query_mass` (paper Eq. 1): the query's softmax over its long-range keys, summed per bucket.
    * `group_mass`: each head's softmax over every visible key (sink and recent keys included), its
      long-range part summed per bucket and averaged over the group's heads, normalized: a head that
      mostly attends to the sink or to recent tokens weighs little, as in the decode's attention.
    * `group_density`: `group_mass` per long-range key of the bucket (divided by its number of
      long-range keys): the mass a probe gains per key read, so top-ℓ picks the buckets that give
      the most attention per key visited instead of the largest ones.
    """
    kvh, b, d = q_post.shape
    n = k.shape[1]
    dev = k.device
    j = torch.arange(n, device=dev)
    far = (j[None, :] >= sink) & (j[None, :] <= p[:, None] - min_dist)  # [B, N] long-range pairs
    logit = torch.bmm(q_post, k.transpose(1, 2)) * d ** -0.5  # [KVH, B, N]
    idx = assign[:, None, :].expand(kvh, b, n)
    if target == "query_mass":
        attn = torch.softmax(logit.masked_fill(~far[None], float("-inf")), dim=-1)
        return torch.zeros(kvh, b, c, device=dev).scatter_add_(2, idx, attn)
    attn = torch.softmax(logit.masked_fill(j[None, None, :] > p[None, :, None], float("-inf")), dim=-1) * far[None]
    mass = torch.zeros(kvh, b, c, device=dev).scatter_add_(2, idx, attn)
    mass = mass.view(kvh, b // group, group, c).mean(2)  # [KVH, B/G, C]
    if target == "group_density":
        one = far[None, ::group].expand(kvh, -1, -1).float()  # [KVH, B/G, N]: one row per position
        size = torch.zeros(kvh, b // group, c, device=dev).scatter_add_(2, idx[:, ::group], one)
        mass = mass / size.clamp_min(1)
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def gather_queries(qs: torch.Tensor, p: torch.Tensor, g: torch.Tensor, group: int) -> torch.Tensor:
    """qs [H, N, D], positions p [B], group members g [B] -> [KVH, B, D] (query head kvh * G + g)."""
    kvh = qs.shape[0] // group
    qh = torch.arange(kvh, device=qs.device)[:, None] * group + g[None, :]
    return qs[qh, p[None, :].expand(kvh, -1)]


def target_table(q: torch.Tensor, k: torch.Tensor, assign: torch.Tensor, e: torch.Tensor, c: int, min_dist: int,
                  sink: int, group: int, target: str, chunk: int = 128) -> torch.Tensor:
    """`long_range_target` of every position e [P] of one window, computed once: [KVH, P, C] (group
    targets) or [KVH, P, G, C] (`query_mass`). Chunks of positions only read the keys up to their last
    position (the later ones are masked anyway)."""
    out = []
    for s0 in range(0, len(e), chunk):
        p = e[s0:s0 + chunk].repeat_interleave(group)
        g = torch.arange(group, device=p.device).repeat(len(p) // group)
        top = int(p.max()) + 1
        t = long_range_target(gather_queries(q, p, g, group), k[:, :top], assign[:, :top], p, c, min_dist, sink, group,
                              target)
        out.append(t if target != "query_mass" else t.view(t.shape[0], -1, group, c))
    return torch.cat(out, dim=1)


def far_top1(q: torch.Tensor, k: torch.Tensor, e: torch.Tensor, min_dist: int, sink: int, group: int,
             chunk: int = 128) -> torch.Tensor:
    """The paper's long-range queries (§4: "we discard all queries whose distance to the top-1
    matching key is less than 1024 tokens"): for queries q [H, N, D] and keys k [KVH, N, D]
    (post-RoPE, one window) at positions e [P], whether query head g of KV head h has its top-1 key
    (largest q·k over j in [sink, p]: the sinks are the decode's dense part) at distance >= min_dist.
    Returns [KVH, P, G] bool."""
    kvh, _, d = k.shape
    out = []
    for s0 in range(0, len(e), chunk):
        p = e[s0:s0 + chunk]
        top = int(p.max()) + 1
        logit = torch.einsum("hgbd,hnd->hgbn", q[:, p].view(kvh, group, len(p), d), k[:, :top])
        j = torch.arange(top, device=k.device)
        logit = logit.masked_fill((j[None, :] > p[:, None]) | (j[None, :] < sink), float("-inf"))
        out.append((logit.argmax(-1) <= (p - min_dist)[None, None, :]).permute(0, 2, 1))
    return torch.cat(out, dim=1)
