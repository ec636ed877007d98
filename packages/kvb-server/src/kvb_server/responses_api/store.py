"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``: a bounded in-memory LRU.

Each entry keeps a response object and the conversation that produced it (its input messages, inherited
ones included, then its output as one assistant message), so a follow-up request's messages are that
conversation plus its new input: its prompt starts with the previous turn's tokens, a prefix-cache hit.

Entries are scoped by the caller's API-key salt (:attr:`kvb_server.tenancy.Caller.key_salt`): a key never
reads, continues or deletes another key's responses. Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NewType

from kvb_server.errors import ServerError

ResponseId = NewType("ResponseId", str)
#: A chat message as the chat route takes it (``role``, ``content``, maybe ``tool_calls`` / ``tool_call_id``).
ChatMessage = dict[str, Any]

#: Stored responses kept, most recently used first, before the oldest is dropped.
DEFAULT_MAX_ENTRIES = 4096
#: Budget of the stored conversations' text (JSON characters; a conversation shared by several entries is
#: counted once per entry, so the memory held is at most this).
DEFAULT_MAX_CHARS = 256 * 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the response object as ``GET /v1/responses/{id}`` returns it.
        conversation: chat messages of the whole conversation up to and including this response's output,
            without ``instructions`` (OpenAI does not carry those over to a follow-up).
        chars: this entry's share of the store's budget.
    """

    response: dict[str, Any]
    conversation: tuple[ChatMessage, ...]
    chars: int


class ResponseStore:
    """LRU of stored responses keyed by (API-key salt, response id), bounded in entries and characters.

    Used from the event loop only (no locking). Message dicts are shared between a response and its
    follow-ups, never copied or mutated, so a long conversation costs one list of references per turn.
    """

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError(f"max_entries and max_chars must be >= 1, got {max_entries} and {max_chars}")
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._entries: OrderedDict[tuple[str | None, ResponseId], StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key_salt: str | None, response_id: str) -> StoredResponse | None:
        """The stored response, marked as recently used; None when unknown, evicted or another key's."""
        key = (key_salt, ResponseId(response_id))
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(
        self, key_salt: str | None, response: dict[str, Any], conversation: tuple[ChatMessage, ...]
    ) -> None:
        """Store ``response`` (its ``id`` is the key) and its conversation, dropping the least recently
        used entries while the store is over its bounds."""
        entry = StoredResponse(
            response=response, conversation=conversation, chars=_size(conversation) + _size(response)
        )
        key = (key_salt, ResponseId(response["id"]))
        self._drop(key)
        self._entries[key] = entry
        self._chars += entry.chars
        while self._entries and (len(self._entries) > self._max_entries or self._chars > self._max_chars):
            self._drop(next(iter(self._entries)))

    def delete(self, key_salt: str | None, response_id: str) -> bool:
        """Forget a stored response; False when there was none (for this key)."""
        return self._drop((key_salt, ResponseId(response_id)))

    def _drop(self, key: tuple[str | None, ResponseId]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._chars -= entry.chars
        return True


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


class ResponseNotFoundError(ServerError):
    """``GET``/``DELETE /v1/responses/{id}`` of a response that is not stored for this API key (404)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"Response with id '{response_id}' not found. Responses are kept in memory for this server's "
            "lifetime, per API key, for the most recent ones only (and not at all with store: false).",
            param="response_id",
        )
