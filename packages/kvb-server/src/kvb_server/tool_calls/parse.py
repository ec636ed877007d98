"""Reading tool calls out of a reply: complete ones (a finished reply) and partial ones (a stream so far).

The reply was decoded under the grammar of :mod:`kvb_server.tool_calls.grammar`, so a call is always
``{"name": "<tool>", "<args_key>": {...}}`` with the name first; the scanner only has to find the name and
the extent of the arguments object, which it does with a string-aware brace counter, so partial text
(a stream cut mid-string) is read as far as it goes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from kvb_server.limits import loads_inner
from kvb_server.tool_calls.syntax import ToolSyntax

ScanState = Literal["done", "partial", "bad"]
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True, slots=True)
class PartialCall:
    """One call as far as the text goes: ``arguments`` is the raw JSON text of the arguments so far."""

    name: str
    arguments: str
    complete: bool


def _json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array starting at ``start``; None when the text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _skip(text: str, i: int, chars: str = " \t\r\n") -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _expect(text: str, i: int, token: str) -> tuple[int, ScanState | None]:
    """Skip whitespace and ``token``: ``(index after, None)`` when found, else ``(i, "partial")`` when the
    text ends inside it or ``(i, "bad")`` when something else follows."""
    i = _skip(text, i)
    rest = text[i : i + len(token)]
    if rest == token:
        return i + len(token), None
    return i, "partial" if token.startswith(rest) and i + len(rest) == len(text) else "bad"


#: A tool name as OpenAI allows it (``mistral_v11`` writes it bare, before ``[ARGS]``).
_NAME = re.compile(r"[A-Za-z0-9_.-]*")


def _without_tag_start(text: str, tags: tuple[str, ...]) -> str:
    """``text`` without its end when that end is the beginning of one of ``tags`` (``"get_weather[AR"``)."""
    for cut in range(len(text)):
        rest = text[cut:]
        if any(tag and tag.startswith(rest) for tag in tags):
            return text[:cut]
    return text


def _scan_tagged(text: str, syntax: ToolSyntax) -> tuple[list[PartialCall], ScanState]:
    """:func:`scan_calls` for ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` calls (``mistral_v11``)."""
    calls: list[PartialCall] = []
    i = _skip(text, 0)
    while True:
        if calls:
            i = _skip(text, i)
            if i == len(text):
                return calls, "done"
        i, state = _expect(text, i, syntax.marker)
        if state:
            return calls, state
        end = text.find(syntax.args_tag, i)
        head = text[i:] if end < 0 else text[i:end]
        if end < 0:  # the text may end inside a tag: what could still become one is not the name
            head = _without_tag_start(head, (syntax.args_tag, syntax.call_id_tag))
        name = head.split(syntax.call_id_tag)[0] if syntax.call_id_tag else head
        if not _NAME.fullmatch(name) or (end >= 0 and not name):
            return calls, "bad"
        if end < 0:  # the name (or its id) so far, or the arguments tag cut in the middle
            return calls, "partial"
        start = _skip(text, end + len(syntax.args_tag))
        if start == len(text):
            calls.append(PartialCall(name, "", False))
            return calls, "partial"
        if text[start] != "{":
            return calls, "bad"
        stop = _json_end(text, start)
        calls.append(PartialCall(name, text[start:] if stop is None else text[start:stop], stop is not None))
        if stop is None:
            return calls, "partial"
        i = stop


def scan_calls(text: str, syntax: ToolSyntax) -> tuple[list[PartialCall], ScanState]:
    """The calls in ``text`` so far.

    Returns:
        ``(calls, state)``: ``"done"`` when the text is exactly well-formed complete calls, ``"partial"``
        when it ends inside one (the last call may be in ``calls`` with ``complete=False``, or not yet have
        a whole name), ``"bad"`` when it departs from the syntax (``calls`` are those before).
    """
    if syntax.args_tag:
        return _scan_tagged(text, syntax)
    calls: list[PartialCall] = []
    i = _skip(text, 0)
    optional = syntax.optional_marker
    if optional:
        if text.startswith(optional, i):
            i = _skip(text, i + len(optional))
        elif text[i:] and optional.startswith(text[i:]):
            return calls, "partial"
    if syntax.marker:
        if text.startswith(syntax.marker, i):
            i += len(syntax.marker)
        elif text[i:] and syntax.marker.startswith(text[i:]):
            return calls, "partial"
    if syntax.bracket:
        i, state = _expect(text, i, "[")
        if state:
            return calls, state
    while True:
        if calls:
            if syntax.bracket:
                j, state = _expect(text, i, "]")
                if state is None:
                    return calls, "done" if _skip(text, j) == len(text) else "bad"
            j = _skip(text, i, " \t\r\n,;")
            if j == len(text):
                return calls, "partial" if syntax.bracket else "done"
            if j == i and not syntax.call_open:
                return calls, "bad"
            i = j
        if syntax.call_open:
            i, state = _expect(text, i, syntax.call_open.strip())
            if state:
                return calls, state
        i = _skip(text, i)
        head = _HEAD.match(text, i)
        if head is None:
            # Not a whole head yet (the grammar guarantees one follows; a finished reply without it is text).
            return calls, "partial" if not text[i:] or text[i] == "{" else "bad"
        name = json.loads(f'"{head.group(1)}"')
        start = head.end()
        end = _json_end(text, start)
        if end is None:
            calls.append(PartialCall(name, text[start:], False))
            return calls, "partial"
        i, state = _expect(text, end, "}")
        calls.append(PartialCall(name, text[start:end], state is None))
        if state:
            return calls, state
        if syntax.call_close:
            i, state = _expect(text, i, syntax.call_close.strip())
            if state:
                return calls, state
        if _skip(text, i) == len(text) and not syntax.bracket:
            return calls, "done"


@dataclass(frozen=True, slots=True)
class ToolCallText:
    """A finished reply split into its text and its calls (``content`` is None when it is only calls)."""

    content: str | None
    calls: tuple[PartialCall, ...]


#: A call's name as far as it was written (``closed``: its closing quote too, so it is the whole name).
_NAME_SO_FAR = re.compile(r'"name"\s*:\s*"(?P<name>[^"\\]*)(?P<closed>")?')


def cut_before_name(
    text: str, names: tuple[str, ...], syntax: ToolSyntax | None = None
) -> PartialCall | None:
    """The call a forced reply (``tool_choice`` required or named) was writing when ``max_tokens`` cut it
    before its arguments began (inside ``<tool_call>``, say, ``{"name": "get_wea`` or ``{"name": "get",``):
    the one callable tool (``names``) the reply's name so far allows (a whole name: that tool; part of one:
    the tools whose names start with it), with no arguments yet; None when more than one could still
    follow (the grammar admits only those names)."""
    if syntax is not None and syntax.args_tag:  # the bare name after the marker (mistral_v11)
        after = text.rpartition(syntax.marker)[2] if syntax.marker in text else ""
        head = _without_tag_start(after, (syntax.args_tag, syntax.call_id_tag))
        prefix = head.split(syntax.call_id_tag)[0] if syntax.call_id_tag else head
        if head != after or (syntax.call_id_tag and syntax.call_id_tag in head):  # a tag followed the name
            return PartialCall(prefix, "", False) if prefix in names else None
    else:
        written = _NAME_SO_FAR.search(text)
        prefix = written.group("name") if written else ""
        if written and written.group("closed"):  # the name is whole ({"name":"get",): only that tool
            return PartialCall(prefix, "", False) if prefix in names else None
    matching = [name for name in names if name.startswith(prefix)]
    return PartialCall(matching[0], "", False) if len(matching) == 1 else None


def split_reply(
    text: str,
    syntax: ToolSyntax,
    *,
    truncated: bool = False,
    forced: bool = False,
    names: tuple[str, ...] = (),
) -> ToolCallText:
    """Read a finished reply: all complete calls whose arguments are valid JSON, else it is plain text.

    ``truncated``: the reply was cut by ``max_tokens``; its complete calls still count, and the finish
    reason stays ``"length"`` so the client knows. A partial last one is dropped, unless ``forced``: the
    request's ``tool_choice`` required calls (``"required"``, a named function), so the reply can only be
    calls, and the cut call is kept with the arguments written so far (possibly incomplete JSON), as the
    stream already sent them and OpenAI returns it; read as text, the call syntax itself reached clients
    (agents took the markup for the final answer). A forced reply cut before its first call's name was
    complete is that call when the callable tools' ``names`` leave one possible (:func:`cut_before_name`),
    else no content and no call: never the call syntax as text.
    """
    stripped = text.strip()
    starts_like_call = any(stripped.startswith(t) for t in syntax.triggers)
    if truncated and forced and not stripped:  # cut before the call began (a reasoning model's thinking)
        return ToolCallText(None, ())
    if not starts_like_call and not (truncated and forced):
        return ToolCallText(text, ())
    calls, state = scan_calls(text, syntax)
    if truncated and forced and not calls and state == "partial":
        # Under a forced choice the grammar admits only calls, so any text is the start of one (a tag cut
        # in the middle, "<tool_", does not even start like a call yet).
        call = cut_before_name(text, names, syntax)
        return ToolCallText(None, (call,) if call else ())
    if truncated and state == "partial":
        calls = calls if forced else [c for c in calls if c.complete]
    elif state != "done":
        return ToolCallText(text, ())
    if not calls:
        return ToolCallText(text, ())
    try:
        for call in calls:
            if call.complete:
                loads_inner(call.arguments)
    except ValueError:
        return ToolCallText(text, ())
    return ToolCallText(None, tuple(calls))
