"""The items of a stored conversation: what ``GET /v1/responses/{id}/input_items`` lists, and what an
``item_reference`` input item names.

A stored response keeps its input as Responses items, each with an ``id`` (the client's, or a new
``msg_`` / ``fc_`` / ``fco_`` / ``rs_`` one), after the items it inherited from ``previous_response_id``
(that response's input items, then its output items). So the listing of a follow-up holds the whole
conversation the model was given, oldest first, as the Responses clients that replay a conversation from it
expect (Codex, the Agents SDK's session helpers); ``instructions`` are not items.

``item_reference`` (``{"type": "item_reference", "id": "msg_..."}``) is how stateful clients (the Vercel
AI SDK with ``store`` on, Codex) resend an item the server already holds instead of its content: it is
replaced by the stored item with that id, from any response stored under the caller's API key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from kvb_server.errors import InvalidParameterError
from kvb_server.responses_api.convert import new_id
from kvb_server.responses_api.schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

Item = dict[str, Any]
#: ``GET .../input_items`` ``limit``: OpenAI's default and bounds.
DEFAULT_LIMIT = 20
MAX_LIMIT = 100

_INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)


def _content(content: str | Sequence[Any], role: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        if role == "assistant":
            return [{"type": "output_text", "text": content, "annotations": []}]
        return [{"type": "input_text", "text": content}]
    return [part.model_dump(exclude_none=True) for part in content]


def as_item(item: Any) -> Item:
    """One parsed input item as the listing shows it: an ``id`` (the client's, else a new one), a
    ``status``, text content as parts."""
    if isinstance(item, MessageItem):
        return {
            "id": item.id or new_id("msg"),
            "type": "message",
            "role": item.role,
            "status": item.status or "completed",
            "content": _content(item.content, item.role),
        }
    if isinstance(item, FunctionCallItem):
        return {
            "id": item.id or new_id("fc"),
            "type": "function_call",
            "status": item.status or "completed",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
        }
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _content(item.output, "tool")
        return {
            "id": item.id or new_id("fco"),
            "type": "function_call_output",
            "status": item.status or "completed",
            "call_id": item.call_id,
            "output": output,
        }
    assert isinstance(item, ReasoningItem), type(item)
    return {
        "id": item.id or new_id("rs"),
        "type": "reasoning",
        "status": item.status or "completed",
        "summary": item.summary,
        "content": item.content or [],
        "encrypted_content": None,
    }


def resolve_references(
    req: ResponsesRequest, find: Callable[[str], Item | None], inherited: Sequence[Item]
) -> tuple[ResponsesRequest, tuple[Item, ...]]:
    """``req`` with each ``item_reference`` replaced by the stored item it names, and its input as items.

    ``find`` looks an item id up among the caller's stored responses; ``inherited`` are the items of the
    conversation ``previous_response_id`` continues, which a reference may not repeat (OpenAI's "Duplicate
    item" 400: the model would read the item twice).

    Raises:
        InvalidParameterError: a reference to an unknown (never stored, evicted, another key's) item, or to
            one the continued conversation already holds (``param``: ``input[i].id``).
    """
    if isinstance(req.input, str):
        return req, (as_item(MessageItem(role="user", content=req.input)),)
    held = {item["id"] for item in inherited}
    parsed: list[Any] = []
    items: list[Item] = []
    for i, entry in enumerate(req.input):
        # Any item with its id, sent whole or by reference, once: an inline copy of an item the continued
        # conversation holds, or one id twice in the request, was read twice by the model and, stored,
        # made input_items' "after" cursor return the same page forever (an audit, 2026-11-30).
        given = getattr(entry, "id", None)
        if isinstance(given, str) and given in held:
            where = "it is already part of the conversation previous_response_id continues"
            if given in {getattr(e, "id", None) for e in req.input[:i]}:
                where = "an earlier input item has it"
            raise InvalidParameterError(
                f"Duplicate item found with id '{given}': {where}; leave this one out.",
                param=f"input[{i}].id",
            )
        if isinstance(given, str):
            held.add(given)
        if not isinstance(entry, ItemReference):
            parsed.append(entry)
            if not _unsupported(entry):  # the others are refused by the conversion, naming input[i].type
                items.append(as_item(entry))
            continue
        stored = find(entry.id)
        if stored is None:
            raise InvalidParameterError(
                f"Item with id '{entry.id}' not found. item_reference names an item of a response stored "
                "on this server (in memory, the most recent ones, per API key, never with store: false).",
                param=f"input[{i}].id",
            )
        try:
            parsed.append(_INPUT_ITEM.validate_python(stored))
        except ValidationError:
            # Only an output item of a type this server does not take back could land here.
            raise InvalidParameterError(
                f"Item '{entry.id}' (type '{stored.get('type')}') cannot be used as input.",
                param=f"input[{i}].id",
            ) from None
        items.append(stored)
    return req.model_copy(update={"input": parsed}), tuple(items)


def _unsupported(entry: Any) -> bool:
    return not isinstance(entry, (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem))


def page(
    items: Sequence[Item],
    *,
    limit: int = DEFAULT_LIMIT,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    """OpenAI's cursor page of ``items`` (oldest first as stored): ``order`` ``desc`` (OpenAI's default)
    lists the newest first; ``after`` is the last item id of the previous page.

    Raises:
        InvalidParameterError: an ``after`` id that is not an item of this list.
    """
    ordered = list(items) if order == "asc" else list(reversed(items))
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise InvalidParameterError(
                f"Invalid value for 'after': no input item with id '{after}' in this response.", param="after"
            )
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }
