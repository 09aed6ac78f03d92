"""Decode runner: many requests over persisted contexts, one token each per `step()`, gpt-fast style.

`decoder/generate.py` runs one request through transformers' own modules (the attention hook hands
each layer to the method's planner and an attention backend); on a GPU that path is bound by
Python and kernel launches (~58 ms/token for an 8B model whatever the context, DESIGN §7). This
runner computes the same function with the same weights in a few plain functions (shapes in
comments), batches the dense work over the active requests, and replays each one-token step from a
CUDA graph when it can:

* **Weights**: the loaded HF model's (`lm.model`, LlamaForCausalLM-like: Llama 2/3.x, SmolLM2,
  Qwen2 with q/k/v biases), used in place. q/k/v and gate/up are concatenated once into fused
  matrices and, on a GPU, the model's own parameters are re-pointed to views of them (`fuse_weights`;
  on the CPU a fused copy is kept instead, so the reference path's numerics never change): the
  model keeps working, and on a GPU no memory is doubled. RMSNorm eps, the rotary module's
  `inv_freq` and `attention_scaling` (default, linear, llama3 and yarn rope) and the attention
  scale come from the model; `unsupported(model)` says what it cannot run (dynamic/longrope rope,
  q/k norms, sliding-window layers, activations other than SiLU).
* **Requests**: `add(ctx, planner, params, question_ids, max_new_tokens, temperature, seed)` ->
  slot. Each request owns a static request-local K/V buffer [L, KVH, max_local, D] (max_local =
  question + max_new_tokens), written in place at its current length (a device index: no host
  sync), and device scalars for its next input token and position. Its first step runs the whole
  question as one chunk (T = len(question)) through the same layer code; later steps T = 1.
* **A step**: embedding, per layer RMSNorm -> fused QKV -> RoPE -> (per request: write the local
  K/V, `planner.plan`, `backend.run` over sink/window/local + plan, `planner.update`) -> o_proj ->
  RMSNorm -> SiLU MLP; final norm and lm_head on each request's last token; sampling on the device.
  Projections and MLP run once for all requests of the batch ([B, C] rows), attention loops over
  them (each has its own context, planner and plan). Only the sampled token ids are read back:
  one host sync per step, to stream them. On CUDA the small ops between the GEMMs (RMSNorm with
  the residual add before it, RoPE of q and k, SiLU·up) are one Triton launch each
  (`decoder/kernels/layer.py`, `fused_layer`): ~15 kernels per layer instead of ~41, the same
  roundings as the torch functions below, which stay the reference and the CPU path.
* **Requests' attention in parallel** (`parallel=True`, CUDA, B > 1, context on the device): each
  request's plan + run + update of a layer is issued on its own side stream (the batch position's
  stream: fork from the step's stream, join back before o_proj), so the small search and attention
  kernels of different requests overlap on the GPU instead of queueing one after another (a
  graph-captured step keeps them as parallel branches). Kernel workspaces are per stream
  (`indexer.kernels.Workspaces`), so requests never share scratch memory; a request's tensors are
  only touched between a fork and the join that follows it, so stream order is preserved across
  layers and steps. Results do not depend on it (same kernels, same inputs; test).
* **Sampling**: temperature 0 = greedy (argmax of the fp32 logits, as `generate`). Temperature > 0
  = Gumbel-max with counter-based noise: token = argmax(logits / T + g), g_i = -log(-log(u_i)),
  u_i a 32-bit integer hash of (seed, the token's absolute position, i). That is an exact draw
  from softmax(logits / T), reproducible for a seed whatever the batch and whether the step was
  replayed from a graph or not, and needs no generator state (graph-safe). It is *not* the
  stream `generate`'s `torch.multinomial` draws for the same seed. Seed None: a random one.
* **CUDA graph** (`graphs=True` on CUDA): the one-token step of the current batch (embedding to
  sampling, incl. each request's plan/run/update and the in-place advance of its position and
  next token) is captured once and replayed while the batch stays the same. A planner's
  `graph_safe` attribute (default True) says its plan()/update() for T = 1 neither branch on host
  state that changes per step (csattn with a search period > 1 does: it reuses a plan for P - 1
  steps) nor allocate persistent state after the request's first one-token step. The rules:
  - capture only when every request of the batch is graph-safe and the previous step ran exactly
    this batch eagerly (so lazily allocated planner state and the grow-only kernel workspaces of
    each request's stream exist outside the graph's memory pool), no prompt chunk ran in this step,
    and the backend keeps the context on the device (`offload` plans on the host: eager);
  - replay only the graph of exactly this batch, and only if no eager forward ran since its
    capture (an eager call may grow and so free a kernel workspace the graph points to);
  - otherwise run eagerly (same code) and drop the graph; a failed capture falls back to eager
    for that batch and says why in `graph_status`.
  update() is captured with the rest rather than run eagerly after each replay: plan() hands its
  pending update (CTkvr's FIFO push, LFPS's table update) to update() through the planner's Python
  state, which a replay does not recreate, so an eager update() would find nothing pending; the
  captured one replays its device work exactly. Host-side bookkeeping inside plan()/update() (step
  counters some planners keep for `stats()`) runs at capture time only, so such counters undercount
  replayed steps.
  Why not `torch.compile(mode="reduce-overhead")`: planners keep Python-side state (dicts of
  per-layer tensors, pending updates) and launch their own Triton kernels; dynamo would graph-break
  around every plan/update and re-trace per request, and cudagraph trees would copy inputs we
  already keep static. A hand-captured graph over static per-request buffers is simpler and
  replays the whole step as one launch.

Numerics: the runner's logits equal the transformers path (`generate`: the model's own modules +
the ctxcache hook, same planner, same backend) up to the summation order of the fused GEMMs and of
batched vs single-row matmuls (measured on the default model, fp32 CPU: see tests/test_runner.py).

What a caller must guarantee: a context's K/V (fetched once per request at `add`) and the
planner's index arrays stay allocated while the request is active — a captured graph keeps raw
pointers (the GPU tier must not evict them under an active request).
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from decoder.backends import AttentionBackend, frame_fraction
from indexer.base import KVView, MethodParams, Planner, graph_capturing

_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Weights


@dataclass
class LayerWeights:
    ln1: torch.Tensor  # [C]
    wqkv: torch.Tensor  # [(H + 2 KVH) D, C] fused q/k/v (the model's q/k/v_proj are views of it)
    bqkv: torch.Tensor | None  # [(H + 2 KVH) D] (Qwen2) or None
    wo: torch.Tensor  # [C, H D]
    bo: torch.Tensor | None
    ln2: torch.Tensor  # [C]
    wgu: torch.Tensor  # [2 I, C] fused gate/up
    bgu: torch.Tensor | None
    wdown: torch.Tensor  # [C, I]
    bdown: torch.Tensor | None
    scale: float  # attention scale (the model's `self_attn.scaling`)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, C]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [C]
    lm_head: torch.Tensor  # [V, C] (tied: the embedding)
    eps: float
    inv_freq: torch.Tensor  # [D / 2] fp32, the rotary module's (rope scaling applied)
    rope_scaling: float  # the rotary module's attention_scaling (1.0 but for yarn & co)
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def read_bytes(self) -> int:
        """Bytes one step reads of the weights: every matrix and norm, the lm_head, not the
        embedding table (a step reads B rows of it) unless it is the tied lm_head."""
        seen, total = set(), 0
        mats = [self.norm, self.lm_head]
        for lw in self.layers:
            mats += [t for t in (lw.ln1, lw.wqkv, lw.bqkv, lw.wo, lw.bo, lw.ln2, lw.wgu, lw.bgu, lw.wdown, lw.bdown)
                     if t is not None]
        for t in mats:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


_FUSED_ATTR = "_ctxcache_runner_weights"


def unsupported(model) -> list[str]:
    """Reasons the runner cannot run this model (empty = fine)."""
    cfg = model.config
    reasons = []
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if rot is None or layers is None or not hasattr(model, "lm_head"):
        return [f"{type(model).__name__} is not a Llama-like causal LM (model.layers, rotary_emb, lm_head)"]
    if getattr(rot, "rope_type", "default") in ("dynamic", "longrope"):
        reasons.append(f"rope type {rot.rope_type!r} changes its frequencies with the sequence length")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        reasons.append(f"activation {cfg.hidden_act!r} (the runner's MLP is SiLU-gated)")
    attn = layers[0].self_attn
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        reasons.append("per-head q/k norms (Qwen3-style) are not implemented")
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        reasons.append(f"layer types {sorted(kinds)} (only full attention)")
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        reasons.append("logit soft-capping is not implemented")
    if not hasattr(layers[0].mlp, "gate_proj"):
        reasons.append("the MLP has no gate_proj/up_proj/down_proj")
    return reasons


def _fuse(mods: list[torch.nn.Linear], repoint: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate Linear weights (and biases) along the output dim once. `repoint`: also re-point
    the modules' parameters to views of the result, so nothing is stored twice (GPU, where memory is
    what limits a batch). The model then computes the same function, but not always the same bits:
    a one-token (GEMV) matmul over a view can round differently (measured on the CPU: 6e-5 on the
    default model's logits). So on the CPU, where `decoder.generate` is the reference path and
    memory is not the limit, the runner keeps a fused copy and leaves the model untouched."""
    w = torch.cat([m.weight.data for m in mods], dim=0)
    b = None
    if any(m.bias is not None for m in mods):
        b = torch.cat([m.bias.data if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=w.dtype, device=w.device)
                       for m in mods])
    if repoint:
        o = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = w[o:o + n]
            if m.bias is not None:
                m.bias.data = b[o:o + n]
            o += n
    return w, b


@torch.no_grad()
def fuse_weights(model) -> ModelWeights:
    """The runner's view of a Llama-like model's weights (made once per model object, cached on it)."""
    got = getattr(model, _FUSED_ATTR, None)
    if got is not None:
        return got
    reasons = unsupported(model)
    if reasons:
        raise ValueError("the decode runner cannot run this model: " + "; ".join(reasons))
    cfg, inner = model.config, model.model
    layers = []
    for layer in inner.layers:
        a, mlp = layer.self_attn, layer.mlp
        repoint = a.q_proj.weight.device.type == "cuda"
        wqkv, bqkv = _fuse([a.q_proj, a.k_proj, a.v_proj], repoint)
        wgu, bgu = _fuse([mlp.gate_proj, mlp.up_proj], repoint)
        layers.append(LayerWeights(
            layer.input_layernorm.weight, wqkv, bqkv, a.o_proj.weight, a.o_proj.bias,
            layer.post_attention_layernorm.weight, wgu, bgu, mlp.down_proj.weight, mlp.down_proj.bias,
            float(a.scaling)))
    n_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rot = inner.rotary_emb
    w = ModelWeights(
        embed=inner.embed_tokens.weight, layers=layers, norm=inner.norm.weight, lm_head=model.lm_head.weight,
        eps=float(inner.norm.variance_epsilon), inv_freq=rot.inv_freq.float(),
        rope_scaling=float(rot.attention_scaling), n_heads=n_heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads, head_dim=head_dim)
    setattr(model, _FUSED_ATTR, w)
    return w


# ---------------------------------------------------------------------------------------------
# The layer code: plain functions (S = rows of the step: sum over requests of their T)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] -> [..., C]; LlamaRMSNorm's arithmetic (fp32 statistics, weight in x's dtype)."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [S] int -> cos, sin [S, D] in `dtype`; the rotary module's arithmetic (fp32 angles)."""
    freqs = pos[:, None].float() * inv_freq[None, :]  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, heads, D], cos/sin [S, D] -> [S, heads, D] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _layer_kernels(w: ModelWeights, device: torch.device, fused: bool | None):
    """decoder/kernels/layer.py when the runner uses it (see `Runner`), else None."""
    if fused is False or (fused is None and device.type != "cuda"):
        return None
    try:
        from decoder.kernels import layer
    except ImportError:  # no Triton
        return None
    probe = torch.empty(0, dtype=w.embed.dtype, device=device)
    return None if layer.unsupported(probe, w.head_dim) else layer


def mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """x [S, C] -> [S, C]: down(silu(gate(x)) * up(x))."""
    gate, up = F.linear(x, lw.wgu, lw.bgu).chunk(2, dim=-1)  # [S, I] each
    return F.linear(F.silu(gate) * up, lw.wdown, lw.bdown)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensors holding uint32 values; no int64 overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """seed, pos [B] int64 -> [B, V] fp32 standard Gumbel noise, a pure function of (seed, pos, i)."""
    key = _mix32((seed & _MASK32) ^ _mix32(pos & _MASK32))  # [B]
    bits = _mix32((key[:, None] + torch.arange(vocab, device=seed.device)[None, :]) & _MASK32) >> 9  # [B, V] 23 bits
    u = (bits.float() + 0.5) * 2.0 ** -23  # in (0, 1), exactly representable
    return -torch.log(-torch.log(u))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor,
                  hot: bool) -> torch.Tensor:
    """logits [B, V] fp32 -> [B] int64. Greedy where temperature is 0; Gumbel-max over
    logits / temperature elsewhere (`hot`: a host flag, True when any row samples)."""
    greedy = logits.argmax(-1)  # first maximum, as torch.argmax in generate()
    if not hot:
        return greedy
    g = gumbel_noise(seed, pos, logits.shape[-1])
    drawn = (logits / temperature.clamp_min(1e-6)[:, None] + g).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


# ---------------------------------------------------------------------------------------------
# Requests


def fork_join(streams: list | None, fns: list) -> list:
    """Run fns[i]() with streams[i] as the current stream, each after what the current stream has
    queued so far; the current stream then waits for all of them (inside a CUDA graph capture this
    records parallel branches). streams None: run them in order on the current stream."""
    if streams is None:
        return [fn() for fn in fns]
    main = torch.cuda.current_stream()
    outs = []
    for s, fn in zip(streams, fns, strict=True):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            outs.append(fn())
    for s in streams:
        main.wait_stream(s)
    return outs


def graph_safe(planner: Planner) -> bool:
    """Whether a planner's one-token plan()/update() may be captured and replayed (see the module
    docstring). Planners say so with a `graph_safe` attribute; one without it counts as safe unless
    it has a search `period` > 1 (csattn's schedules, which reuse a plan by a host-side count)."""
    safe = getattr(planner, "graph_safe", None)
    if safe is None:
        safe = getattr(planner, "period", 1) == 1
    return bool(safe)


@dataclass
class Request:
    slot: int
    planner: Planner
    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [KVH, N, D], held while active
    n_ctx: int
    sink: int
    window: int
    loc_k: torch.Tensor  # [L, KVH, max_local, D] the request's own keys (question + generated)
    loc_v: torch.Tensor
    question: torch.Tensor  # [Tq] int64 on the device
    tok: torch.Tensor  # [1] int64: the next input token (written by the step that sampled it)
    pos: torch.Tensor  # [1] int64: absolute position of the next input token
    temperature: torch.Tensor  # [1] fp32
    seed: torch.Tensor  # [1] int64
    max_new: int
    hot: bool  # temperature > 0
    safe: bool  # graph_safe(planner)
    produced: int = 0
    started: bool = False  # the question chunk has run
    warm: bool = False  # one eager one-token step has run
    finish_reason: str | None = None  # "stop" | "length" once finished
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # [V] fp32 of the last step (a view of the step's output)
    touched: torch.Tensor | None = None  # [L] fp64 sums of frame fractions (track_fraction)
    counted: int = 0  # (kv head, query token) pairs summed in `touched`, per layer

    @property
    def active(self) -> bool:
        return self.finish_reason is None


@dataclass
class _Graph:
    key: tuple
    graph: object  # torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [B] int64, static output
    logits: torch.Tensor  # [B, V] fp32, static output


class Runner:
    """Batched decode over persisted contexts; see the module docstring.

    `backend`: the attention backend every request runs with (an `AttentionBackend`).
    `graphs`: capture and replay one-token steps on CUDA (False: always eager).
    `track_fraction`: accumulate each request's fraction of visible K/V read (frame + plan) on the
    device, as `generate`'s StepStats, over the steps that run eagerly (the question, a batch's
    first one-token step, every step without graphs): ~20 small kernels per layer and request
    (`frame_fraction` over the plan's width), which a captured graph would replay every token.
    `parallel`: on CUDA, each request's attention runs on its own side stream (module docstring).
    `fused_layer`: RMSNorm (+ residual add), RoPE of q and k and SiLU·up as one Triton launch each
    (`decoder/kernels/layer.py`, same roundings as the torch functions here); None = on CUDA where
    Triton runs them, True = also through Triton's interpreter (tests), False = torch.
    """

    def __init__(self, lm, backend: AttentionBackend, device: str | torch.device | None = None, *,
                 graphs: bool = True, track_fraction: bool = False, parallel: bool = True,
                 fused_layer: bool | None = None):
        model = lm.model
        self.w = fuse_weights(model)
        self.device = torch.device(device) if device is not None else self.w.embed.device
        self.dtype = self.w.embed.dtype
        self.backend = backend
        self.eos = frozenset(getattr(lm, "eos_token_ids", ()) or ())
        self.graphs = graphs and self.device.type == "cuda"
        self.track_fraction = track_fraction
        #: debugging: run every eager forward and graph replay under torch.cuda.set_sync_debug_mode("error")
        #: (set it after the requests' first steps, which may allocate lazily)
        self.sync_check = False
        self.requests: dict[int, Request] = {}
        self.graph_status = ""  # how the last decode batch ran: "captured" | "replayed" | "eager: <why>"
        self.captures = 0
        self._next_slot = 0
        self._graph: _Graph | None = None
        self._failed: dict[tuple, str] = {}  # batch key -> why its capture failed
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.parallel = parallel and self.device.type == "cuda" and not backend.context_on_host
        self._side: list[torch.cuda.Stream] = []  # one per batch position (parallel attention)
        self._eager_key: tuple | None = None  # the batch of the last eager one-token step
        self.layer_kernels = _layer_kernels(self.w, self.device, fused_layer)  # None: the torch functions

    # -- requests ------------------------------------------------------------------------------

    def add(self, ctx, planner: Planner, params: MethodParams, question_ids: list[int], max_new_tokens: int,
            temperature: float = 0.0, seed: int | None = None) -> int:
        """A new request over `ctx` (a `decoder.generate.ContextKV`); its first `step()` runs the
        question and returns its first token. The planner belongs to the request from now on
        (closed by `remove`)."""
        if not question_ids:
            raise ValueError("a request needs at least one question token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        w, dev = self.w, self.device
        n = ctx.n_tokens
        max_local = len(question_ids) + max_new_tokens
        sink, window = params.frame(n)
        shape = (len(w.layers), w.n_kv_heads, max_local, w.head_dim)
        if seed is None:
            seed = secrets.randbits(31)
        slot = self._next_slot
        self._next_slot += 1
        r = Request(
            slot=slot, planner=planner, ctx_kv=[ctx.layer(i) for i in range(len(w.layers))], n_ctx=n, sink=sink,
            window=window, loc_k=torch.zeros(shape, dtype=self.dtype, device=dev),
            loc_v=torch.zeros(shape, dtype=self.dtype, device=dev),
            question=torch.tensor(question_ids, dtype=torch.long, device=dev),
            tok=torch.zeros(1, dtype=torch.long, device=dev), pos=torch.full((1,), n, dtype=torch.long, device=dev),
            temperature=torch.full((1,), max(float(temperature), 0.0), dtype=torch.float32, device=dev),
            seed=torch.full((1,), int(seed) & 0x7FFFFFFF, dtype=torch.long, device=dev),
            max_new=max_new_tokens, hot=temperature > 0, safe=graph_safe(planner),
            touched=torch.zeros(len(w.layers), dtype=torch.float64, device=dev))
        self.requests[slot] = r
        return slot

    def remove(self, slot: int) -> None:
        """End a request (finished or not): its planner is closed and its buffers released."""
        r = self.requests.pop(slot, None)
        if r is None:
            return
        if self._graph is not None and slot in self._graph.key[0]:
            self._graph = None
        r.planner.close()

    def active(self) -> list[int]:
        return [s for s, r in self.requests.items() if r.active]

    def kv_fraction(self, slot: int) -> float:
        """Mean fraction of the visible K/V the request read (needs `track_fraction`; a host sync)."""
        r = self.requests[slot]
        return float(r.touched.sum()) / (r.counted * len(self.w.layers)) if r.counted else 0.0

    # -- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[tuple[int, int]]:
        """Advance every active request by one token: (slot, token) per request. A request
        finishes ("stop") when it samples an EOS token (returned too) or ("length") after
        max_new_tokens tokens; it then leaves the batch but stays until `remove`."""
        todo = [r for r in self.requests.values() if r.active]
        if not todo:
            return []
        if self._stream is None:
            got = self._step(todo)
        else:
            cur = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(cur)
            with torch.cuda.stream(self._stream):
                got = self._step(todo)
            cur.wait_stream(self._stream)
        return got

    def _step(self, todo: list[Request]) -> list[tuple[int, int]]:
        new = [r for r in todo if not r.started]
        batch = [r for r in todo if r.started]
        outs = []
        for r in new:  # the question as one chunk, eagerly, one request at a time
            self._graph = None
            with self._no_sync():
                tok, logits = self._forward([r], r.question.shape[0])
            r.started = True
            r.logits = logits[0]
            outs.append((r, tok))
        if batch:
            tok, logits = self._decode(batch, prompted=bool(new))
            for i, r in enumerate(batch):
                r.logits = logits[i]
            outs += [(r, tok[i:i + 1]) for i, r in enumerate(batch)]
        ids = torch.cat([t for _, t in outs]).tolist()  # the step's one host sync
        got = []
        ran_eagerly = not batch or self.graph_status.startswith("eager")
        for (r, _), t in zip(outs, ids):
            if self.track_fraction and (r.produced == 0 or ran_eagerly):  # the steps `_attend` counted
                r.counted += self.w.n_kv_heads * (r.question.shape[0] if r.produced == 0 else 1)
            r.produced += 1
            r.tokens.append(t)
            if t in self.eos:
                r.finish_reason = "stop"
            elif r.produced >= r.max_new:
                r.finish_reason = "length"
            got.append((r.slot, t))
        return got

    def _decode(self, batch: list[Request], prompted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-token step of `batch`: replayed, captured, or eager."""
        key = tuple(r.slot for r in batch)
        why = None
        if not self.graphs:
            why = "graphs off"
        elif self.backend.context_on_host:
            why = f"backend {self.backend.name} plans on the host"
        elif not all(r.safe for r in batch):
            why = "a planner is not graph-safe"
        elif not all(r.warm for r in batch) or prompted or self._eager_key != key:
            why = "warming up"
        elif key in self._failed:
            why = self._failed[key]
        if why is None:
            g = self._graph
            if g is not None and g.key == key:
                with self._no_sync():
                    g.graph.replay()
                self.graph_status = "replayed"
                return g.tokens, g.logits
            captured = self._capture(batch, key)
            if captured:
                return captured
            why = self._failed[key]
        self._graph = None
        with self._no_sync():
            tok, logits = self._forward(batch, 1)
        for r in batch:
            r.warm = True
        self._eager_key = key
        self.graph_status = f"eager: {why}"
        return tok, logits

    @contextlib.contextmanager
    def _no_sync(self):
        if not (self.sync_check and self.device.type == "cuda"):
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def _capture(self, batch: list[Request], key: tuple):
        self._graph = None
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=self._stream, capture_error_mode="thread_local"):
                tok, logits = self._forward(batch, 1)
        except Exception as e:  # noqa: BLE001 - a planner that cannot be captured runs eagerly
            self._failed[key] = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
            return None
        g.replay()  # capture records without running: this runs the step
        self._graph = _Graph(key, g, tok, logits)
        self.captures += 1
        self.graph_status = "captured"
        return tok, logits

    def _forward(self, reqs: list[Request], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request of `reqs` runs its next T = t tokens (the question when t > 1, which is for
        one request at a time; its sampled token when t = 1). Returns (tokens [B], logits [B, V])
        and advances each request's position and next token on the device."""
        w, dev = self.w, self.device
        b = len(reqs)
        h, kvh, d = w.n_heads, w.n_kv_heads, w.head_dim
        if t == 1:
            ids = torch.cat([r.tok for r in reqs])  # [B]
            q_pos = [r.pos.clone() for r in reqs]  # [1] each
        else:
            (r,) = reqs
            ids = r.question  # [T]
            q_pos = [r.pos + torch.arange(t, device=dev)]  # [T]
        pos = torch.cat(q_pos)  # [S], S = B * T
        slots = [p - r.n_ctx for r, p in zip(reqs, q_pos)]  # local slot of each query token
        x = F.embedding(ids, w.embed)  # [S, C]
        cos, sin = rope_cos_sin(pos, w.inv_freq, w.rope_scaling, x.dtype)  # [S, D]
        fk = self.layer_kernels
        branch = None  # fused path: the MLP output not yet added to x (added by the next RMSNorm)
        for layer, lw in enumerate(w.layers):
            if fk is None:
                qkv = F.linear(rms_norm(x, lw.ln1, w.eps), lw.wqkv, lw.bqkv)  # [S, (H + 2 KVH) D]
                q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)  # v: the view below, both paths
                q = apply_rope(q.view(-1, h, d), cos, sin)  # [S, H, D]
                k = apply_rope(k.view(-1, kvh, d), cos, sin)  # [S, KVH, D]
            else:
                hn, x = (fk.rms_norm(x, lw.ln1, w.eps), x) if branch is None else fk.rms_norm(branch, lw.ln1, w.eps, x)
                qkv = F.linear(hn, lw.wqkv, lw.bqkv)
                q, k = fk.rope_qk(qkv, cos, sin, h, kvh, d)
            v = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
            outs = fork_join(self._streams(b), [
                lambda i=i, r=r: self._attend(r, layer, lw.scale, q[i * t:(i + 1) * t], k[i * t:(i + 1) * t],
                                              v[i * t:(i + 1) * t], q_pos[i], slots[i])
                for i, r in enumerate(reqs)])
            a = outs[0] if b == 1 else torch.cat(outs)  # [S, H D]
            if fk is None:
                x = x + F.linear(a, lw.wo, lw.bo)
                x = x + mlp(rms_norm(x, lw.ln2, w.eps), lw)
            else:  # x + o_proj, its RMSNorm, SiLU·up: two launches around the projections
                hn, x = fk.rms_norm(F.linear(a, lw.wo, lw.bo), lw.ln2, w.eps, x)
                branch = F.linear(fk.silu_mul(F.linear(hn, lw.wgu, lw.bgu)), lw.wdown, lw.bdown)
        last = x.view(b, t, -1)[:, -1]  # [B, C]
        if fk is None:
            normed = rms_norm(last, w.norm, w.eps)
        else:  # the last MLP's residual add, on the rows that are read
            normed, _ = fk.rms_norm(branch.view(b, t, -1)[:, -1], w.norm, w.eps, last)
        logits = F.linear(normed, w.lm_head).float()  # [B, V]
        last_pos = pos.view(b, t)[:, -1]  # [B]
        temp = torch.cat([r.temperature for r in reqs])
        seed = torch.cat([r.seed for r in reqs])
        tok = sample_tokens(logits, temp, seed, last_pos, any(r.hot for r in reqs))  # [B]
        for i, r in enumerate(reqs):
            r.tok.copy_(tok[i:i + 1])
            r.pos += t
        return tok, logits

    def _streams(self, b: int) -> list | None:
        """The side streams of a batch of b (None: attention runs on the current stream)."""
        if not self.parallel or b < 2:
            return None
        while len(self._side) < b:
            self._side.append(torch.cuda.Stream(self.device))
        return self._side[:b]

    def _attend(self, r: Request, layer: int, scale: float, q, k, v, q_pos, slots) -> torch.Tensor:
        """One request's attention of one layer. q [T, H, D], k/v [T, KVH, D] post-RoPE, q_pos [T]
        absolute positions, slots [T] local slots -> [T, H D]."""
        w = self.w
        t = q.shape[0]
        kvh, g, d = w.n_kv_heads, w.group, w.head_dim
        new_k, new_v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, T, D]
        loc_k, loc_v = r.loc_k[layer], r.loc_v[layer]  # [KVH, max_local, D]
        loc_k.index_copy_(1, slots, new_k)
        loc_v.index_copy_(1, slots, new_v)
        ctx_k, ctx_v = r.ctx_kv[layer]
        qh = q.transpose(0, 1).reshape(kvh, g, t, d)  # q head i*G + j belongs to kv head i
        kv = KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos)
        pq, pkv = qh, kv
        if ctx_k.device != qh.device:  # offload: the planner runs where the context lives
            pq, pkv = qh.to(ctx_k.device), KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos.to(ctx_k.device))
            new_k, new_v = new_k.to(ctx_k.device), new_v.to(ctx_k.device)
        plan = r.planner.plan(layer, pq, pkv)
        out = self.backend.run(qh, kv, plan, r.sink, r.window, scale)  # [KVH, G, T, D]
        r.planner.update(layer, new_k, new_v, pkv.q_pos)
        if self.track_fraction and not graph_capturing(qh):
            r.touched[layer] += frame_fraction(plan, kv, r.sink, r.window).sum().to(r.touched.device)
        return out.reshape(w.n_heads, t, d).transpose(0, 1).reshape(t, w.n_heads * d)
