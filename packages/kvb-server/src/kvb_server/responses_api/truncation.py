"""OpenAI's ``truncation: "auto"`` for the Responses API: a conversation longer than the context window loses
its oldest items until the prompt and ``max_output_tokens`` fit, instead of a 400.

Only what the model reads is cut: the stored response keeps every input item. System and developer
messages (``instructions`` among them) are never dropped; a tool result whose call was dropped goes with it
(it could answer nothing). When even the last item does not fit, the 400 of that last try stands (it names
``max_output_tokens`` when the budget, not the item, is what does not fit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvb_server.errors import CONTEXT_LENGTH_EXCEEDED, InvalidParameterError
from kvb_server.schemas.generation_requests import ChatCompletionRequest, ChatMessage

#: Messages a truncation keeps wherever they stand.
KEPT_ROLES = frozenset({"system", "developer"})

Plan = TypeVar("Plan")


def drop_oldest(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """``messages`` without their oldest droppable item (and the tool results right after it); None when
    only one item besides system and developer messages is left."""
    droppable = [i for i, m in enumerate(messages) if m.role not in KEPT_ROLES]
    if len(droppable) <= 1:
        return None
    first = droppable[0]
    end = first + 1
    while end < len(messages) and messages[end].role == "tool":
        end += 1
    rest = [*messages[:first], *messages[end:]]
    return rest if any(m.role not in KEPT_ROLES for m in rest) else None


def fitting_plan(
    request: ChatCompletionRequest, plan: Callable[[ChatCompletionRequest], Plan], *, truncate: bool
) -> Plan:
    """``plan(request)``; with ``truncate``, retried on a context-length 400 with the oldest items dropped
    one at a time (each try renders and counts the prompt again) until one fits."""
    try:
        return plan(request)
    except InvalidParameterError as exc:
        if not truncate or exc.code != CONTEXT_LENGTH_EXCEEDED:
            raise
        failure = exc
    messages = list(request.messages)
    while (shorter := drop_oldest(messages)) is not None:
        messages = shorter
        try:
            return plan(request.model_copy(update={"messages": messages}))
        except InvalidParameterError as exc:
            if exc.code != CONTEXT_LENGTH_EXCEEDED:
                raise
            # The shortest try's error names what is still in the way: with only the newest item left that
            # may be max_output_tokens, where the first error said to shorten the input.
            failure = exc
    raise failure
