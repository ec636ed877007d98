"""``truncation: "auto"``'s search for the fewest oldest items to drop (:mod:`kvb_server.responses_api.truncation`)."""

from __future__ import annotations

import random

import pytest

from kvb_server.errors import CONTEXT_LENGTH_EXCEEDED, InvalidParameterError
from kvb_server.responses_api.truncation import KEPT_ROLES, fitting_plan, truncated, truncations
from kvb_server.schemas.generation_requests import ChatCompletionRequest, ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(role: str, i: int) -> ChatMessage:
    if role == "tool":
        return ChatMessage(role="tool", content=f"m{i}", tool_call_id=f"c{i}")
    return ChatMessage(role=role, content=f"m{i}")


def _drop_oldest(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The rule, one drop at a time (what the search replaced): the oldest droppable item and the tool
    results right after it, while another droppable item remains."""
    droppable = [i for i, m in enumerate(messages) if m.role not in KEPT_ROLES]
    if len(droppable) <= 1:
        return None
    first = droppable[0]
    end = first + 1
    while end < len(messages) and messages[end].role == "tool":
        end += 1
    rest = [*messages[:first], *messages[end:]]
    return rest if any(m.role not in KEPT_ROLES for m in rest) else None


def test_truncations_are_the_one_at_a_time_drops() -> None:
    rng = random.Random(0)
    for _ in range(300):
        messages = [_message(rng.choice(ROLES), i) for i in range(rng.randint(1, 12))]
        expected, current = [messages], messages
        while (current := _drop_oldest(current)) is not None:
            expected.append(current)
        assert [truncated(messages, cut) for cut in truncations(messages)] == expected


def _request(n: int) -> ChatCompletionRequest:
    messages = [ChatMessage(role="system", content="s")]
    messages += [_message("user" if i % 2 else "assistant", i) for i in range(n)]
    return ChatCompletionRequest(model="m", messages=messages)


@pytest.mark.parametrize("fitting", [1, 2, 700, 1499])
def test_the_fewest_drops_that_fit_in_a_logarithmic_number_of_tries(fitting: int) -> None:
    # One render per drop made a follow-up to a stored conversation of 1,500 messages take 30 s.
    request = _request(1500)
    tries = []

    def plan(chat: ChatCompletionRequest) -> int:
        tries.append(len(chat.messages))
        if len(chat.messages) > 1501 - fitting:
            raise InvalidParameterError("too long", code=CONTEXT_LENGTH_EXCEEDED)
        return len(chat.messages)

    assert fitting_plan(request, plan, truncate=True) == 1501 - fitting
    assert len(tries) <= 14, len(tries)


def test_when_nothing_fits_the_shortest_tries_error_stands() -> None:
    def plan(chat: ChatCompletionRequest) -> int:
        raise InvalidParameterError(f"{len(chat.messages)} messages", code=CONTEXT_LENGTH_EXCEEDED)

    with pytest.raises(InvalidParameterError, match=r"^2 messages"):
        fitting_plan(_request(40), plan, truncate=True)
    with pytest.raises(InvalidParameterError, match=r"^41 messages"):
        fitting_plan(_request(40), plan, truncate=False)
