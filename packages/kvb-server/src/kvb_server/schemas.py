"""Request and response bodies of the OpenAI endpoints, as pydantic models (the OpenAPI document's schemas).

Requests: types are strict (``"max_tokens": "10"`` is a 400, as on OpenAI) and unknown fields are refused, so a
misspelt parameter is never silently ignored. Parameters OpenAI defines but this server does not implement
are declared so that :mod:`kvb_server.request_plan` can refuse them by name. The routes read and validate
bodies themselves (through :mod:`kvb_server.limits` first), so these models document them in the OpenAPI
document (see :mod:`kvb_server.openapi`) rather than being FastAPI body parameters.

Responses: the routes build plain dicts (:mod:`kvb_server.responses`); the models below describe them,
and the tests validate real responses against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

_STRICT = ConfigDict(strict=True, extra="forbid")

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
#: vLLM's top-k: keep the k most likely tokens; -1 or 0 turn the filter off.
TopK = Annotated[int, Field(ge=-1)]
#: vLLM's (Hugging Face's) repetition penalty: divides the positive logits of every token seen; 1 is off.
RepetitionPenalty = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


def _whole_number(value: Any) -> Any:
    # JSON does not tell 10 from 10.0 (nor does JSON Schema's "integer"): a whole float is that integer.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Strict integers that also take a whole JSON number such as ``10.0`` (never ``"10"`` or ``true``). NOTE: the
# bounds come before the validator, so the JSON schema says "minimum" rather than pydantic's raw "ge".
_WHOLE = BeforeValidator(_whole_number)
Int = Annotated[int, _WHOLE]
MaxTokens = Annotated[int, Field(ge=1), _WHOLE]
TokenId = Annotated[int, Field(ge=0), _WHOLE]
NonEmpty = Annotated[str, Field(min_length=1)]
#: Stop strings one request may give. OpenAI takes 4, vLLM any number: lm-eval's local-completions sends a
#: task's every stop sequence plus the end-of-text token (often 5 or more). Bounded so that matching (each
#: string against the tail of the text, every token) stays cheap.
MAX_STOP_STRINGS = 64
Stop = NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)]
# torch seeds are 64-bit; choice i of n > 1 samples with seed + i, still inside torch's range.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63), _WHOLE]
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)]


def _only(accepted: dict[str, Any], what: str) -> WithJsonSchema:
    """The documented schema of a parameter declared only to be refused by name: just the values this
    server accepts (validation itself stays loose, so the refusal names the parameter)."""
    return WithJsonSchema({**accepted, "description": f"Not supported: {what}; anything else is a 400."})


_NULL: dict[str, Any] = {"type": "null"}
_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, _NULL]}
_NONE_CHOICE = {"anyOf": [{"enum": ["none", None]}, {"type": "array", "maxItems": 0}]}


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False
    #: vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens generated).
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class SamplingFields(BaseModel):
    """Parameters both generation endpoints share."""

    model_config = _STRICT

    # Left out (vLLM takes that; OpenAI does not): the first served model. Never null, as the schema says.
    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1), _WHOLE] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    user: str | None = None
    #: vLLM's field: requests with different salts never share cached prefixes (see kvb_server.tenancy).
    cache_salt: CacheSalt | None = None
    # vLLM's sampling extras (top_k, min_p, repetition_penalty, ignore_eos), which clients send through the SDK's extra_body (benchmark clients send
    # ignore_eos for fixed-length outputs).
    top_k: Annotated[TopK, _WHOLE] | None = None
    #: Drop tokens less likely than min_p x the most likely one (0: off).
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    #: Keep generating after end-of-sequence until max_tokens (or a stop string).
    ignore_eos: bool | None = None
    #: No end-of-sequence, stop token or stop string before this many tokens.
    min_tokens: Annotated[int, Field(ge=0), _WHOLE] | None = None
    #: Token ids that end a choice like end-of-sequence (even with ignore_eos); the id is its stop_reason.
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    #: Keep the stop string (or stop token) that ended a choice in its text.
    include_stop_str_in_output: bool | None = None
    #: False: special tokens' text stays in the output (default true: left out).
    skip_special_tokens: bool | None = None
    # vLLM's guided decoding (another way to ask for what response_format asks; at most one of them):
    # a JSON schema (object or JSON text), a regex, one of several strings, a Lark/GBNF grammar; or
    # structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (vLLM >= 0.10).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    #: OpenAI's ``logit_bias``: token id (as a string) -> bias in [-100, 100], added to that token's logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    #: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name",
    #: "schema", "strict"}}``; kvboost also takes ``{"type": "regex", "pattern"}`` and ``{"type": "grammar",
    #: "grammar": <Lark or GBNF>}`` (see docs/structured.md). Checked by kvb_server.request_plan.
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    #: 0 only with ``echo``: the prompt scored, nothing generated (lm-eval's loglikelihood requests).
    max_tokens: Annotated[int, Field(ge=0), _WHOLE] | None = None
    logprobs: Annotated[int, Field(ge=0, le=5), _WHOLE] | None = None
    #: Repeat the prompt before each choice's text; with ``logprobs`` the prompt tokens are scored too
    #: (the first has ``null``: nothing precedes it).
    echo: bool | None = None
    suffix: Annotated[str | None, _only({"enum": ["", None]}, "suffix (insertion)")] = None
    best_of: Annotated[
        Int | None,
        _only({"anyOf": [{"type": "integer", "minimum": 1}, _NULL]}, "best_of other than equal to n"),
    ] = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"required": ["type", "text"]})

    type: Annotated[str, _only({"const": "text"}, "non-text content parts")]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Annotated[
        Literal["system", "developer", "user", "assistant", "tool", "function"],
        _only({"enum": ["system", "developer", "user", "assistant", "tool"]}, "function messages"),
    ]
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: An assistant turn's calls: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``.
    tool_calls: list[dict[str, Any]] | None = None
    #: A ``tool`` message answers the call with this id.
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        # top_logprobs needs logprobs: true (a 400 otherwise), said where schema-driven clients look.
        json_schema_extra={
            "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        },
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20), _WHOLE] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    #: Function tools (``[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]``),
    #: checked by kvb_server.tool_calls.
    tools: list[Any] | None = None
    #: ``"none"`` / ``"auto"`` / ``"required"`` / ``{"type": "function", "function": {"name": ...}}``.
    tool_choice: str | dict[str, Any] | None = None
    #: False: at most one call per reply (default: up to kvb_server.tool_calls.MAX_PARALLEL_CALLS).
    parallel_tool_calls: bool | None = None
    # vLLM's template options: extra template variables (e.g. {"enable_thinking": false} for Qwen3), no
    # generation prompt, or continuing the last (assistant) message instead of starting a new one.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # Declared only to be refused by name.
    functions: Annotated[list[Any] | None, _only(_EMPTY_LIST, "function calling")] = None
    function_call: Annotated[Any, _only(_NONE_CHOICE, "function calling")] = None
    modalities: Annotated[
        list[str] | None,
        _only(
            {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}, _NULL]},
            "audio",
        ),
    ] = None
    audio: Annotated[dict[str, Any] | None, _only(_NULL, "audio")] = None
    prediction: Annotated[dict[str, Any] | None, _only(_NULL, "predicted outputs")] = None
    reasoning_effort: Annotated[str | None, _only(_NULL, "reasoning_effort")] = None
    web_search_options: Annotated[dict[str, Any] | None, _only(_NULL, "web search")] = None


class WarmRequest(BaseModel):
    """``POST /v1/warm``: texts whose KV to precompute (e.g. a shared system prompt or document)."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={"anyOf": [{"required": ["text"]}, {"required": ["texts"]}]},
    )

    # Either field may be left out, not null: the schema says so, so fuzzers generate what is accepted.
    text: Annotated[str, Field(min_length=1)] = None  # type: ignore[assignment]
    texts: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] = None  # type: ignore[assignment]
    #: Warm under this salt (combined with the API key's, as for generation requests).
    cache_salt: CacheSalt | None = None


class CacheResetRequest(BaseModel):
    """``POST /v1/cache/reset`` (and vLLM's ``POST /reset_prefix_cache``); the body is optional."""

    model_config = _STRICT

    lower_tiers: bool = Field(
        default=False, description="also drop the disk and Redis tiers' records, not only RAM"
    )


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``, never both."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
    )

    # Fields may be left out, not null: the schema says so, so fuzzers generate what is accepted.
    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    prompt: str = None  # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_special_tokens: bool = Field(
        default=True,
        description="with prompt: add the tokenizer's special tokens (BOS), as /v1/completions does; "
        "no effect with messages (the chat template places its own)",
    )
    add_generation_prompt: bool = Field(
        default=True,
        description="with messages: end with the assistant's turn opener, as /v1/chat/completions "
        "does; no effect with prompt",
    )
    continue_final_message: bool = Field(
        default=False,
        description="with messages: leave the last (assistant) message open instead of adding a generation "
        "prompt (as /v1/chat/completions does)",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default=None, description="with messages: extra chat template variables (as /v1/chat/completions)"
    )  # type: ignore[assignment]
    return_token_strs: bool = Field(default=False, description="also return each token's string")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model_config = _STRICT

    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    tokens: list[TokenId]


# -- responses ----------------------------------------------------------------------------------------
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


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
    choices: list[ChatChoice]
    usage: Usage
    prompt_truncation: PromptTruncation | None = None


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
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    """``POST /tokenize``: the ids the generation routes would queue for the same input."""

    count: int
    max_model_len: int | None = Field(description="prompt + generated tokens the model takes (null: unknown)")
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, description="with return_token_strs: each token")


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``."""

    prompt: str


class TokenizerInfoResponse(BaseModel):
    """``GET /tokenizer_info`` (vLLM's route): what a client needs to tokenize as the server does (lm-eval's
    remote tokenizer reads the special tokens and the chat template here, then calls ``/tokenize``)."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int | None = Field(description="the served context length (null: unknown)")
    vocab_size: int | None = Field(description="ids the tokenizer can decode, added tokens included")


class ErrorDetail(BaseModel):
    """OpenAI's error object; some errors add fields (the planner's numbers, ``max_body_bytes``)."""

    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx response (and an error event that ends a stream)."""

    error: ErrorDetail
