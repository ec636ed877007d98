"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), as strict pydantic models.

As for the chat routes (:mod:`kvb_server.schemas.generation_requests`): types are strict, unknown fields
are a 400, and what OpenAI defines but this server does not implement is declared so that :mod:`.convert`
refuses it by name.
Input items, content parts and tools whose ``type`` this server does not serve (images, files,
built-in tools, ...) parse into the ``Unsupported*`` models for the same reason.

Fields an SDK sends back when a client passes ``response.output`` items as the next ``input`` (``id``,
``status``, ``annotations``, ``logprobs``, ``phase``; a function call's ``async``, ``caller``, ``namespace``)
are accepted and not used.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, WithJsonSchema

from kvb_server.schemas.fields import (
    CacheSalt,
    MaxTokens,
    Metadata,
    PromptCacheRetention,
    SafetyIdentifier,
    Seed,
    ServiceTier,
    Temperature,
    TopP,
    Verbosity,
)

_STRICT = ConfigDict(strict=True, extra="forbid")
# What an unsupported item may carry: anything (it is refused by its type, not by its fields).
_LOOSE = ConfigDict(strict=True, extra="allow")

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def _whole_number(value: Any) -> Any:
    # As kvb_server.schemas.fields does: JSON does not tell 10 from 10.0. The bounds come before the
    # validator, so the JSON schema says "minimum" rather than pydantic's raw "ge".
    return int(value) if isinstance(value, float) and value.is_integer() else value


TopLogprobs = Annotated[int, Field(ge=0, le=20), BeforeValidator(_whole_number)]
MaxToolCalls = Annotated[int, Field(ge=1), BeforeValidator(_whole_number)]


def _only(accepted: dict[str, Any], what: str) -> WithJsonSchema:
    """The documented schema of a field declared to be refused by name: only the values this server takes
    (validation stays loose so that the refusal names the field), so schema-driven fuzzers send those."""
    return WithJsonSchema({**accepted, "description": f"Not supported: {what}; anything else is a 400."})


#: The documented schema of an ``Unsupported*`` union member: nothing (only the supported members are).
_NONE_ACCEPTED = WithJsonSchema({"not": {}})
_NULL: dict[str, Any] = {"type": "null"}


def _tag(supported: frozenset[str], default: str | None = None) -> Discriminator:
    """A discriminator picking the model of ``type``; other types go to the ``"unsupported"`` model."""

    def pick(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        if kind is None:
            return None  # pydantic reports the missing tag
        # A non-string type (even an unhashable one) goes to the unsupported model, whose str type refuses it.
        return kind if isinstance(kind, str) and kind in supported else "unsupported"

    return Discriminator(pick)


# -- content parts --------------------------------------------------------------------------------------
class InputText(BaseModel):
    model_config = _STRICT

    type: Literal["input_text"]
    text: str


class OutputTextPart(BaseModel):
    """An assistant message's text, as this server (or OpenAI) returned it in ``output``."""

    model_config = _STRICT

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class RefusalPart(BaseModel):
    model_config = _STRICT

    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(BaseModel):
    """Images, files, audio: refused by type (this server serves text-only models)."""

    model_config = _LOOSE

    type: str


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")]
    | Annotated[OutputTextPart, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[UnsupportedPart, Tag("unsupported"), _NONE_ACCEPTED],
    _tag(frozenset({"input_text", "output_text", "refusal"})),
]


# -- input items ----------------------------------------------------------------------------------------
class MessageItem(BaseModel):
    """A message: OpenAI's "easy" input message (no ``type``), an input message or a previous output one."""

    model_config = _STRICT

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ContentPart] | str
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(BaseModel):
    """A function call the model made earlier (from a previous response's ``output``)."""

    model_config = _STRICT

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    # What the openai SDK's ResponseFunctionToolCall also carries (model_dump(by_alias=True) of an output
    # item sends them, null): accepted and not used, as id and status. They were a 400 naming input[i].async.
    async_: bool | None = Field(default=None, alias="async")
    caller: dict[str, Any] | None = None
    namespace: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of running a function call, for the model to read."""

    model_config = _STRICT

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: list[ContentPart] | str
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningItem(BaseModel):
    """A reasoning item of a previous response (``--reasoning-parser``): its text goes back to the template
    as the next assistant turn's ``reasoning_content``. ``encrypted_content`` (OpenAI's) cannot be read
    here and is refused."""

    model_config = _STRICT

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: Annotated[str | None, _only(_NULL, "encrypted reasoning")] = None
    status: ItemStatus | None = None


class ItemReference(BaseModel):
    """An item of a stored response named by its ``id`` (an input item or an output item): replaced by the
    stored item before the request is served (:mod:`kvb_server.responses_api.items`)."""

    model_config = _STRICT

    type: Literal["item_reference"]
    id: Annotated[str, Field(min_length=1)]


class UnsupportedItem(BaseModel):
    """Built-in tool calls and their outputs: refused by type."""

    model_config = _LOOSE

    type: str


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[UnsupportedItem, Tag("unsupported"), _NONE_ACCEPTED],
    _tag(
        frozenset({"message", "function_call", "function_call_output", "reasoning", "item_reference"}),
        default="message",
    ),
]


# -- tools ------------------------------------------------------------------------------------------------
class FunctionTool(BaseModel):
    """A function the model may call (the Responses shape: no nested ``function`` object)."""

    model_config = _STRICT

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class UnsupportedTool(BaseModel):
    """Built-in tools (web_search, file_search, code_interpreter, computer use, MCP, ...): refused by type."""

    model_config = _LOOSE

    type: str


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[UnsupportedTool, Tag("unsupported"), _NONE_ACCEPTED],
    _tag(frozenset({"function"})),
]


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class AllowedFunction(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class ToolChoiceAllowed(BaseModel):
    """``{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name"}]}``:
    calls restricted to a subset of the declared tools (the chat route's ``allowed_tools``)."""

    model_config = _STRICT

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[AllowedFunction], Field(min_length=1)]


class UnsupportedToolChoice(BaseModel):
    """Built-in tool types, MCP, ...: refused by type."""

    model_config = _LOOSE

    type: str


ToolChoiceObject = Annotated[
    Annotated[ToolChoiceFunction, Tag("function")]
    | Annotated[ToolChoiceAllowed, Tag("allowed_tools")]
    | Annotated[UnsupportedToolChoice, Tag("unsupported"), _NONE_ACCEPTED],
    _tag(frozenset({"function", "allowed_tools"})),
]


# -- text format ------------------------------------------------------------------------------------------
class FormatText(BaseModel):
    model_config = _STRICT

    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = _STRICT

    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=False)

    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = _STRICT

    format: TextFormat | None = None
    #: Accepted and echoed, ignored as on the chat route (the served models have no verbosity control).
    verbosity: Verbosity | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_obfuscation: bool | None = None


# -- the request ------------------------------------------------------------------------------------------
class ResponsesRequest(BaseModel):
    """``POST /v1/responses``.

    Extensions beyond OpenAI's fields: ``seed`` and ``cache_salt`` (as on the chat route).
    """

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        # tool_choice 'required' or a named function needs that function in tools (a 400 otherwise), said
        # where schema-driven clients look.
        json_schema_extra={
            "if": {
                "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
                "required": ["tool_choice"],
            },
            "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
        },
    )

    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    input: Annotated[list[InputItem], Field(min_length=1)] | str
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    max_output_tokens: MaxTokens | None = None
    max_tool_calls: MaxToolCalls | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: SafetyIdentifier | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    service_tier: ServiceTier | None = None
    seed: Seed | None = None
    cache_salt: CacheSalt | None = None
    # Declared only to be refused by name unless they hold their default (see convert.refuse_unsupported).
    background: Annotated[bool | None, _only({"enum": [False, None]}, "background mode")] = None
    #: ``"auto"``: the oldest input items are dropped until the prompt fits (responses_api/truncation.py).
    truncation: Literal["auto", "disabled"] | None = None
    #: ``message.output_text.logprobs`` (the message's token logprobs) and ``reasoning.encrypted_content``
    #: (accepted: reasoning items are never encrypted here, their ``encrypted_content`` stays null); any other
    #: value is a 400 naming it (convert.refuse_unsupported).
    include: Annotated[
        list[str] | None,
        WithJsonSchema(
            {
                "anyOf": [
                    {
                        "type": "array",
                        "items": {"enum": ["message.output_text.logprobs", "reasoning.encrypted_content"]},
                    },
                    _NULL,
                ],
                "description": "message.output_text.logprobs adds the message text's token logprobs; "
                "reasoning.encrypted_content is accepted (nothing is encrypted); anything else is a 400.",
            }
        ),
    ] = None
    reasoning: Annotated[
        dict[str, Any] | None,
        _only(
            {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"effort": _NULL, "summary": _NULL},
                        "additionalProperties": False,
                    },
                    _NULL,
                ]
            },
            "reasoning options",
        ),
    ] = None
    #: Most likely alternatives per token in the message's logprobs (0-20); asking for any turns logprobs on.
    top_logprobs: TopLogprobs | None = None
    conversation: Annotated[str | dict[str, Any] | None, _only(_NULL, "the Conversations API")] = None
    prompt: Annotated[dict[str, Any] | None, _only(_NULL, "prompt templates")] = None


class InputTokensRequest(BaseModel):
    """``POST /v1/responses/input_tokens``: the fields of a Responses request that shape its prompt.

    ``model`` defaults to the first served name. Without ``input``, the count is that of the conversation
    ``previous_response_id`` continues (and ``instructions``).
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field(default=None, description="a served model; left out: the first one")  # type: ignore[assignment]
    input: Annotated[list[InputItem], Field(min_length=1)] | str | None = None
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    # Declared only to be refused by name unless they hold their default, as on POST /v1/responses.
    truncation: Annotated[
        Literal["auto", "disabled"] | None, _only({"enum": ["disabled", None]}, "truncation='auto'")
    ] = None
    reasoning: Annotated[
        dict[str, Any] | None,
        _only({"anyOf": [{"type": "object", "maxProperties": 0}, _NULL]}, "reasoning options"),
    ] = None
    conversation: Annotated[str | dict[str, Any] | None, _only(_NULL, "the Conversations API")] = None
    personality: Annotated[str | None, _only(_NULL, "personality presets")] = None

    def as_request(self, model: str) -> ResponsesRequest:
        """The Responses request these fields describe (``input`` empty when left out)."""
        fields = self.model_fields_set - {"personality", "model", "input"}
        # Built from already-validated values: model_construct keeps the parsed items as they are.
        return ResponsesRequest.model_construct(
            **{name: getattr(self, name) for name in fields},
            model=self.model or model,
            input=self.input or [],
        )
