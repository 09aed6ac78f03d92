"""Decode runner: many requests over persisted contexts, one token each per `step()`, gpt-fast style.

`decoder/generate.py` runs one request through transformers' own modules (the attention hook hands
each layer to the method's planner and an attention backend); on a GPU that path is bound by
Python and kernel launches (~58 ms/token for an 8B model whatever the context, DESIGN §7). This
runner computes the same function with the same weights in a few plain functions (shapes in
comments), batches the dense work over the active requests, and replays each one-token step from a
CUDA graph when it can:

* **Weights**: the loaded HF model's, used in place, q/k/v and gate/up fused once
  (`decoder/weights.py`, which also says what the runner cannot run: `unsupported(model)`).
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
  roundings as the torch functions of `decoder/layers.py`, which stay the reference and the CPU path.
  The RoPE launch also stores every request's new K/V rows into its local slots (each request's
  buffer addresses are device constants made at `add`), instead of two `index_copy_` per request
  and layer.
* **Requests' attention in parallel** (`parallel=True`, CUDA, B > 1, context on the device): each
  request's plan + run + update of a layer is issued on its own side stream (the batch position's
  stream: fork from the step's stream, join back before o_proj), so the small search and attention
  kernels of different requests overlap on the GPU instead of queueing one after another (a
  graph-captured step keeps them as parallel branches). Kernel workspaces are per stream
  (`indexer.kernels.Workspaces`), so requests never share scratch memory; a request's tensors are
  only touched between a fork and the join that follows it, so stream order is preserved across
  layers and steps. Results do not depend on it (same kernels, same inputs; test).
* **Planning ahead** (`plan_ahead`, or `add(plan_ahead=)` per request; one-token steps): a search sits on the critical
  path, since layer L's plan needs layer L's query. With plan_ahead, layer L (>= 1) is planned from
  a query *predicted* from the residual stream entering layer L - 1, InfiniGen-style: layer L's own
  input RMSNorm, q/k projection (the first (H + KVH)·D rows of its fused QKV weight) and RoPE. On
  CUDA that prediction and each request's `plan(L)` run on a side stream forked at the start of
  layer L - 1 and joined just before layer L's attention, so the search overlaps layer L - 1's
  projections, attention and MLP; the attention itself still uses the true query, the true key and
  the whole frame. Planned that early, the step's own key does not exist yet: the request-local slot
  of the current token holds the *predicted* key while the planner looks (written by the side
  stream; the true key overwrites it before layer L's attention reads it). Layer 0 plans inline.
  Planners that ignore the query (`reads_query` False: full, streaming) are not planned ahead.
  Two side streams alternate by layer parity (plus per-request ones when attention runs in
  parallel): plan(L + 1), forked as soon as layer L's input residual exists (before its QKV GEMM),
  may overlap the end of plan(L) and runs while layer L's attention reads plan(L); kernel
  workspaces are per stream. Planners are called plan(L + 1) before update(L); their per-step
  state is per layer (`indexer.base.Planner`). Fidelity (KL to dense, default model, CPU): lag 1
  costs little, lag 2 breaks down at 8K (`benchmarks/bench_early_plans.py`, RESULTS.md).
* **Offload** (backends keeping the context's values in host memory): a request keeps, per layer,
  the value rows its last plans read in HBM (`cache_rows`, `Request.row_cache`); the attention of a
  one-token step reads those there and only the others over PCIe. With plan_ahead the planning side
  stream fills the cache with the plan's rows ahead (`decoder/plan_ahead.py`).
* **Pipelined steps** (`pipelined`, the default on CUDA): a step's inputs for the next one (each
  request's next token and position) are written on the device, so `step()` issues the next
  one-token step of the same batch *before* it reads its own tokens; the device then runs it while
  the host reads the tokens, streams them and schedules, and the next call finds it issued (no
  device idle between tokens). The step's outputs are first copied out of the graph's static
  buffers (tokens to pinned host memory, logits on the device: `decoder.requests.Issued`). Not
  issued ahead: when requests join (their question chunk comes first) or when a request would pass
  its max_new_tokens. A request that stops on EOS was part of the step issued after it, which is
  discarded for it (its buffers are released only after that step has run: `remove` waits for it,
  as does dropping a graph it replays). Tokens and logits equal the plain runner's (tests).
* **Sampling** on the device (`decoder/sampling.py`): greedy at temperature 0, else Gumbel-max
  with counter-based noise of (seed, position), reproducible whatever the batch or graph replay.
* **CUDA graph** (`graphs=True` on CUDA): the one-token step of the current batch (embedding to
  sampling, incl. each request's plan/run/update and the in-place advance of its position and
  next token) is captured once and replayed while the batch stays the same. A planner's
  `graph_safe` attribute (default True) says its plan()/update() for T = 1 neither branch on host
  state that changes per step (csattn with a search period > 1 does: it reuses a plan for P - 1
  steps) nor allocate persistent state after the request's first one-token step. The rules:
  - capture only when every request of the batch is graph-safe and the previous step ran exactly
    this batch eagerly (so lazily allocated planner state and the grow-only kernel workspaces of
    each request's stream exist outside the graph's memory pool) and no prompt chunk ran in this
    step (`offload` captures too: its context is mapped host memory the kernels read in place);
  - replay only the graph of exactly this batch, and only if no eager forward ran since its
    capture (an eager call may grow and so free a kernel workspace the graph points to);
  - otherwise run eagerly (same code) and drop the graph; a failed capture falls back to eager
    for that batch and says why in `graph_status`.
  update() is captured with the rest rather than run eagerly after each replay: plan() hands its
  pending update (CTkvr's FIFO push, LFPS's table update) to update() through the planner's Python
  state, which a replay does not recreate, so an eager update() would find nothing pending; the
  captured one replays its device work exactly. Host-side bookkeeping inside plan()/update() (step
  counters some planners keep for `stats()`) runs at capture time only, so such counters undercount
  replayed steps. Why not `torch.compile(mode="reduce-overhead")`: docs/architecture.md.

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

import torch
import torch.nn.functional as F

from decoder.backends import AttentionBackend, frame_fraction
from decoder.layers import apply_rope, mlp, rms_norm, rope_cos_sin
from decoder.plan_ahead import Ahead, plan_next
from decoder.requests import CapturedStep, Issued, Request
from decoder.sampling import sample_tokens
from decoder.streams import fork_join
from decoder.weights import ModelWeights, fuse_weights
from indexer.base import KVView, MethodParams, Planner, graph_capturing


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


def graph_safe(planner: Planner) -> bool:
    """Whether a planner's one-token plan()/update() may be captured and replayed (see the module
    docstring). Planners say so with a `graph_safe` attribute; one without it counts as safe unless
    it has a search `period` > 1 (csattn's schedules, which reuse a plan by a host-side count)."""
    safe = getattr(planner, "graph_safe", None)
    if safe is None:
        safe = getattr(planner, "period", 1) == 1
    return bool(safe)


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
    `plan_ahead`: plan layer L >= 1 of one-token steps from the residual entering layer L - 1, on a
    side stream on CUDA (module docstring); off by default: it changes the plans (not the attention's
    arithmetic). `add(plan_ahead=)` sets it per request (the service: `resolve_plan_ahead`, widened).
    `pipelined`: issue the next one-token step before reading this one's tokens (module docstring);
    None = on CUDA. The tokens are the same; on a CPU it would only delay each token by a step.
    `cache_rows`: under a backend keeping the context's values in host memory, keep in HBM the value
    rows each layer's last plans read, and read those from there (module docstring); None = on
    CUDA, True = also on a CPU (tests). `stage_values`: with plan_ahead and cache_rows, fill the row
    cache with each plan's rows during the layer before (decoder/plan_ahead.py); None = on CUDA.
    """

    def __init__(self, lm, backend: AttentionBackend, device: str | torch.device | None = None, *,
                 graphs: bool = True, track_fraction: bool = False, parallel: bool = True,
                 fused_layer: bool | None = None, plan_ahead: bool = False, pipelined: bool | None = None,
                 stage_values: bool | None = None, cache_rows: bool | None = None):
        model = lm.model
        self.w = fuse_weights(model)
        self.device = torch.device(device) if device is not None else self.w.embed.device
        self.dtype = self.w.embed.dtype
        self.backend = backend
        self.eos = frozenset(getattr(lm, "eos_token_ids", ()) or ())
        self.graphs = graphs and self.device.type == "cuda"
        self.track_fraction = track_fraction
        self.sync_check = False  #: debug: eager forwards, replays under sync debug mode "error"; set after first steps
        self.requests: dict[int, Request] = {}
        self.graph_status = ""  # how the last decode batch ran: "captured" | "replayed" | "eager: <why>"
        self.captures = 0
        self._next_slot = 0
        self._graph: CapturedStep | None = None
        self._failed: dict[tuple, str] = {}  # batch key -> why its capture failed
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.parallel = parallel and self.device.type == "cuda"
        self._side: list[torch.cuda.Stream] = []  # one per batch position (parallel attention)
        self.plan_ahead = plan_ahead
        cuda = self.device.type == "cuda"
        self.ahead_streams = [torch.cuda.Stream(self.device) for _ in range(2)] if cuda else None  # by layer parity
        self.ahead_side: list[list[torch.cuda.Stream]] = [[], []]  # per batch position, by layer parity
        self._eager_key: tuple | None = None  # the batch of the last eager one-token step
        self.pipelined = cuda if pipelined is None else pipelined
        self.cache_rows = "kv/v" in backend.host_arrays and (cache_rows or cache_rows is None and cuda)
        self.stage_values = self.cache_rows and (stage_values or stage_values is None and cuda)  # if planned ahead
        self._issued: Issued | None = None  # the next call's step, issued by the last call (pipelined)
        self.layer_kernels = _layer_kernels(self.w, self.device, fused_layer)  # None: the torch functions

    # -- requests ------------------------------------------------------------------------------

    def add(self, ctx, planner: Planner, params: MethodParams, question_ids: list[int], max_new_tokens: int,
            temperature: float = 0.0, seed: int | None = None, plan_ahead: bool | None = None) -> int:
        """A new request over `ctx` (a `decoder.generate.ContextKV`); its first `step()` runs the
        question and returns its first token. The planner belongs to the request from now on
        (closed by `remove`). `plan_ahead`: plan its one-token steps ahead (None: the runner's)."""
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
            max_new=max_new_tokens, hot=temperature > 0, safe=graph_safe(planner), ahead=planner.reads_query and (
                self.plan_ahead if plan_ahead is None else plan_ahead),
            touched=torch.zeros(len(w.layers), dtype=torch.float64, device=dev))
        if self.layer_kernels is not None:  # the fused RoPE launch writes each step's K/V slots (`_forward`)
            r.slot_base = torch.tensor([[t.data_ptr() + i * t.stride(0) * t.element_size() for i in range(shape[0])]
                                        for t in (r.loc_k, r.loc_v)], dtype=torch.int64, device=dev)
            r.head_stride = torch.full((1,), max_local * w.head_dim, dtype=torch.long, device=dev)
        self.requests[slot] = r
        return slot

    def remove(self, slot: int) -> None:
        """End a request (finished or not): its planner is closed and its buffers released."""
        r = self.requests.pop(slot, None)
        if r is None:
            return
        if self._issued is not None and r in self._issued.reqs:  # still running on the device
            self._issued.settle()
        if self._graph is not None and slot in self._graph.key:  # the captured batch's slots
            self._drop_graph()
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
            return self._step(todo)
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            got = self._step(todo)
        cur.wait_stream(self._stream)
        return got

    def _step(self, todo: list[Request]) -> list[tuple[int, int]]:
        new = [r for r in todo if not r.started]
        batch = [r for r in todo if r.started]
        parts: list[tuple[list[Request], torch.Tensor, torch.Tensor]] = []  # (requests, tokens [B], logits [B, V])
        for r in new:  # the question as one chunk, eagerly, one request at a time
            self._drop_graph()
            with self._no_sync():
                tok, logits = self._forward([r], r.question.shape[0])
            r.started = True
            self._counted([r], r.question.shape[0])
            parts.append(([r], tok, logits))
        issued = self._issued  # this call's step of `batch`, issued by the last call (it may also hold
        # requests that finished since; every started request that is still active is in it)
        assert issued is None or set(batch) <= set(issued.reqs)
        ahead = self.pipelined and batch and not new and all(r.produced + 2 <= r.max_new for r in batch)
        if batch and issued is None:
            tok, logits = self._decode(batch, prompted=bool(new))
            status = self.graph_status
            issued = Issued.of(batch, tok, logits, status) if ahead else Issued(batch, tok, logits, None, status)
        nxt = None
        if ahead:
            # the next call's step, issued before this one's tokens are read: the device runs it while
            # the host reads, streams and schedules (its inputs are on the device already); a request
            # that this step finishes (EOS) wastes it
            tok, logits = self._decode(batch, prompted=False)
            nxt = Issued.of(batch, tok, logits, self.graph_status)
        self._issued = nxt  # (set only now: dropping a graph above waits for the step issued before)
        if issued is not None:
            issued.settle()  # its tokens are read below (and its requests may all have finished)
            if batch:
                parts.append((issued.reqs, issued.tokens, issued.logits))
                self.graph_status = issued.status
        got = []
        for reqs, toks, logits in parts:
            for i, (r, t) in enumerate(zip(reqs, toks.tolist())):  # the host sync: the tokens, to stream them
                if not r.active or self.requests.get(r.slot) is not r:  # finished or removed since it was issued
                    continue
                r.logits = logits[i]
                r.produced += 1
                r.tokens.append(t)
                if t in self.eos:
                    r.finish_reason = "stop"
                elif r.produced >= r.max_new:
                    r.finish_reason = "length"
                got.append((r.slot, t))
        return got

    def _counted(self, reqs: list[Request], t: int) -> None:
        """`track_fraction`: the (kv head, query token) pairs an eager forward of T = t just summed."""
        for r in reqs if self.track_fraction else ():
            r.counted += self.w.n_kv_heads * t

    def _drop_graph(self) -> None:
        """Release the captured step, once a replay of it issued ahead has run."""
        if self._graph is not None and self._issued is not None:
            self._issued.settle()
        self._graph = None

    def _decode(self, batch: list[Request], prompted: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-token step of `batch`: replayed, captured, or eager."""
        key = tuple(r.slot for r in batch)
        why = None
        if not self.graphs:
            why = "graphs off"
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
        self._drop_graph()
        with self._no_sync():
            tok, logits = self._forward(batch, 1)
        self._counted(batch, 1)
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
        self._drop_graph()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=self._stream, capture_error_mode="thread_local"):
                tok, logits = self._forward(batch, 1)
        except Exception as e:  # noqa: BLE001 - a planner that cannot be captured runs eagerly
            self._failed[key] = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
            return None
        g.replay()  # capture records without running: this runs the step
        self._graph = CapturedStep(key, g, tok, logits)
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
        rows = None if fk is None else fk.SlotRows(  # where the RoPE launch stores each row's k and v
            torch.stack([r.slot_base for r in reqs]) if t == 1 else reqs[0].slot_base.expand(t, -1, -1).contiguous(),
            torch.cat(slots) * d, torch.cat([r.head_stride.expand(t) for r in reqs]))
        branch = None  # fused path: the MLP output not yet added to x (added by the next RMSNorm)
        ahead = [i for i, r in enumerate(reqs) if r.ahead] if t == 1 else []
        planned: Ahead | None = None  # this layer's plans, made ahead during the layer before
        for layer, lw in enumerate(w.layers):
            if fk is None:
                hn = rms_norm(x, lw.ln1, w.eps)
            else:
                hn, x = (fk.rms_norm(x, lw.ln1, w.eps), x) if branch is None else fk.rms_norm(branch, lw.ln1, w.eps, x)
            # x is the residual entering this layer: the next layer's plan starts from it now, and
            # may overlap the end of this layer's plan (per-layer planner state, per-stream workspaces)
            nxt = plan_next(self, reqs, ahead, layer + 1, x, cos, sin, q_pos, slots) \
                if ahead and layer + 1 < len(w.layers) else None
            qkv = F.linear(hn, lw.wqkv, lw.bqkv)  # [S, (H + 2 KVH) D]
            # this layer's plans, made ahead: joined before this layer's K/V are written into the
            # step's slots, where the planner saw the predicted key
            plans = planned.join() if planned is not None else {}
            staged = planned.staged if planned is not None else set()
            if fk is None:
                q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)  # v: the view below, both paths
                q = apply_rope(q.view(-1, h, d), cos, sin)  # [S, H, D]
                k = apply_rope(k.view(-1, kvh, d), cos, sin)  # [S, KVH, D]
            else:
                q, k = fk.rope_qk(qkv, cos, sin, h, kvh, d, rows, layer)  # + the K/V slot writes
            v = qkv[:, (h + kvh) * d:].view(-1, kvh, d)
            outs = fork_join(self._streams(b), [
                lambda i=i, r=r: self._attend(r, layer, lw.scale, q[i * t:(i + 1) * t], k[i * t:(i + 1) * t],
                                              v[i * t:(i + 1) * t], q_pos[i], slots[i], plans.get(i), rows is None,
                                              i in staged, b == 1)
                for i, r in enumerate(reqs)])
            planned = nxt
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

    def _attend(self, r: Request, layer: int, scale: float, q, k, v, q_pos, slots, plan=None,
                write: bool = True, staged: bool = False, solo: bool = True) -> torch.Tensor:
        """One request's attention of one layer. q [T, H, D], k/v [T, KVH, D] post-RoPE, q_pos [T]
        absolute positions, slots [T] local slots -> [T, H D]. `plan`: made ahead (else planned here).
        `write`: store k/v into the slots here (False: the fused RoPE launch did). `staged`: the plan's
        value rows were staged into the layer's row cache (decoder/plan_ahead.py). `solo`: alone in its
        step, so its planner may attend the plan (`KVView.attend_scale`: pays at B = 1 only, RESULTS.md)."""
        w = self.w
        t = q.shape[0]
        kvh, g, d = w.n_kv_heads, w.group, w.head_dim
        new_k, new_v = k.transpose(0, 1), v.transpose(0, 1)  # [KVH, T, D]
        loc_k, loc_v = r.loc_k[layer], r.loc_v[layer]  # [KVH, max_local, D]
        if write:
            loc_k.index_copy_(1, slots, new_k)
            loc_v.index_copy_(1, slots, new_v)
        ctx_k, ctx_v = r.ctx_kv[layer]
        qh = q.transpose(0, 1).reshape(kvh, g, t, d)  # q head i*G + j belongs to kv head i
        kv = KVView(ctx_k, ctx_v, loc_k, loc_v, q_pos, attend_scale=scale if solo and self.backend.takes_attended
                    else None)
        if plan is None:
            plan = r.planner.plan(layer, qh, kv)
        if self.cache_rows and t == 1 and not plan.is_dense:  # RowCache per request and layer
            kv.v_cache, kv.v_staged = r.row_cache(layer, plan.width, ctx_v), staged
        out = self.backend.run(qh, kv, plan, r.sink, r.window, scale)  # [KVH, G, T, D]
        r.planner.update(layer, new_k, new_v, q_pos)
        if self.track_fraction and not graph_capturing(qh):
            r.touched[layer] += frame_fraction(plan, kv, r.sink, r.window).sum().to(r.touched.device)
        return out.reshape(w.n_heads, t, d).transpose(0, 1).reshape(t, w.n_heads * d)

