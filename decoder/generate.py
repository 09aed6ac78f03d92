"""Decode: answer a question over a persisted context, token by token.

The model runs the question and each generated token through transformers' own modules; the
attention hook (`decoder/attention.py`) hands every layer's attention to `DecodeStep.attend`, which
*plans* (the method's planner picks context positions for this layer and step) and *runs* (an
attention backend computes exact attention over the frame and the plan, `decoder/backends/`).
The context's K/V come from the caller's tiers already where the backend reads them (the GPU
tier on a GPU worker, mapped pinned DRAM in offload mode, DRAM on a CPU worker): nothing is
copied per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoder.backends import AttentionBackend, default_backend_name, frame_fraction, get_backend
from indexer.base import KVView, MethodParams, Planner


class ContextKV:
    """Per-layer access to a context's K/V; `load(name, layer)` returns the tensor where the backend
    reads it (a tier's resident copy) in the dtype it is stored in (`kv_dtype`), which may differ
    from the model's (bfloat16 K/V under a float32 model): backends and planners take either and
    compute in float32, never keeping a float32 copy of the whole context."""

    def __init__(self, n_tokens: int, load: Callable[[str, int], torch.Tensor]):
        self.n_tokens = n_tokens
        self._load = load

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._load("kv/k", layer), self._load("kv/v", layer)


class StepStats:
    """Decode statistics, accumulated on the model's device and read back once, at the end."""

    def __init__(self, n_layers: int, device):
        self.steps = 0
        self.plan_s = 0.0  # host time spent in plan() (launch time on a GPU)
        self.run_s = 0.0  # host time spent in the backend (launch time on a GPU)
        self._touched = torch.zeros(n_layers, dtype=torch.float64, device=device)  # per layer: sum of fractions
        self._count = [0] * n_layers  # per layer: (kv head, query token) pairs summed

    def add(self, layer: int, frac: torch.Tensor) -> None:  # frac [KVH, T]
        self._touched[layer] += frac.sum()
        self._count[layer] += frac.numel()

    @property
    def kv_fraction(self) -> float:
        """Mean fraction of the visible KV read per (layer, kv head, query token)."""
        n = sum(self._count)
        return float(self._touched.sum()) / n if n else 0.0

    def per_layer(self) -> list[float]:
        got = self._touched.cpu().tolist()
        return [s / c if c else 0.0 for s, c in zip(got, self._count)]


class DecodeStep:
    """One request's attention for every layer of every step: plan, run, update."""

    def __init__(self, spec, ctx: ContextKV, planner: Planner, params: MethodParams, backend: AttentionBackend,
                 device):
        self.spec = spec
        self.ctx = ctx
        self.planner = planner
        self.backend = backend
        self.sink, self.window = params.frame(ctx.n_tokens)
        self.q_pos: torch.Tensor | None = None  # [T] on the model's device
        self.stats = StepStats(spec.num_layers, device)

    def attend(self, layer: int, query, key, value, scaling) -> torch.Tensor:
        # query [1, H, T, D]; key/value [1, KVH, M, D]: the request's own tokens incl. this step's
        spec = self.spec
        kvh, g = spec.num_kv_heads, spec.group_size
        _, h, t, d = query.shape
        ctx_k, ctx_v = self.ctx.layer(layer)
        q = query[0].reshape(kvh, g, t, d)  # q head i*G + j belongs to kv head i (repeat_kv order)
        kv = KVView(ctx_k, ctx_v, key[0], value[0], self.q_pos,
                    attend_scale=scaling if self.backend.takes_attended else None)
        t0 = time.perf_counter()
        plan = self.planner.plan(layer, q, kv)
        t1 = time.perf_counter()
        out = self.backend.run(q, kv, plan, self.sink, self.window, scaling)
        t2 = time.perf_counter()
        self.planner.update(layer, key[0, :, -t:], value[0, :, -t:], self.q_pos)
        self.stats.plan_s += t1 - t0
        self.stats.run_s += t2 - t1
        self.stats.add(layer, frame_fraction(plan, kv, self.sink, self.window))
        return out.reshape(h, t, d).transpose(0, 1).unsqueeze(0)  # [1, T, H, D]


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    ttft_s: float = 0.0
    decode_s: float = 0.0
    stats: StepStats | None = None


@torch.inference_mode()
def generate(
    lm,
    ctx: ContextKV,
    planner: Planner,
    params: MethodParams,
    question_ids: list[int],
    *,
    backend: AttentionBackend | str | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Greedy (temperature 0) or temperature sampling over context + question. `backend`: an
    attention backend or its name; default `triton` on a GPU when available, else `torch_ref`.

    `should_stop` is asked before every forward pass (the question's and each new token's): when it
    says yes the generation ends there with `finish_reason` "cancelled", so a cancelled request
    costs at most the step in flight."""
    from transformers import DynamicCache

    model = lm.model
    device = next(model.parameters()).device
    if backend is None or isinstance(backend, str):
        backend = get_backend(backend or default_backend_name(device))
    n = ctx.n_tokens
    step = DecodeStep(lm.spec, ctx, planner, params, backend, device)
    cache = DynamicCache(config=model.config)
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    res = GenerationResult(stats=step.stats)
    t_start = time.perf_counter()
    inp = torch.tensor([question_ids], dtype=torch.long, device=device)
    pos = n
    t_first = None
    try:
        for _ in range(max_tokens):
            if should_stop is not None and should_stop():
                res.finish_reason = "cancelled"
                break
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
            inp = torch.tensor([[tok]], dtype=torch.long, device=device)
    finally:
        planner.close()  # the request ends here, also on an error
    res.decode_s = time.perf_counter() - (t_first or t_start)
    return res
