"""Request and response models of the OpenAI-compatible routes (`service/api/routes/openai.py`):
OpenAI's fields, the parameters this service accepts only at their neutral value, and our
extensions (`context_id`, `method`, `method_params`, `backend`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.openai_errors import OpenAIError
from service.schemas import SEED_MAX, Text

DEFAULT_MAX_TOKENS = 64  # the native route's default (OpenAI's "until the context is full" could hit over_budget)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


# Parameters OpenAI defines that this service does not implement: accepted only at their neutral
# value (what a client sends when it does not use them), a clear 400 otherwise, never ignored.
_NEUTRAL: dict[str, tuple] = {
    "top_p": (1, 1.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}


class CompletionFields(BaseModel):
    """What chat and text completions share: OpenAI's sampling fields and our extensions."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the served model (GET /v1/models), or `<model>@<context id>` to name the context")
    context_id: str | None = Field(None, description="extension: the registered context to answer over")
    method: str = Field("full", description="extension: sparse method (GET /v1/methods)")
    method_params: dict[str, Any] = Field(default_factory=dict, description="extension: the method's parameters")
    backend: Literal["torch_ref", "triton", "offload", "offload_v"] | None = Field(None, description="extension: attention backend")
    max_tokens: int | None = Field(None, ge=1, description=f"tokens to generate at most [{DEFAULT_MAX_TOKENS}]")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy [1, as OpenAI]")
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: Text | list[Text] | None = Field(None, description="up to 4 strings; the answer ends before the first")
    n: int | None = Field(None, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted, unused")
    metadata: dict[str, str] | None = Field(None, description="accepted, unused")
    store: bool | None = Field(None, description="accepted, unused (nothing is stored)")
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise OpenAIError(400, "unsupported_parameter", "only n=1 is supported", "n")
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value not in neutral:
                raise OpenAIError(400, "unsupported_parameter",
                                  f"{name}={value!r} is not supported by this service (accepted: {neutral[0]!r})", name)
        stops = self.stops
        if len(stops) > 4 or any(not s for s in stops):
            raise OpenAIError(400, "invalid_parameter", "stop: at most 4 non-empty strings", "stop")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class ChatCompletionCreate(CompletionFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="takes precedence over max_tokens")
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted, unused (no tools)")

    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


class CompletionCreate(CompletionFields):
    prompt: Text | list[Text] = Field(description="appended after the context as it is (one prompt)")
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise OpenAIError(400, "unsupported_parameter", "one prompt per request", "prompt")
            return self.prompt[0]
        return self.prompt


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, server_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="our stable error code (service/errors.py), e.g. not_found, unauthorized")


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


_STATUS = {400: "invalid request: schema, unsupported parameter (n, top_p, ...), missing_context, invalid_parameter, "
                "over_budget, too_long",
           401: "unauthorized: API keys are set and the request has no valid bearer key",
           404: "not_found (no such context), model_not_found",
           409: "context_not_ready, method_not_built, method_unavailable",
           500: "internal_error (details in the server log)",
           503: "no_decode_worker, decode_worker_lost, dependency_unavailable (Redis)",
           504: "decode_timeout"}


def documented_errors(*statuses: int) -> dict:
    return {s: {"model": OpenAIErrorResponse, "description": _STATUS[s]} for s in sorted({*statuses, 401, 500, 503})}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ctxcache"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

