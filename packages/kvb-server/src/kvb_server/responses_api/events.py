"""Streamed chat-completion chunks translated into the Responses API's Server-Sent Events.

OpenAI's order for one response: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``, many
``response.output_text.delta``, ``response.output_text.done``, ``response.content_part.done``, and for a
function call many ``response.function_call_arguments.delta`` and ``response.function_call_arguments.done``,
and for a reasoning item (``--reasoning-parser``, before the others) ``response.content_part.added``, many
``response.reasoning_text.delta``, ``response.reasoning_text.done``, ``response.content_part.done``;
then ``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when generation
stopped at ``max_output_tokens``). Every event carries a ``sequence_number`` counting from 0. A failure after
the stream began is an ``error`` event followed by ``response.failed``. There is no ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvb_server.responses_api.build import (
    ResponseEnvelope,
    function_call_item,
    message_item,
    output_text,
    reasoning_item,
    reasoning_text,
    status_of,
    usage,
)
from kvb_server.responses_api.convert import new_id, responses_param

Event = dict[str, Any]


def sse(event: Event) -> bytes:
    """One event as SSE: its type on the ``event:`` line, the event (type included) as JSON ``data:``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class StreamEnd(NamedTuple):
    """How a stream that did not fail ends: the finished response object, and the events still to send
    (the open item's ``.done`` events, then ``response.completed`` or ``response.incomplete``)."""

    response: dict[str, Any]
    events: list[Event]


@dataclass(slots=True, kw_only=True)
class _OpenItem:
    """The output item being streamed: a message (``call_id`` None), a function call, or the reasoning
    (``reasoning``)."""

    id: str
    output_index: int
    reasoning: bool = False
    call_id: str | None = None
    name: str = ""
    chat_index: int | None = None
    text: list[str] = field(default_factory=list)
    #: A message's token logprobs sent so far (its ``output_text.done`` repeats them all).
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class StreamTranslator:
    """Turns one choice's chat chunks into Responses events; :meth:`final` is the finished response."""

    def __init__(self, envelope: ResponseEnvelope) -> None:
        self._envelope = envelope
        self._sequence = 0
        self._open: _OpenItem | None = None
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        #: Finished output items, in order.
        self.output: list[dict[str, Any]] = []
        #: Set once an error payload arrived: the stream has ended with ``response.failed``.
        self.failed = False
        #: Token logprobs received and not yet sent with a text delta (only when the request asked for them).
        self._logprobs: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[Event]:
        response = self._envelope.object("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(self, payload: dict[str, Any]) -> list[Event]:
        """Events for one chat chunk (or an error object, which ends the stream)."""
        if "error" in payload:
            return self._fail(payload["error"])
        if payload.get("usage"):
            self._usage = usage(payload["usage"])
        events: list[Event] = []
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            # A chunk's token logprobs go with its text; tokens whose text is still held back (a possible
            # stop string) arrive first, and wait for the text delta that carries them.
            self._logprobs += (choice.get("logprobs") or {}).get("content") or ()
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self._finish_reason = choice["finish_reason"]
                if self._open is None and not self.output:
                    events += self._open_message()  # nothing was generated: an empty message
                events += self._close()
        return events

    def final(self) -> StreamEnd:
        """The finished response and its last events (once the chat stream has ended without an error)."""
        events = self._close()
        status = status_of(self._finish_reason)
        response = self._envelope.object(status, self.output, usage=self._usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return StreamEnd(response=response, events=[*events, self._event(kind, response=response)])

    # -- items ----------------------------------------------------------------------------------------------
    def _open_message(self) -> list[Event]:
        item = self._open = _OpenItem(id=new_id("msg"), output_index=len(self.output))
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
        return [
            self._event(
                "response.output_item.added",
                output_index=item.output_index,
                item=message_item(item.id, "", "in_progress"),
            ),
            self._event("response.content_part.added", **where, part=output_text("")),
        ]

    def _reasoning(self, text: str) -> list[Event]:
        events = []
        if self._open is None or not self._open.reasoning:
            events = self._close()
            item = self._open = _OpenItem(id=new_id("rs"), output_index=len(self.output), reasoning=True)
            where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
            events += [
                self._event(
                    "response.output_item.added",
                    output_index=item.output_index,
                    item=reasoning_item(item.id, "", "in_progress"),
                ),
                self._event("response.content_part.added", **where, part=reasoning_text("")),
            ]
        item = self._open
        assert item is not None
        item.text.append(text)
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]

    def _text(self, text: str) -> list[Event]:
        events = []
        if self._open is None or self._open.call_id is not None or self._open.reasoning:
            events = self._close() + self._open_message()
        item = self._open
        assert item is not None
        item.text.append(text)
        sent, self._logprobs = self._logprobs, []
        item.logprobs += sent
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
        return [*events, self._event("response.output_text.delta", **where, delta=text, logprobs=sent)]

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        events = []
        fn = call.get("function") or {}
        item = self._open
        if item is None or item.call_id is None or item.chat_index != call.get("index"):
            events = self._close()
            item = self._open = _OpenItem(
                id=new_id("fc"),
                output_index=len(self.output),
                call_id=call.get("id") or new_id("call"),
                name=fn.get("name") or "",
                chat_index=call.get("index"),
            )
            events.append(
                self._event(
                    "response.output_item.added",
                    output_index=item.output_index,
                    item=function_call_item(item.id, item.call_id, item.name, "", "in_progress"),
                )
            )
        if fn.get("arguments"):
            item.text.append(fn["arguments"])
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.output_index,
                    delta=fn["arguments"],
                )
            )
        return events

    def _close(self) -> list[Event]:
        """Finish the open item (if any): its ``.done`` events, and it joins :attr:`output`."""
        item, self._open = self._open, None
        if item is None:
            return []
        status = status_of(self._finish_reason)
        text = "".join(item.text)
        if item.reasoning:
            done = reasoning_item(item.id, text, status)
            where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
            events = [
                self._event("response.reasoning_text.done", **where, text=text),
                self._event("response.content_part.done", **where, part=reasoning_text(text)),
            ]
        elif item.call_id is None:
            item.logprobs += self._logprobs  # tokens whose text never came (a trailing stop string's)
            self._logprobs = []
            done = message_item(item.id, text, status, item.logprobs)
            where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
            events = [
                self._event("response.output_text.done", **where, text=text, logprobs=item.logprobs),
                self._event("response.content_part.done", **where, part=output_text(text, item.logprobs)),
            ]
        else:
            done = function_call_item(item.id, item.call_id, item.name, text, status)
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.output_index,
                    arguments=text,
                )
            ]
        self.output.append(done)
        events.append(self._event("response.output_item.done", output_index=item.output_index, item=done))
        return events

    def _fail(self, error: dict[str, Any]) -> list[Event]:
        self.failed = True
        code = error.get("code") or error.get("type") or "server_error"
        # The item being streamed is closed, incomplete, before the failure (it was left open, and the
        # failed response's output left out what its deltas had sent: an audit, 2026-11-30).
        self._finish_reason = "length"
        closing = self._close()
        response = self._envelope.object(
            "failed",
            self.output,
            usage=self._usage,
            error={"code": _response_code(error), "message": error.get("message")},
        )
        return [
            *closing,
            self._event(
                "error", code=code, message=error.get("message"), param=responses_param(error.get("param"))
            ),
            self._event("response.failed", response=response),
        ]


def _response_code(error: dict[str, Any]) -> str:
    """A failed response's ``error.code``, one of the codes OpenAI's ``ResponseError`` allows (the SDK
    validates it): the chat error's own code (``timeout``) stays in the ``error`` event and the message."""
    kind = f"{error.get('code') or ''} {error.get('type') or ''}"
    if "rate_limit" in kind or "overloaded" in kind:
        return "rate_limit_exceeded"
    if "invalid_request" in kind or "context_length" in kind:
        return "invalid_prompt"
    return "server_error"
