"""Cost limits: what a request would cost, estimated from its shapes before any work starts.

Every limit answers 422 with a stable code and changes nothing (no context registered, no job
queued): `invalid_parameter` for a method parameter above what the context has
(`MethodParams.context_limits`), `over_budget` for a request whose estimated time or peak memory
exceeds the settings' `budget_seconds` / `budget_bytes` (training: `train_budget_seconds`), and
`context_too_long` for a text longer in bytes than the longest context could be, before it is
tokenized.

The estimates are upper bounds from shapes, in nominal seconds of a 2-core CPU (the rates below were
measured there with `decoder.backends.torch_ref`); they bound what parameters can blow up (a frame
or plan wider than the context, a question step over thousands of rows, a clustering of thousands of
centroids), not the model's own per-token cost, which the context limit and `max_new_tokens` bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from indexer.base import MethodParams, SparseMethod
from service.errors import ApiError

# torch_ref gathers the frame + plan rows of every query token ([KVH, T, R, D] K and V): 1.1-5.7 GB/s
# of rows on the 2-core CPU depending on the shape; the psa `window` 65536 request of issue 14
# (62 question tokens, ~190 GB gathered over 30 layers) took 83 s, i.e. ~2.3 GB/s
GATHER_BYTES_PER_S = 2e9
FLOPS_PER_S = 2e10  # float32 matmul throughput of the same CPU (k-means assignment, centroid lists)
# one sequential host pass of a k-means++ seeding, per layer: csattn's 4096 centroids x 30 layers
# on ~60 tokens built in 150 s (issue 14), i.e. ~1.2 ms per pass
SEED_PASS_S = 1.2e-3
F32 = 4


@dataclass(frozen=True)
class Cost:
    """An estimate: nominal CPU seconds and peak bytes, and what was estimated (for the message)."""

    seconds: float
    peak_bytes: int
    what: str


def decode_cost(spec, method: SparseMethod, params: MethodParams, n_ctx: int, q_tokens: int, max_tokens: int) -> Cost:
    """A completion: the question step (q_tokens queries at once) then max_tokens one-token steps.

    Sparse plans gather R = sink + window + K context rows per query token and KV head (K and V,
    float32) and hold four score-sized float32 tensors [KVH, G, T, R] (scores, mask, softmax,
    concatenation); dense plans read the context in place and hold scores over every visible token."""
    kvh, g, d, layers = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim, spec.num_layers
    sink, window = params.frame(n_ctx)
    width = method.plan_width(params, n_ctx)
    rows = min(sink, n_ctx) + window + (width or 0)  # gathered per query token
    dense_cols = n_ctx if width is None else 0  # read in place, once per step
    local = q_tokens + max_tokens  # the request's own rows, attended by every method
    step_bytes = kvh * q_tokens * (rows * (2 * d + 4 * g) + (dense_cols + local) * 4 * g) * F32
    gathered = layers * kvh * rows * 2 * d * F32 * (q_tokens + max_tokens)
    in_place = layers * kvh * (dense_cols + local) * 2 * d * F32 * (1 + max_tokens)
    return Cost((gathered + in_place) / GATHER_BYTES_PER_S, step_bytes,
                f"{method.name} over {n_ctx} context tokens with {q_tokens} question tokens and max_tokens {max_tokens} "
                f"({rows} gathered rows per token)")


def _param(params: MethodParams, names: tuple[str, ...], n_ctx: int) -> int | None:
    """The first of `names` the params have, resolved for the context (`<name>_for(n)` where defined)."""
    for name in names:
        resolve = getattr(params, f"{name}_for", None)
        if callable(resolve):
            return resolve(n_ctx)
        value = getattr(params, name, None)
        if isinstance(value, int):
            return value
    return None


def build_cost(spec, method: SparseMethod, params: MethodParams, n_ctx: int) -> Cost:
    """An index build: the prefill capture it reads (every layer's Q/K/V, float32) plus, for a
    clustering build (a `n_centroids` / `n_clusters` parameter), the clustering of every layer and
    KV head: `iterations` + 1 passes of all G·n queries against C centroids (in `m` subspaces where
    the method has them), and C sequential seeding passes per layer."""
    kvh, h, d, layers = spec.num_kv_heads, spec.num_heads, spec.head_dim, spec.num_layers
    capture = layers * (h + 2 * kvh) * n_ctx * d * F32
    what = f"{method.name} index over {n_ctx} tokens"
    c = _param(params, ("n_centroids", "n_clusters"), n_ctx) if method.has_index else None
    if not c:
        return Cost(0.0, capture, what)
    iters = _param(params, ("iterations", "kmeans_iters"), n_ctx) or 0
    points = (h // kvh) * n_ctx  # queries of a KV head's group (keys: n of them, fewer)
    subspaces = _param(params, ("m",), n_ctx) or 1
    flops = layers * kvh * c * (iters + 1) * points * 2 * d
    seconds = flops / FLOPS_PER_S + layers * c * SEED_PASS_S
    return Cost(seconds, capture + kvh * subspaces * points * c * F32, f"{what} with {c} centroids")


def train_cost(spec, settings) -> Cost:
    """A SAAP training job (`training.settings.TrainSettings`) on a CPU: the capture of its
    windows, a k-means per layer and KV head, and `steps` Adam steps per layer whose cost grows
    with batch x (hidden x (D + C) + doc_tokens x D) (the per-step targets read the window's keys).
    Calibrated on the measured pieces of benchmarks/RESULTS_saap.md ("Training"): one full-size
    step 1.19 s, capture ~5.6 ms per token, one full-size k-means 5.4 s; the small preset's
    estimate (~300 s) is above its measured 91 s, the full preset's (~385 h) is the measured one."""
    layers = len(settings.layers) if settings.layers else spec.num_layers - 1
    d, kvh = spec.head_dim, spec.num_kv_heads
    doc_tokens = min(settings.doc_tokens, spec.max_positions)
    tokens = settings.n_docs * doc_tokens
    step = settings.batch * (settings.hidden * (d + settings.clusters) + doc_tokens * d) * 7.3e-10
    kmeans = layers * kvh * tokens * settings.clusters * settings.kmeans_iters * 2 * d / FLOPS_PER_S
    seconds = tokens * 5.6e-3 + kmeans + layers * settings.steps * step
    return Cost(seconds, 0, f"training {layers} layers, {settings.steps} steps each, on {tokens} tokens")


def check(cost: Cost, max_seconds: float, max_bytes: int | None = None) -> None:
    """422 `over_budget` when the estimate exceeds the budget; `details` carries both."""
    over = []
    if cost.seconds > max_seconds:
        over.append(f"~{cost.seconds:.0f} s of compute > budget {max_seconds:.0f} s")
    if max_bytes is not None and cost.peak_bytes > max_bytes:
        over.append(f"~{cost.peak_bytes / 2**20:.0f} MiB peak memory > budget {max_bytes / 2**20:.0f} MiB")
    if over:
        raise ApiError(422, "over_budget", f"{cost.what}: estimated " + " and ".join(over) +
                       "; use smaller parameters (or ask the operator to raise the budget)",
                       {"estimated_seconds": round(cost.seconds, 1), "estimated_bytes": cost.peak_bytes,
                        "budget_seconds": max_seconds, "budget_bytes": max_bytes})


_TOKEN_BYTES: dict[str, int] = {}


def max_token_bytes(tokenizer, fingerprint: str) -> int:
    """Bytes of the longest token's text (once per tokenizer): a text of B bytes is at least
    B / this many tokens (byte-level BPE: the tokens' texts concatenate to the text)."""
    if fingerprint not in _TOKEN_BYTES:
        to_text = tokenizer.convert_tokens_to_string
        _TOKEN_BYTES[fingerprint] = max(len(to_text([t]).encode("utf-8", "replace")) for t in tokenizer.get_vocab())
    return _TOKEN_BYTES[fingerprint]


def max_text_bytes(lm, max_tokens: int) -> int:
    """The longest text (UTF-8 bytes) that could fit in max_tokens tokens: longer texts are refused
    before tokenizing, which takes seconds for megabytes."""
    return max_tokens * max_token_bytes(lm.tokenizer, lm.spec.tokenizer_fingerprint)


def context_bounds(params: MethodParams, given: dict, n_ctx: int, where: str) -> None:
    """422 `invalid_parameter` for each parameter the request gave above what the context allows."""
    limits = params.context_limits(n_ctx)
    values = {name: getattr(params, name) for name in given if name in limits}  # validated: 65536.0 is 65536
    bad = [{"loc": [where, name], "msg": f"must be <= {limits[name]} (the context's tokens)", "type": "context_bound",
            "input": value, "limit": limits[name]}
           for name, value in sorted(values.items()) if value is not None and value > limits[name]]
    if bad:
        names = ", ".join(f"{b['loc'][-1]}={b['input']}" for b in bad)
        raise ApiError(422, "invalid_parameter",
                       f"{names}: above the context's {n_ctx} tokens (a frame, budget or centroid count larger "
                       f"than the context only adds cost)", bad)
