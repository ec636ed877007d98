"""The Lark grammar (llguidance dialect) a tool-calling reply is constrained to.

Calls: ``marker? [ call (sep call){0,max-1} ]`` where each call is the syntax's tags around a JSON object
``{"name": <one of the callable tools>, "<args_key>": <that tool's argument schema>}`` (llguidance's
``%json`` embeds a JSON schema in the grammar). ``auto`` adds an alternative: plain text that does not start
like a call (``&`` / ``~`` are llguidance's regex intersection and negation), or, with a JSON
``response_format``, that schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvb_cache.structured.backend import llguidance_schema
from kvb_cache.structured.schema_compat import DATA_KEYWORDS, SCHEMA_MAPS
from kvb_server.reasoning import ReasoningPlan
from kvb_server.tool_calls.spec import ToolPlan

#: Compact JSON (no optional whitespace), as for ``response_format``: small models loop on whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lark string literal


def _pointer_token(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")  # RFC 6901


def rebase_refs(schema: Any, prefix: str) -> Any:
    """``schema`` with each local ``$ref`` (``#``, ``#/$defs/User``) pointing under ``prefix``.

    A tool's parameters are embedded in the call schema at ``prefix`` (``/properties/arguments``), so
    their ``$ref``s, written against the parameters as the document root (pydantic's ``$defs``), would
    otherwise resolve against the call schema and fail to compile.
    """
    if isinstance(schema, list):
        return [rebase_refs(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + prefix + value[1:]
        elif key in DATA_KEYWORDS:  # data: a "$ref" key inside is not a reference
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            # Names, not keywords: a property called "examples" or "default" is a schema to walk (it was
            # copied as data, so its $ref kept pointing at the document root and the tool was refused).
            out[key] = {name: rebase_refs(sub, prefix) for name, sub in value.items()}
        else:
            out[key] = rebase_refs(value, prefix)
    return out


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """JSON schema of one call object: the name and arguments of any callable tool."""
    key = plan.syntax.args_key
    many = len(plan.callable) > 1
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                key: rebase_refs(
                    llguidance_schema(tool.parameters),
                    (f"/anyOf/{i}" if many else "") + f"/properties/{_pointer_token(key)}",
                ),
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for i, tool in enumerate(plan.callable)
    ]
    schema: dict[str, Any] = {"anyOf": options} if many else options[0]
    return {"x-guidance": _JSON_OPTIONS, **schema}


def _marker(plan: ToolPlan, marker_token: int | None) -> str:
    if not plan.syntax.marker:
        return ""
    # A special token is written by id (``<[id]>``): its text is not something a regex lexeme can produce.
    return f"<[{marker_token}]> " if marker_token is not None else f"{_literal(plan.syntax.marker)} "


def _thinking(thinking: ReasoningPlan) -> str:
    """One lexeme for a reasoning model's thinking block and the blank space after it: everything up to the
    first end tag (a lexeme so that the lexer, which is greedy, ends it at that tag, not past it)."""
    start, end = (re.escape(t).replace("/", "\\/") for t in (thinking.syntax.start, thinking.syntax.end))
    opening = "" if thinking.opened else start
    return f"THINK: /{opening}(?s:.*){end}\\s*/ & ~/{opening}(?s:.*){end}(?s:.*){end}(?s:.*)/"


def json_after_thinking(schema_source: str, thinking: ReasoningPlan) -> str:
    """The grammar of a JSON reply (a ``json_schema`` response format's ``schema_source``) that a reasoning
    model may think before (must, when the prompt opened the block): as vLLM starts the structured-output
    grammar once the thinking ends."""
    schema = {"x-guidance": _JSON_OPTIONS, **llguidance_schema(json.loads(schema_source))}
    return _grammar(f"%json {json.dumps(schema)}", "", thinking)


def _grammar(start: str, rules: str, thinking: ReasoningPlan | None) -> str:
    """A Lark grammar whose reply is ``start`` (a rule body; ``rules``: the rules it uses, each line ending
    with a newline), after a thinking block when ``thinking`` is given (required when the prompt opened it)."""
    if thinking is None:
        return f"start: {start}\n{rules}"
    think = "THINK" if thinking.opened else "THINK?"
    return f"start: {think} reply\nreply: {start}\n{rules}{_thinking(thinking)}\n"


def tool_grammar(
    plan: ToolPlan,
    *,
    marker_token: int | None = None,
    text_schema: dict[str, Any] | None = None,
    thinking: ReasoningPlan | None = None,
) -> str:
    """The grammar of ``plan``'s reply (``plan.mode`` is ``"calls"`` or ``"auto"``).

    Args:
        marker_token: the id of the syntax's marker when it is one special token.
        text_schema: in ``auto``, the JSON schema a text reply must match (``response_format``).
        thinking: a reasoning model's thinking block may come first (``--reasoning-parser``); it must when
            the prompt opened it.
    """
    # A text reply must not open a thinking block either: text may follow anything, so a block read as
    # text would let an unchecked call follow it.
    opens = (thinking.syntax.start,) if thinking is not None and not thinking.opened else ()
    start, rules = _tool_rules(plan, marker_token=marker_token, text_schema=text_schema, not_first=opens)
    return _grammar(start, rules, thinking)


def _tool_rules(
    plan: ToolPlan,
    *,
    marker_token: int | None = None,
    text_schema: dict[str, Any] | None = None,
    not_first: tuple[str, ...] = (),
) -> tuple[str, str]:
    """The reply's start rule body and the rules it uses (``not_first``: more openings a text reply must
    not begin with)."""
    syntax = plan.syntax
    call = f"{_literal(syntax.call_open)} obj {_literal(syntax.call_close)}" if syntax.call_open else "obj"
    sep = f"{_literal(syntax.separator)} " if syntax.separator else ""
    more = f"({sep}call){{0,{plan.max_calls - 1}}}" if plan.max_calls > 1 else ""
    body = f"call {more}".strip()
    if syntax.bracket:
        body = f'"[" {body} "]"'
    lines = [
        f"calls: {_marker(plan, marker_token)}{body}",
        f"call: {call}",
        f"obj: %json {json.dumps(call_schema(plan))}",
    ]
    if plan.mode == "calls":
        return "calls", "\n".join(lines) + "\n"
    if text_schema is not None:
        text_rule = (
            f"text: %json {json.dumps({'x-guidance': _JSON_OPTIONS, **llguidance_schema(text_schema)})}"
        )
        return "text | calls", "\n".join([*lines, text_rule]) + "\n"
    starts = "|".join(re.escape(t).replace("/", "\\/") for t in (*syntax.triggers, *not_first))
    # Any text (the empty reply included) that does not begin like a call.
    text_rule = f"TEXT: /(?s:.*)/ & ~/\\s*({starts})(?s:.*)/"
    return "TEXT | calls", "\n".join([*lines, text_rule]) + "\n"
