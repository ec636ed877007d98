"""Stored responses for ``previous_response_id`` and ``GET /v1/responses/{id}``: a bounded in-memory LRU.

Each entry keeps a response object and the conversation that produced it (its input messages, inherited
ones included, then its output as one assistant message), so a follow-up request's messages are that
conversation plus its new input: its prompt starts with the previous turn's tokens, a prefix-cache hit.
It also keeps that input as Responses items with ids (:mod:`kvb_server.responses_api.items`), for
``GET /v1/responses/{id}/input_items`` and for ``item_reference`` inputs, which :meth:`ResponseStore.item`
finds by id among every stored response's input and output items.

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
        items: the input items of the whole conversation, oldest first: the inherited ones (the previous
            response's items, then its output items), then this request's input, each with an ``id``.
        chars: this entry's share of the store's budget.
    """

    response: dict[str, Any]
    conversation: tuple[ChatMessage, ...]
    items: tuple[dict[str, Any], ...] = ()
    chars: int

    def history(self) -> tuple[dict[str, Any], ...]:
        """The items a follow-up inherits: this response's input items, then its output items."""
        return (*self.items, *self.response["output"])


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
        # (key salt, item id) -> (the item, how many entries hold it): a follow-up's entry holds the items
        # it inherited too, so an item is forgotten with the last entry that holds it.
        self._items: dict[tuple[str | None, str], tuple[dict[str, Any], int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key_salt: str | None, response_id: str) -> StoredResponse | None:
        """The stored response, marked as recently used; None when unknown, evicted or another key's."""
        key = (key_salt, ResponseId(response_id))
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def item(self, key_salt: str | None, item_id: str) -> dict[str, Any] | None:
        """The input or output item ``item_id`` of a response stored under ``key_salt``; None when no
        stored response holds it."""
        found = self._items.get((key_salt, item_id))
        return None if found is None else found[0]

    def put(
        self,
        key_salt: str | None,
        response: dict[str, Any],
        conversation: tuple[ChatMessage, ...],
        items: tuple[dict[str, Any], ...] = (),
    ) -> None:
        """Store ``response`` (its ``id`` is the key), its conversation and its input items, dropping the
        least recently used entries while the store is over its bounds."""
        entry = StoredResponse(
            response=response,
            conversation=conversation,
            items=items,
            chars=_size(conversation) + _size(response) + _size(items),
        )
        key = (key_salt, ResponseId(response["id"]))
        self._drop(key)
        self._entries[key] = entry
        self._chars += entry.chars
        for item in entry.history():
            held = self._items.get((key_salt, item["id"]))
            self._items[(key_salt, item["id"])] = (item, 1) if held is None else (held[0], held[1] + 1)
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
        for item in entry.history():
            item_key = (key[0], item["id"])
            held, count = self._items[item_key]
            if count == 1:
                del self._items[item_key]
            else:
                self._items[item_key] = (held, count - 1)
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
