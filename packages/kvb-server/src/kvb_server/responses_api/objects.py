"""What ``/v1/responses`` answers, as pydantic models: the OpenAPI document's schemas.

The route builds plain dicts (:mod:`.build`, :mod:`.events`); these models describe them, and the tests
validate real responses and stream events against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, RootModel

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(BaseModel):
    id: str = Field(description="msg_...")
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str = Field(description="fc_...")
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str = Field(description="call_...: the id a function_call_output item answers")
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


OutputItem = Annotated[OutputMessage | FunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="input tokens served from the prefix cache")
    cache_write_tokens: int = Field(description="input tokens this request computed (and the cache keeps)")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """``POST /v1/responses`` without ``stream``, ``GET /v1/responses/{id}``, and the ``response`` of the
    lifecycle stream events (``output`` is empty and ``usage`` null while ``in_progress``)."""

    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    prompt_cache_retention: str | None
    reasoning: dict[str, Any]
    safety_identifier: str | None
    service_tier: str
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_logprobs: int
    top_p: float
    truncation: Literal["auto", "disabled"]
    usage: ResponseUsage | None
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(BaseModel):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(BaseModel):
    """``GET /v1/responses/{id}/input_items``: a cursor page of the conversation's input items."""

    object: Literal["list"]
    data: list[dict[str, Any]] = Field(
        description="input items (message, function_call, function_call_output, reasoning), each with an id"
    )
    first_id: str | None
    last_id: str | None
    has_more: bool


class InputTokenCount(BaseModel):
    """``POST /v1/responses/input_tokens``."""

    object: Literal["response.input_tokens"]
    input_tokens: int = Field(description="the prompt tokens POST /v1/responses would queue for this input")


# -- stream events ------------------------------------------------------------------------------------------
class _Event(BaseModel):
    sequence_number: int


class LifecycleEvent(_Event):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]]


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]]


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(_Event):
    """A failure after the stream began (then ``response.failed`` ends the stream)."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(
    RootModel[
        Annotated[
            LifecycleEvent
            | OutputItemEvent
            | ContentPartEvent
            | TextDeltaEvent
            | TextDoneEvent
            | ArgumentsDeltaEvent
            | ArgumentsDoneEvent
            | ErrorEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """One ``data:`` of ``POST /v1/responses`` with ``stream: true``; its ``event:`` line is its ``type``."""
