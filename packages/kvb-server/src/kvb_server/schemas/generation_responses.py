"""Response bodies and stream chunks of ``POST /v1/completions`` and ``POST /v1/chat/completions``.

The routes build plain dicts (:mod:`kvb_server.responses`); the models below describe them in the OpenAPI
document, and the tests validate real responses against them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "tool_calls"]
#: vLLM's ``stop_reason``: the stop string (or ``stop_token_ids`` id) that ended a choice; null when it ended
#: otherwise (end-of-sequence, max_tokens) or has not ended.
StopReason = Annotated[
    str | int | None, Field(description="the stop string or stop token id that ended this choice, else null")
]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the KV cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    #: With a ``prediction``: its drafted tokens the verification kept / rejected.
    completion_tokens_details: dict[str, int] | None = None


class PromptTruncation(BaseModel):
    """What ``--auto-truncate`` dropped (also in the ``X-KVBoost-Prompt-Tokens-Dropped`` header)."""

    kept: Literal["last_tokens"]
    original_prompt_tokens: list[int]
    prompt_tokens: list[int]
    dropped_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: null for the first prompt token, then per position the prompt's own token and
#: the requested alternatives, keyed by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    #: With the request's ``prompt_logprobs`` only (its prompt's).
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` without ``stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage
    prompt_truncation: PromptTruncation | None = None


class CompletionChunk(BaseModel):
    """One ``data:`` event of ``POST /v1/completions`` with ``stream: true`` (the stream ends ``[DONE]``).

    A choice's last chunk has ``finish_reason``; with ``stream_options.include_usage`` every chunk has
    ``usage: null`` and a final chunk with no choices carries the usage.
    """

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None
    refusal: list[ChatLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` without ``stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    #: ``"default"`` when the request named a ``service_tier`` (this server has one tier), else null.
    service_tier: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_truncation: PromptTruncation | None = None
    #: With the request's ``prompt_logprobs`` only (vLLM puts a chat prompt's here, not in the choices).
    prompt_logprobs: PromptLogprobs | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A call's first delta has ``id``, ``type`` and ``function.name``; later ones pieces of ``arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of ``POST /v1/chat/completions`` with ``stream: true`` (the stream ends ``[DONE]``).

    Each choice opens with a ``{"role": "assistant", "content": ""}`` delta, then text deltas; usage as in
    :class:`CompletionChunk`.
    """

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    #: ``"default"`` when the request named a ``service_tier`` (this server has one tier), else null.
    service_tier: str | None = None
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
