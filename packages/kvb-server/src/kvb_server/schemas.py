"""Request bodies of the OpenAI endpoints, as strict pydantic models.

Types are strict (``"max_tokens": "10"`` is a 400, as on OpenAI) and unknown fields are refused, so a
misspelt parameter is never silently ignored. Parameters OpenAI defines but this server does not implement
are declared so that :func:`kvb_server.requests.reject_unsupported` can refuse them by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(strict=True, extra="forbid")

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
MaxTokens = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[str], Field(max_length=4)]


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    include_obfuscation: bool | None = None


class SamplingFields(BaseModel):
    """Parameters both generation endpoints share."""

    model_config = _STRICT

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: int | None = None
    user: str | None = None
    # Declared only to be refused by name (see kvb_server.requests.reject_unsupported).
    logit_bias: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: MaxTokens | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    # Declared only to be refused by name.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None


class WarmRequest(BaseModel):
    """``POST /v1/warm``: texts whose KV to precompute (e.g. a shared system prompt or document)."""

    model_config = _STRICT

    text: str | None = None
    texts: Annotated[list[str], Field(min_length=1)] | None = None
