"""Request and response models of the REST API (OpenAPI schema + examples come from here)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

Status = Literal["queued", "prefilling", "indexing", "ready", "failed"]
SEED_MAX = 2**63 - 1  # seeds travel as int64 (the runner's per-request seed tensor, torch generators)


def _encodable(s: str) -> str:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which Python keeps in a str but no tokenizer
    or store can encode: reject it as invalid input (422) instead of failing later (500)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate at character {e.start}: text must be valid Unicode") from None
    return s


Text = Annotated[str, AfterValidator(_encodable)]


class ContextCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "text": "The pass key is 71432. Remember it. ...",
                    "methods": ["topk", "streaming"],
                    "params": {"topk": {"ratio": 0.05}},
                    "ttl_seconds": 86400,
                    "display_name": "passkey demo",
                }
            ],
            # exactly one source (`_one_source`), stated in the schema so that generated clients and
            # schema fuzzers know it
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}, "token_ids": {"type": "null"}}},
                {"required": ["token_ids"], "properties": {"token_ids": {"type": "array"}, "text": {"type": "null"}}},
            ],
        },
    )

    text: Text | None = Field(None, description="the context; wrapped as the start of a user turn (format=chat); "
                                                "not only whitespace (422 empty_text)",
                              json_schema_extra={"pattern": r"\S"})
    token_ids: list[int] | None = Field(None, description="alternative to text: token ids used as they are, each in "
                                                          "the tokenizer's vocabulary",
                                        json_schema_extra={"minItems": 1, "items": {"type": "integer", "minimum": 0}})
    model: str | None = Field(None, description="must name the served model (default: it)")
    format: Literal["chat", "raw"] = Field(
        "chat", description="chat: the model's chat template around context + question; raw: plain concatenation"
    )
    methods: list[str] = Field(default_factory=list, description="sparse methods to build indexes for (see GET /v1/methods)")
    params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-method parameters, e.g. {'topk': {'ratio': 0.05}}"
    )
    ttl_seconds: int | None = Field(None, gt=0, description="remove the context this long after registration")
    display_name: Text | None = Field(None, max_length=200)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of `text` or `token_ids`")
        return self


class ContextPatch(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"ttl_seconds": 3600, "display_name": "v2"}]})

    ttl_seconds: int | None = Field(None, ge=0, description="new ttl from now; 0 = never expire")
    display_name: Text | None = Field(None, max_length=200)


class MethodInfo(BaseModel):
    params: dict[str, Any] = Field(default_factory=dict, description="build parameters of the persisted index")
    index_id: str | None = None


class ContextPublic(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "9f2c...e1",
                    "status": "ready",
                    "progress": 1.0,
                    "model": "smollm2-135m",
                    "n_tokens": 1536,
                    "methods": {"csattn": {"params": {"m": 8, "C": 64}, "index_id": "csattn-1a2b3c4d5e6f7a8b"}},
                    "bytes": 70778880,
                    "timings": {"prefill_s": 3.9, "write_s": 0.4},
                    "expires_at": None,
                }
            ]
        }
    )

    id: str
    status: Status
    progress: float = Field(description="0..1")
    model: str
    n_tokens: int | None = None
    format: str = "chat"
    kv_dtype: str = Field("float32", description="dtype the context's K/V are stored and held in (part of its id)")
    methods: dict[str, MethodInfo] = Field(default_factory=dict, description="methods with a persisted index")
    index_free_methods: list[str] = Field(default_factory=list, description="methods usable without an index")
    bytes: int | None = None
    timings: dict[str, Any] = Field(default_factory=dict)
    display_name: str | None = None
    created_at: float
    updated_at: float | None = None
    expires_at: float | None = None
    error: dict[str, str] | None = Field(None, description="code + message when status is failed")


class ContextCreated(ContextPublic):
    created: bool = Field(description="true if this call queued a build; false if the content was already known")


class ContextList(BaseModel):
    data: list[ContextPublic]
    total: int
    offset: int
    limit: int
    next_offset: int | None


class CompletionRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"question": "What is the pass key?", "max_tokens": 32, "method": "topk",
                                         "params": {"k": 128}}]},
    )

    question: Text = Field(min_length=1, description="appended after the context")
    max_tokens: int = Field(64, ge=1, description="tokens to generate at most")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="sampling seed (temperature > 0), below 2^63")
    method: str = Field("full", description="sparse method; see GET /v1/methods")
    params: dict[str, Any] = Field(default_factory=dict, description="method parameters for this request")
    backend: Literal["torch_ref", "triton", "offload", "offload_v"] | None = Field(
        None, description="attention backend for this request (default: the service's `attention_backend`): torch_ref "
                          "(plain torch, the reference), triton (fused GPU kernels), offload (context K/V in pinned "
                          "host memory, the GPU's kernels read the attended rows in place), offload_v (only "
                          "the values in host memory)")
    stream: bool = Field(False, description="server-sent events: `token` events then one `done` event")


class Usage(BaseModel):
    cached_tokens: int = Field(description="context tokens served from the stored KV")
    prompt_tokens: int = Field(description="new tokens of the question (after the template)")
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    context_id: str
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    stats: dict[str, Any] = Field(description="method, backend, ttft_ms, cache (cold/warm), load_ms, tiers (hits/misses "
                                              "per tier), decode_tokens_per_s, kv_fraction, plan_ms/run_ms (host time), "
                                              "method_stats (method-specific, e.g. saap's selectivity per step), ...")


class MethodDescription(BaseModel):
    name: str
    has_index: bool
    params_schema: dict[str, Any]
    build_fields: list[str]


class TrainRequest(BaseModel):
    """An offline training job for a method that needs a per-model trained component (SAAP's key
    k-means + query classifier). Unset fields take the preset's value."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"preset": "small"}, {"preset": "small", "layers": [1, 2, 3, 4], "steps": 100, "seed": 1}]},
    )

    preset: Literal["small", "full"] = Field(
        description="small: a few minutes on 2 CPU cores (C=32); full: the paper's sizes (C=1024), meant for a GPU"
    )
    clusters: int | None = Field(None, description="C, k-means buckets per layer and KV head")
    steps: int | None = Field(None, description="Adam steps per layer")
    hidden: int | None = Field(None, description="classifier hidden width")
    docs: int | None = Field(None, description="training windows (at most)")
    doc_tokens: int | None = Field(None, description="tokens per training window")
    layers: list[int] | None = Field(None, max_length=4096, description="layers to train (>= 1); others run full attention")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    corpus: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="a directory of .txt files under <data_dir>/corpora/; unset = the built-in seeded corpus",
    )
    replace: bool = Field(
        False, description="retrain although a trained model for this LLM exists (contexts indexed with the old one must be re-registered)"
    )


class TrainJob(BaseModel):
    id: str = Field(description="sha256 of what the job trains: the same request is the same job")
    method: str
    model: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    progress: float = Field(description="0..1")
    phase: str = Field(description="queued, starting, capture, layer N, done, failed, cancelled")
    cancel_requested: bool = Field(False, description="DELETE asked a running job to stop; it ends `cancelled`")
    layers_done: int = 0
    layers_total: int = 0
    settings: dict[str, Any] = Field(default_factory=dict, description="resolved training settings")
    corpus: str | None = None
    model_dir: str | None = Field(None, description="where the trained model was written (status done)")
    digest: str | None = Field(None, description="the trained model's identity (status done)")
    train_s: float | None = None
    attempts: int = 0
    created_at: float
    updated_at: float | None = None
    error: dict[str, str] | None = Field(None, description="code + message when status is failed")


class TrainJobCreated(TrainJob):
    created: bool = Field(description="true if this call queued the job; false if it was already queued, running or done")


class ErrorDetail(BaseModel):
    code: str = Field(description="stable error code (docs/api.md, 'Errors')")
    message: str = Field(description="what went wrong, for people; server paths relative to the data dir")
    details: Any = Field(None, description="structured extras where there are any (failing fields, limits, ...)")


class ErrorResponse(BaseModel):
    """The body of every error: `{"error": {"code", "message", "details"?}}`."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"error": {"code": "over_budget", "message": "psa over 552 context tokens ...: estimated ~143 s of compute "
                                                     "> budget 120 s", "details": {"estimated_seconds": 143.3}}}]})

    error: ErrorDetail


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    checks: dict[str, dict[str, Any]] = Field(description="per dependency: ok plus what was checked (redis, storage, model, workers)")
