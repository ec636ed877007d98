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


def truncations(messages: list[ChatMessage]) -> list[int]:
    """Where each successive truncation of ``messages`` starts: entry ``d`` is the index from which the
    droppable items survive ``d`` drops (entry 0 is 0: nothing dropped). A drop takes the oldest droppable
    item and the tool results right after it, and is possible while another droppable item remains after it.
    """
    cuts = [0]
    n = len(messages)
    droppable = [i for i, m in enumerate(messages) if m.role not in KEPT_ROLES]
    last = droppable[-1] if droppable else -1
    start = 0
    for first in droppable:  # one pass: linear in the conversation
        if first < start:
            continue  # a tool result dropped with its call
        end = first + 1
        while end < n and messages[end].role == "tool":
            end += 1
        if end > last:  # nothing droppable would be left
            return cuts
        cuts.append(end)
        start = end
    return cuts


def truncated(messages: list[ChatMessage], cut: int) -> list[ChatMessage]:
    """``messages`` with the droppable items before index ``cut`` left out (system and developer kept)."""
    return [m for i, m in enumerate(messages) if i >= cut or m.role in KEPT_ROLES]


def fitting_plan(
    request: ChatCompletionRequest, plan: Callable[[ChatCompletionRequest], Plan], *, truncate: bool
) -> Plan:
    """``plan(request)``; with ``truncate``, on a context-length 400, the plan with the fewest oldest items
    dropped that fits.

    NOTE: the number of drops is found by bisection (fewer items never make a longer prompt), so a
    conversation of ``k`` items is rendered and counted about ``log2(k)`` times. Dropping one item per try
    rendered it ``k`` times, each in time linear in ``k``: a 157-byte follow-up to a stored conversation of
    1,500 short messages took 30 s (found by an audit, 2026-12-02).
    """
    try:
        return plan(request)
    except InvalidParameterError as exc:
        if not truncate or exc.code != CONTEXT_LENGTH_EXCEEDED:
            raise
        failure = exc
    messages = list(request.messages)
    cuts = truncations(messages)
    if len(cuts) == 1:
        raise failure
    fits: dict[int, Plan] = {}

    def attempt(drops: int) -> bool:
        nonlocal failure
        try:
            fits[drops] = plan(request.model_copy(update={"messages": truncated(messages, cuts[drops])}))
            return True
        except InvalidParameterError as exc:
            if exc.code != CONTEXT_LENGTH_EXCEEDED:
                raise
            # The shortest try's error names what is still in the way: with only the newest item left that
            # may be max_output_tokens, where the first error said to shorten the input.
            failure = exc
            return False

    if attempt(1):  # the common case: the newest turn overflowed by a little
        return fits[1]
    most = len(cuts) - 1
    if most == 1 or not attempt(most):
        raise failure
    low, high = 2, most  # the fewest drops that fit lies in [low, high]; high fits
    while low < high:
        middle = (low + high) // 2
        if attempt(middle):
            high = middle
        else:
            low = middle + 1
    return fits[high]
