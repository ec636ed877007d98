"""Real multi-turn conversations (chitchat-dataset, MIT) replayed as chat prompts.

The users' messages come from the dataset; the assistant's turns are the model's own replies, fed back
into the history as a chat client would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources

SYSTEM_PROMPT = (
    "You are a friendly, concise assistant in a casual chat. Answer in one or two sentences, stay on topic, "
    "ask a short follow-up question when it helps the conversation along, and never invent personal facts."
)


def load_user_turns(max_conversations: int, *, min_turns: int = 3) -> list[list[str]]:
    """The first speaker's messages of the first conversations that have at least ``min_turns`` of them.

    Raises:
        ImportError: chitchat-dataset is not installed (``pip install chitchat-dataset``).
    """
    try:
        data_file = resources.files("chitchat_dataset").joinpath("dataset.json")
    except ModuleNotFoundError as exc:
        raise ImportError(
            'The conversation replay needs chitchat-dataset: pip install "kvboost[demo]" (or chitchat-dataset)'
        ) from exc
    with data_file.open() as f:
        data = json.load(f)
    conversations = []
    for conversation in data.values():
        groups = conversation["messages"]
        # Messages come in groups by sender; the first sender plays the user.
        first = groups[0][0]["sender"] if groups and groups[0] else None
        turns = [
            " ".join(m["text"] for m in group) for group in groups if group and group[0]["sender"] == first
        ]
        turns = [t.strip() for t in turns if t.strip()]
        if len(turns) >= min_turns:
            conversations.append(turns)
        if len(conversations) == max_conversations:
            break
    return conversations


def chat_turns(user_turns: list[str], max_turns: int) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """Yield ``(turn, messages)`` where messages end with the turn's user message.

    The caller appends the assistant's reply to ``messages`` before asking for the next turn.
    """
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn, text in enumerate(user_turns[:max_turns], start=1):
        messages.append({"role": "user", "content": text})
        yield turn, messages
