"""Decode: answer a question over a persisted context, token by token.

The model runs the question and each generated token through transformers' own modules; the
attention hook (`decoder/attention.py`) hands every layer's attention to `DecodeStep.attend`, which
plans (the method selects context positions for this layer and step) and runs (exact attention
over sink + window + selection, plus the request's own tokens). The context's K/V come from the
DRAM tier, loaded lazily per layer on first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoder.attention import dense_attention, merge_selection, sparse_attention
from indexer.base import KVView, MethodParams, MethodSession


class ContextKV:
    """Per-layer access to a context's persisted K/V; `load(name, layer)` goes through the DRAM tier."""

    def __init__(self, n_tokens: int, load: Callable[[str, int], torch.Tensor], device: str = "cpu"):
        self.n_tokens = n_tokens
        self._load = load
        self.device = device

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._load("kv/k", layer).to(self.device, non_blocking=True)
        v = self._load("kv/v", layer).to(self.device, non_blocking=True)
        return k, v


@dataclass
class StepStats:
    steps: int = 0
    touched_sum: float = 0.0  # sum over (layer, kv head, query token) of fraction of visible KV read
    touched_n: int = 0
    select_s: float = 0.0
    attend_s: float = 0.0

    @property
    def kv_fraction(self) -> float:
        return self.touched_sum / max(self.touched_n, 1)


class DecodeStep:
    def __init__(self, spec, ctx: ContextKV, session: MethodSession, params: MethodParams, model_dtype):
        self.spec = spec
        self.ctx = ctx
        self.session = session
        self.params = params
        self.dtype = model_dtype
        self.q_pos: torch.Tensor | None = None
        self.stats = StepStats()
        self.per_layer_touched = torch.zeros(spec.num_layers, dtype=torch.float64)

    def attend(self, layer: int, query, key, value, scaling) -> torch.Tensor:
        # query [1, H, T, D]; key/value [1, KVH, M, D]: the request's own tokens incl. this step's
        spec = self.spec
        kvh, g = spec.num_kv_heads, spec.group_size
        _, h, t, d = query.shape
        ctx_k, ctx_v = self.ctx.layer(layer)
        ctx_k, ctx_v = ctx_k.to(query.dtype), ctx_v.to(query.dtype)
        q = query[0].reshape(kvh, g, t, d)  # q head i*G + j belongs to kv head i (repeat_kv order)
        kv = KVView(ctx_k, ctx_v, key[0], value[0], self.q_pos)
        t0 = time.perf_counter()
        custom = self.session.attend(layer, q, kv)
        sel = self.session.select(layer, q, kv) if custom is None else None
        t1 = time.perf_counter()
        if custom is not None:
            out, frac = custom
            frac = frac.double().cpu()
        elif sel is None:
            out = dense_attention(q, ctx_k, ctx_v, key[0], value[0], scaling)
            frac = torch.ones(kvh, t, dtype=torch.float64)
        else:
            idx = merge_selection(sel, self.q_pos, self.params.sink, self.params.window)
            out = sparse_attention(q, idx, ctx_k, ctx_v, key[0], value[0], scaling)
            frac = (idx >= 0).sum(-1).double() / (self.q_pos[None, :].double() + 1)
        t2 = time.perf_counter()
        self.session.append(layer, key[0, :, -t:], value[0, :, -t:], self.q_pos)
        self.stats.select_s += t1 - t0
        self.stats.attend_s += t2 - t1
        self.stats.touched_sum += float(frac.sum())
        self.stats.touched_n += frac.numel()
        self.per_layer_touched[layer] += float(frac.mean())
        return out.reshape(h, t, d).transpose(0, 1).unsqueeze(0)  # [1, T, H, D]


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    ttft_s: float = 0.0
    decode_s: float = 0.0
    stats: StepStats = field(default_factory=StepStats)


@torch.inference_mode()
def generate(
    lm,
    ctx: ContextKV,
    session: MethodSession,
    params: MethodParams,
    question_ids: list[int],
    *,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Greedy (temperature 0) or temperature sampling over context + question."""
    from transformers import DynamicCache

    model = lm.model
    device = next(model.parameters()).device
    n = ctx.n_tokens
    step = DecodeStep(lm.spec, ctx, session, params, model.dtype)
    cache = DynamicCache(config=model.config)
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    res = GenerationResult(stats=step.stats)
    t_start = time.perf_counter()
    inp = torch.tensor([question_ids], dtype=torch.long, device=device)
    pos = n
    t_first = None
    for i in range(max_tokens):
        t = inp.shape[1]
        step.q_pos = torch.arange(pos, pos + t, device=device)
        out = model(
            input_ids=inp, position_ids=step.q_pos[None], past_key_values=cache,
            use_cache=True, logits_to_keep=1, ctx_step=step,
        )
        step.stats.steps += 1
        logits = out.logits[0, -1].float()
        if temperature <= 0:
            tok = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            tok = int(torch.multinomial(probs, 1, generator=gen))
        if t_first is None:
            t_first = time.perf_counter()
            res.ttft_s = t_first - t_start
        pos += t
        if tok in lm.eos_token_ids:
            res.finish_reason = "stop"
            break
        res.token_ids.append(tok)
        if on_token is not None:
            on_token(tok)
        if should_stop is not None and should_stop():
            res.finish_reason = "cancelled"
            break
        inp = torch.tensor([[tok]], dtype=torch.long, device=device)
    res.decode_s = time.perf_counter() - (t_first or t_start)
    session.close()  # the request ends here (a session dropped on an error is released when collected)
    return res
