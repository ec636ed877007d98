"""From a Responses request to a chat-completions request, and from chat results back to Responses items.

The Responses route is a translator: every generation goes through the chat route's plan (its validation,
chat template, caps and refusals). What the chat route names differently is renamed back in errors
(:func:`responses_error`), so a client reads the parameter it sent.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError

from kvb_server.errors import InvalidParameterError, ServerError, UnsupportedFeatureError
from kvb_server.limits import loads_inner
from kvb_server.responses_api.schemas import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
    ToolChoiceAllowed,
    ToolChoiceFunction,
    UnsupportedItem,
    UnsupportedPart,
    UnsupportedTool,
    UnsupportedToolChoice,
)
from kvb_server.responses_api.store import ChatMessage
from kvb_server.schemas.generation_requests import ChatCompletionRequest

#: Chat parameter names (and paths) as this route's clients know them: (pattern, replacement), in order.
_RENAMES = (
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^max_(completion_)?tokens$"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\b(tools\[\d+\]|tool_choice)\.function\b"), r"\1"),
)
#: The renames that also apply inside error messages (a message's "messages" is a plain word).
_MESSAGE_RENAMES = (
    (re.compile(r"'max_tokens' or 'max_completion_tokens'"), "'max_output_tokens'"),  # vLLM's wording
    (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
    *_RENAMES[2:],
)


class ChatTranslation(NamedTuple):
    """A Responses request as a chat request.

    Attributes:
        request: the chat request (validated as the chat route validates its bodies).
        conversation: the messages a stored response keeps: the inherited conversation, then this
            request's input (``instructions`` excluded: OpenAI does not carry them over).
    """

    request: ChatCompletionRequest
    conversation: tuple[ChatMessage, ...]


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_param(param: str | None) -> str | None:
    """A chat parameter as this route's clients know it: ``max_tokens`` is ``max_output_tokens``,
    ``messages[...]`` is ``input``, ``response_format.json_schema...`` is ``text.format...``,
    ``tools[i].function.parameters`` is ``tools[i].parameters``."""
    if param is None:
        return None
    for pattern, replacement in _RENAMES:
        param = pattern.sub(replacement, param)
    return param


def responses_error(exc: ServerError) -> ServerError:
    """``exc`` with chat parameter names renamed to this route's (in ``param`` and in the message)."""
    exc.param = responses_param(exc.param)
    for pattern, replacement in _MESSAGE_RENAMES:
        exc.message = pattern.sub(replacement, exc.message)
    return exc


#: The ``include`` values this server honours: the message text's token logprobs, and encrypted reasoning
#: (accepted so that clients which always ask for it, with ``store: false``, work; nothing is encrypted).
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")


def unknown_includes(include: list[str] | None) -> list[str]:
    return [value for value in include or () if value not in INCLUDABLE]


def wants_logprobs(req: ResponsesRequest) -> bool:
    """The message's token logprobs are asked for: ``include`` lists them, or ``top_logprobs`` asks for
    alternatives (which only exist beside them)."""
    return "message.output_text.logprobs" in (req.include or ()) or bool(req.top_logprobs)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """Refuse, by name, what this server does not implement (a 400 rather than a silently ignored field)."""
    refusals = {
        "background": (req.background, "background mode is not supported; remove background"),
        "conversation": (
            req.conversation,
            "the Conversations API is not supported; use previous_response_id",
        ),
        "prompt": (req.prompt, "prompt templates are not supported; send input"),
        "include": (
            unknown_includes(req.include),
            f"{', '.join(map(repr, unknown_includes(req.include)))} not supported; this server adds "
            f"{' and '.join(map(repr, INCLUDABLE))} only",
        ),
        "tools": (
            req.tools and wants_logprobs(req),
            "logprobs (include message.output_text.logprobs or top_logprobs) are not supported together with "
            "tools: they would mix the tool calls' tokens into the message's",
        ),
        "reasoning": (
            req.reasoning and any(v is not None for v in req.reasoning.values()),
            "reasoning options (effort, summary) are not supported: a model's reasoning is not steered "
            "here (with --reasoning-parser its thinking is returned as a reasoning item)",
        ),
    }
    for param, (value, why) in refusals.items():
        if value:
            raise UnsupportedFeatureError(f"{param}: {why}.", param=param)
    for i, tool in enumerate(req.tools or ()):
        if isinstance(tool, UnsupportedTool):
            raise UnsupportedFeatureError(
                f"tools[{i}]: built-in tool type '{tool.type}' is not supported; only function tools "
                "({'type': 'function', 'name': ..., 'parameters': ...}) are.",
                param=f"tools[{i}].type",
            )
    if isinstance(req.tool_choice, UnsupportedToolChoice):
        raise UnsupportedFeatureError(
            f"tool_choice: type '{req.tool_choice.type}' is not supported; use 'none', 'auto', 'required' "
            "or {'type': 'function', 'name': ...}.",
            param="tool_choice",
        )


def _text(content: str | Sequence[Any], where: str, *, assistant: bool) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, UnsupportedPart) or (isinstance(part, RefusalPart) and not assistant):
            raise UnsupportedFeatureError(
                f"{where}.content[{j}]: content type '{part.type}' is not supported; this server takes "
                "text only (input_text, output_text).",
                param=f"{where}.content[{j}].type",
            )
        texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "\n".join(texts)  # as the chat route joins text parts (and vLLM)


def _json_arguments(arguments: str) -> bool:
    """Whether the chat route takes ``arguments`` (JSON, or blank for no arguments)."""
    if not arguments.strip():
        return True
    try:
        loads_inner(arguments)
    except ValueError:
        return False
    return True


def _callable_history(conversation: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
    """A stored conversation without the function calls whose arguments are not JSON.

    Only a call cut off by ``max_output_tokens`` in a stream has such arguments (a streamed call is output
    as it is generated). Kept, it made every ``previous_response_id`` follow-up a 400 the client could not
    fix. The messages are shared with other stored responses: changed ones are copies.
    """
    out = []
    for message in conversation:
        calls = message.get("tool_calls")
        kept = [c for c in calls or () if _json_arguments(c["function"]["arguments"])]
        if calls and len(kept) < len(calls):
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            if kept:
                message["tool_calls"] = kept
            elif message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return tuple(out)


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The request's ``input`` as chat messages.

    An assistant message and the function calls right after it become one assistant message with
    ``tool_calls`` (what the model produced in one turn); a ``function_call_output`` becomes a ``tool``
    message; a ``reasoning`` item's text becomes the ``reasoning_content`` of the assistant turn it leads.
    """
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[ChatMessage] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            thought = _reasoning_text(item, where)
            continue
        if isinstance(item, MessageItem):
            assistant = item.role == "assistant"
            out.append({"role": item.role, "content": _text(item.content, where, assistant=assistant)})
            if assistant and thought is not None:
                out[-1]["reasoning_content"] = thought
            thought = None
        elif isinstance(item, FunctionCallItem):
            if not _json_arguments(item.arguments):
                # The chat route refused it naming 'messages[...].tool_calls[0].function.arguments'.
                raise InvalidParameterError(
                    f"Invalid value for '{where}.arguments': not valid JSON"
                    + (
                        " (a function call cut off by max_output_tokens has incomplete arguments: leave it "
                        "out, or ask again with a larger max_output_tokens)."
                        if item.status == "incomplete"
                        else "."
                    ),
                    param=f"{where}.arguments",
                )
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thought is not None:
                    out[-1]["reasoning_content"] = thought
            thought = None
        elif isinstance(item, FunctionCallOutputItem):
            thought = None
            output = _text(item.output, where, assistant=False)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            assert isinstance(item, UnsupportedItem)
            raise UnsupportedFeatureError(
                f"{where}: input item type '{item.type}' is not supported; this server takes message, "
                "function_call, function_call_output and reasoning items.",
                param=f"{where}.type",
            )
    return out


def _reasoning_text(item: ReasoningItem, where: str) -> str:
    """A reasoning item's text (its ``reasoning_text`` parts, else its summary's)."""
    if item.encrypted_content is not None:
        raise UnsupportedFeatureError(
            f"{where}.encrypted_content: encrypted reasoning (OpenAI's) cannot be read by this server; "
            "leave the item out.",
            param=f"{where}.encrypted_content",
        )
    parts = item.content if item.content else item.summary
    texts = []
    for k, part in enumerate(parts):
        text = part.get("text")
        if not isinstance(text, str):
            field = "content" if item.content else "summary"
            raise InvalidParameterError(
                f"Invalid value for '{where}.{field}[{k}].text': expected a string.",
                param=f"{where}.{field}[{k}].text",
            )
        texts.append(text)
    return "\n".join(texts)


def _tool_fields(req: ResponsesRequest) -> dict[str, Any]:
    """Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (none at all without tools)."""
    tools = [t for t in req.tools or () if isinstance(t, FunctionTool)]
    choice = req.tool_choice
    if not tools:
        if choice == "required" or isinstance(choice, ToolChoiceFunction | ToolChoiceAllowed):
            raise InvalidParameterError(
                "tool_choice requires tools: declare the function in tools.", param="tool_choice"
            )
        return {}
    if isinstance(choice, ToolChoiceFunction) and choice.name not in {t.name for t in tools}:
        raise InvalidParameterError(
            f"tool_choice names function '{choice.name}', which is not in tools.", param="tool_choice"
        )
    fields: dict[str, Any] = {
        "tools": [
            {
                "type": "function",
                "function": t.model_dump(exclude={"type"}, exclude_none=True),
            }
            for t in tools
        ]
    }
    if isinstance(choice, ToolChoiceFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ToolChoiceAllowed):
        listed = [{"type": "function", "function": {"name": t.name}} for t in choice.tools]
        fields["tool_choice"] = {
            "type": "allowed_tools",
            "allowed_tools": {"mode": choice.mode, "tools": listed},
        }
    elif choice is not None:
        fields["tool_choice"] = choice
    if req.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = req.parallel_tool_calls
    return fields


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        spec = {"name": fmt.name, "schema": fmt.json_schema}
        if fmt.description is not None:
            spec["description"] = fmt.description
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": spec}
    return None  # plain text: chat's default


def to_chat(req: ResponsesRequest, inherited: tuple[ChatMessage, ...] = ()) -> ChatTranslation:
    """The chat request serving ``req``, whose conversation continues ``inherited``.

    Raises:
        InvalidParameterError: what the chat route refuses, with this route's parameter names.
    """
    refuse_unsupported(req)
    conversation = (*_callable_history(inherited), *input_messages(req))
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*system, *conversation],
        "stream": bool(req.stream),
        **_tool_fields(req),
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens,
        "seed": req.seed,
        "user": req.user,
        "cache_salt": req.cache_salt,
        "response_format": _response_format(req),
    }
    if wants_logprobs(req):
        optional |= {"logprobs": True, "top_logprobs": req.top_logprobs or 0}
    body.update({k: v for k, v in optional.items() if v is not None})
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first.get("loc", ())
        param = responses_param(str(loc[0])) if loc else None
        raise InvalidParameterError(
            f"Invalid value for '{param}': {first.get('msg')}.", param=param
        ) from None
    return ChatTranslation(request=chat, conversation=conversation)
