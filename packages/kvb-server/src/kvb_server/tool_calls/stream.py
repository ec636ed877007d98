"""Streamed tool calls: turn a reply's text deltas into OpenAI's chat deltas.

OpenAI streams a call as one delta naming it (``{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}``) followed by deltas carrying pieces of ``arguments`` (``{"index", "function":
{"arguments": "..."}}``); text replies stream as ``content``. In ``auto`` mode the reply's first characters
decide: while they could still be the start of a call nothing is sent, then either content or calls. Text
held back that never became a call (the reply ended first) is sent as content when the reply ends.
"""

from __future__ import annotations

from typing import Any

from kvb_server.tool_calls.ids import new_call_id
from kvb_server.tool_calls.parse import PartialCall, scan_calls, split_reply
from kvb_server.tool_calls.spec import ToolPlan


class ToolCallStream:
    """One choice's streamed reply under ``plan`` (``mode`` ``"auto"`` or ``"calls"``)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._syntax = plan.syntax
        self._text = ""
        #: "content" or "calls" once decided.
        self._kind: str | None = "calls" if plan.mode == "calls" else None
        self._content_sent = 0
        #: Per streamed call: its id and how much of its arguments were sent.
        self._sent: list[tuple[str, int]] = []
        self._opened = False
        self._forced = plan.mode == "calls"
        self._names = tuple(tool.name for tool in plan.callable)

    def _decide(self) -> None:
        head = self._text.lstrip()
        if not head:
            return
        triggers = self._syntax.triggers
        if any(head.startswith(t) for t in triggers):
            self._kind = "calls"
        elif not any(t.startswith(head) for t in triggers):
            self._kind = "content"

    def push(self, text: str) -> list[dict[str, Any]]:
        """The chat deltas for ``text``, the reply's next piece (possibly none yet)."""
        self._text += text
        if self._kind is None:
            self._decide()
        if self._kind == "content":
            return self._content()
        if self._kind == "calls":
            return self._calls()
        return []

    def deltas(
        self, text: str, *, final: bool, force: bool = False, truncated: bool = False
    ) -> list[dict[str, Any]]:
        """The chat deltas to send for ``text`` (and, when ``final``, what was held back), the first one of
        the reply carrying ``role`` as OpenAI's does (with ``content: null`` when it opens a call).

        ``force``: send at least one (possibly empty) delta, e.g. to carry logprobs; a final call always
        sends at least the opening one. ``truncated``: the reply ended at ``max_tokens``.
        """
        out = self.push(text) if text else []
        if final:
            out += self.finish(truncated=truncated)
        if not out and (force or (final and not self._opened)):
            out = [{}]
        if out and not self._opened:
            self._opened = True
            first = out[0]
            out[0] = (
                {"role": "assistant", "content": None, **first}
                if "tool_calls" in first
                else {"role": "assistant", **first}
            )
        return out

    def finish(self, *, truncated: bool = False) -> list[dict[str, Any]]:
        """Deltas still held back when the reply ends: an undecided start is text after all, and so is a
        reply that never got as far as a call's name (a stop string cut it inside ``<tool_call>``, say),
        since the non-streamed reply returns that text as ``content`` and a stream must end with everything
        its non-streamed twin returns. Under a forced ``tool_choice`` a reply ``max_tokens`` cut there is
        the call the callable tools' names leave possible, or nothing (as the non-streamed reply:
        :func:`kvb_server.tool_calls.parse.split_reply`), never the call syntax as text."""
        if self._kind is None:
            self._kind = "content"
        if self._kind == "calls":
            deltas = self._calls()
            if deltas or self._sent:
                # Call deltas were sent: they cannot be taken back, so a call cut short stays a partial call.
                return deltas
            if truncated and self._forced:
                # The non-streamed reading of the same text, so that the two always agree.
                reply = split_reply(self._text, self._syntax, truncated=True, forced=True, names=self._names)
                if reply.content is None:
                    return self._call_deltas(list(reply.calls))
            self._kind = "content"
        return self._content()

    def _content(self) -> list[dict[str, Any]]:
        piece = self._text[self._content_sent :]
        self._content_sent = len(self._text)
        return [{"content": piece}] if piece else []

    def _calls(self) -> list[dict[str, Any]]:
        calls, _ = scan_calls(self._text, self._syntax)
        return self._call_deltas(calls)

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index == len(self._sent):
                call_id = new_call_id(self._syntax)
                self._sent.append((call_id, 0))
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call_id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            call_id, sent = self._sent[index]
            if len(call.arguments) > sent:
                deltas.append(
                    {"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent:]}}]}
                )
                self._sent[index] = (call_id, len(call.arguments))
        return deltas
