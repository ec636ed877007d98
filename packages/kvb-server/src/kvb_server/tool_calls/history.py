"""A chat history's tool turns must pair up, as OpenAI requires.

Each ``tool`` message answers a call of the assistant message right before its run of ``tool`` messages,
and an assistant message with ``tool_calls`` is followed by an answer to each of its calls. Otherwise the
prompt would show the model results of calls it never made, or calls without results (a ``<tool_response>``
echoed back was seen), and the reply is silently wrong; OpenAI answers such a history with a 400 naming the
message, and so does this server. Calls sent without an ``id`` cannot be matched and are not checked (OpenAI
requires ids; some clients of open-model servers leave them out).
"""

from __future__ import annotations

from typing import Any

from kvb_server.errors import InvalidParameterError


def check_tool_history(messages: list[Any]) -> None:
    """Raise :class:`InvalidParameterError` naming the first unpaired tool call or tool message.

    ``messages``: the request's :class:`~kvb_server.schemas.generation_requests.ChatMessage` list (its
    ``tool_calls`` are raw dicts, checked in detail by :mod:`kvb_server.tool_calls.prompt`).
    """
    open_calls: list[str] | None = None  # ids still unanswered of the last assistant message with calls
    made: list[str] = []  # every id that message's calls carry
    opened_at = -1
    for i, msg in enumerate(messages):
        if msg.role == "tool":
            if not isinstance(msg.tool_call_id, str):
                continue  # a missing tool_call_id is named by tool_calls/prompt.py
            if open_calls is None:
                raise InvalidParameterError(
                    f"Invalid parameter: messages with role 'tool' must be a response to a preceding message "
                    f"with 'tool_calls' (messages[{i}] follows no assistant tool calls).",
                    param=f"messages[{i}].role",
                )
            call_id = msg.tool_call_id
            if made and call_id not in made:
                raise InvalidParameterError(
                    f"Invalid parameter: 'tool_call_id' of {call_id!r} not found in 'tool_calls' of "
                    f"messages[{opened_at}].",
                    param=f"messages[{i}].tool_call_id",
                )
            if call_id in open_calls:
                open_calls.remove(call_id)
            continue
        _unanswered(open_calls, opened_at)
        open_calls = None
        if msg.role == "assistant" and msg.tool_calls:
            made, opened_at = _ids(msg.tool_calls), i
            open_calls = list(made)
    _unanswered(open_calls, opened_at)


def _ids(calls: Any) -> list[str]:
    """The non-empty ids of an assistant message's raw ``tool_calls``."""
    if not isinstance(calls, list):
        return []  # malformed: tool_calls/prompt.py names the field
    return [c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str) and c["id"]]


def _unanswered(open_calls: list[str] | None, at: int) -> None:
    if open_calls:
        raise InvalidParameterError(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'. The following tool_call_ids of messages[{at}] did not have response messages: "
            f"{', '.join(open_calls)}.",
            param=f"messages[{at}].tool_calls",
        )
