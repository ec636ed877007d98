"""Request bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Types are strict and unknown fields are refused, so a misspelt parameter is never silently ignored.
Parameters OpenAI defines but this server does not implement are declared so that
:mod:`kvb_server.request_checks` can refuse them by name. The routes read and validate bodies themselves
(through :mod:`kvb_server.limits` first), so these models document them in the OpenAPI document (see
:mod:`kvb_server.openapi`) rather than being FastAPI body parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from kvb_server.schemas.fields import (
    MAX_STOP_STRINGS,
    NULL,
    STRICT,
    WHOLE,
    CacheSalt,
    Int,
    MaxTokens,
    Metadata,
    NonEmpty,
    Penalty,
    PromptCacheRetention,
    RepetitionPenalty,
    SafetyIdentifier,
    Seed,
    ServiceTier,
    Stop,
    Temperature,
    TokenId,
    TopK,
    TopP,
    Verbosity,
    only,
)

_EMPTY_LIST = {"anyOf": [{"type": "array", "maxItems": 0}, NULL]}
_NONE_CHOICE = {"anyOf": [{"enum": ["none", None]}, {"type": "array", "maxItems": 0}]}


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    #: vLLM's: with include_usage, every chunk carries the usage so far (its choice's tokens generated).
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class PredictionText(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted outputs: text the reply is expected to repeat (its tokens are drafted and verified:
    the reply does not change, it comes sooner where they match; kvb_cache.prediction)."""

    model_config = STRICT

    type: Literal["content"]
    content: str | list[PredictionText]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SamplingFields(BaseModel):
    """Parameters both generation endpoints share."""

    model_config = STRICT

    # Left out (vLLM takes that; OpenAI does not): the first served model. Never null, as the schema says.
    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1), WHOLE] | None = None
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
    top_k: Annotated[TopK, WHOLE] | None = None
    #: Drop tokens less likely than min_p x the most likely one (0: off).
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    #: Keep generating after end-of-sequence until max_tokens (or a stop string).
    ignore_eos: bool | None = None
    #: No end-of-sequence, stop token or stop string before this many tokens.
    min_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None
    #: Token ids that end a choice like end-of-sequence (even with ignore_eos); the id is its stop_reason.
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None = None
    #: Keep the stop string (or stop token) that ended a choice in its text.
    include_stop_str_in_output: bool | None = None
    #: False: special tokens' text stays in the output (default true: left out).
    skip_special_tokens: bool | None = None
    #: vLLM's decoding switch; only its default (true) is taken: special tokens are decoded by the
    #: tokenizer's own rule (false is a 400 naming it; clients that send every field with its default sent
    #: true and got the 400 too).
    spaces_between_special_tokens: Annotated[
        bool | None, only({"enum": [True, None]}, "spaces_between_special_tokens false")
    ] = None
    # vLLM's guided decoding (another way to ask for what response_format asks; at most one of them):
    # a JSON schema (object or JSON text), a regex, one of several strings, a Lark/GBNF grammar; or
    # structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ...}
    # (vLLM >= 0.10).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    #: vLLM's: lower runs first under --scheduling-policy priority (0 on any server).
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63), WHOLE] | None = None
    #: vLLM's: keep only the last this-many prompt tokens (-1: the model's context length).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), WHOLE] | None = None
    #: vLLM's: only these token ids may be generated (a label set, a Yes/No judge).
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    #: vLLM's: each prompt token's logprob, its rank and this many most likely alternatives (the first token:
    #: null); -1: every token (within --max-logprobs); not with stream (vLLM's rule). kvb_server.request_checks.
    prompt_logprobs: Annotated[int, Field(ge=-1), WHOLE] | None = None
    #: vLLM's: each logprobs entry names its token as ``"token_id:<id>"`` instead of its text (a client that
    #: needs the exact ids, such as an RL trainer; its ``bytes`` are that label's).
    return_tokens_as_token_ids: bool | None = None
    #: vLLM's: words never generated (each as it starts the text and after a space; kvb_cache.token_bans).
    bad_words: Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = None
    #: OpenAI's ``logit_bias``: token id (as a string) -> bias in [-100, 100], added to that token's logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    #: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name",
    #: "schema", "strict"}}``; kvboost also takes ``{"type": "regex", "pattern"}`` and ``{"type": "grammar",
    #: "grammar": <Lark or GBNF>}`` and vLLM's ``{"type": "structural_tag", "structures", "triggers"}`` (see
    #: docs/structured.md). Checked by kvb_server.request_plan.
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
    max_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None
    #: vLLM's: a text prompt is encoded with the tokenizer's special tokens (its BOS), as the engine does;
    #: false encodes the text alone (a prompt that already holds them, e.g. a rendered chat template).
    add_special_tokens: bool = True
    #: At most the server's ``--max-logprobs`` (20 by default, as vLLM; OpenAI takes 5): kvb_server.request_checks.
    logprobs: Annotated[int, Field(ge=0), WHOLE] | None = None
    #: Repeat the prompt before each choice's text; with ``logprobs`` the prompt tokens are scored too
    #: (the first has ``null``: nothing precedes it).
    echo: bool | None = None
    suffix: Annotated[str | None, only({"enum": ["", None]}, "suffix (insertion)")] = None
    best_of: Annotated[
        Int | None,
        only({"anyOf": [{"type": "integer", "minimum": 1}, NULL]}, "best_of other than equal to n"),
    ] = None


class TextPart(BaseModel):
    """A content part: ``{"type": "text", "text"}``, or in an assistant message ``{"type": "refusal",
    "refusal"}`` (an OpenAI model's refusal, kept in the history as the assistant's text). Other types and
    the missing text are refused by :mod:`kvb_server.tool_calls.prompt`, naming the message."""

    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"required": ["type"]})

    type: Annotated[str, only({"enum": ["text", "refusal"]}, "non-text content parts")]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None
    refusal: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Annotated[
        Literal["system", "developer", "user", "assistant", "tool", "function"],
        only({"enum": ["system", "developer", "user", "assistant", "tool"]}, "function messages"),
    ]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    #: An assistant turn's refusal (OpenAI's models send it instead of content), rendered as its text.
    refusal: str | None = None
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
    #: At most the server's ``--max-logprobs`` (20 by default): kvb_server.request_checks.
    top_logprobs: Annotated[int, Field(ge=0), WHOLE] | None = None
    metadata: Metadata | None = None
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
    #: vLLM's (default false): the chat template places the model's special tokens; true (a BOS added on
    #: top of the template's) is refused by name.
    add_special_tokens: Annotated[
        bool | None, only({"anyOf": [{"const": False}, NULL]}, "add_special_tokens=true on chat")
    ] = None
    #: vLLM's: False leaves the thinking ``--reasoning-parser`` splits out of the reply (``reasoning``) out of
    #: the response; ``content`` is the answer either way.
    include_reasoning: bool = True
    # OpenAI's, accepted as on /v1/responses (the openai SDK sends them when the caller sets them). One
    # processing tier: any service_tier is served as, and answered with, "default".
    service_tier: ServiceTier | None = None
    # They change nothing: the prefix cache is content-addressed (any request with the same prefix hits it,
    # whatever its key; tenants are kept apart by API key and cache_salt), and there is no abuse detection.
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    safety_identifier: SafetyIdentifier | None = None
    #: Ignored: the served models have no verbosity control (the reply's length is max_tokens' to bound).
    verbosity: Verbosity | None = None
    # Declared only to be refused by name.
    functions: Annotated[list[Any] | None, only(_EMPTY_LIST, "function calling")] = None
    function_call: Annotated[Any, only(_NONE_CHOICE, "function calling")] = None
    modalities: Annotated[
        list[str] | None,
        only(
            {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}, NULL]},
            "audio",
        ),
    ] = None
    audio: Annotated[dict[str, Any] | None, only(NULL, "audio")] = None
    prediction: Prediction | None = None
    reasoning_effort: Annotated[str | None, only(NULL, "reasoning_effort")] = None
    web_search_options: Annotated[dict[str, Any] | None, only(NULL, "web search")] = None
