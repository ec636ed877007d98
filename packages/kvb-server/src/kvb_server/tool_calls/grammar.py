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

from kvb_cache.structured.backend import strict_schema
from kvb_server.tool_calls.spec import ToolPlan

#: Compact JSON (no optional whitespace), as for ``response_format``: small models loop on whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lark string literal


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """JSON schema of one call object: the name and arguments of any callable tool."""
    key = plan.syntax.args_key
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, key: strict_schema(tool.parameters)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for tool in plan.callable
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": _JSON_OPTIONS, **schema}


def _marker(plan: ToolPlan, marker_token: int | None) -> str:
    if not plan.syntax.marker:
        return ""
    # A special token is written by id (``<[id]>``): its text is not something a regex lexeme can produce.
    return f"<[{marker_token}]> " if marker_token is not None else f"{_literal(plan.syntax.marker)} "


def tool_grammar(
    plan: ToolPlan, *, marker_token: int | None = None, text_schema: dict[str, Any] | None = None
) -> str:
    """The grammar of ``plan``'s reply (``plan.mode`` is ``"calls"`` or ``"auto"``).

    Args:
        marker_token: the id of the syntax's marker when it is one special token.
        text_schema: in ``auto``, the JSON schema a text reply must match (``response_format``).
    """
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
        return "\n".join(["start: calls", *lines]) + "\n"
    if text_schema is not None:
        text_rule = f"text: %json {json.dumps({'x-guidance': _JSON_OPTIONS, **strict_schema(text_schema)})}"
        return "\n".join(["start: text | calls", *lines, text_rule]) + "\n"
    starts = "|".join(re.escape(t) for t in syntax.triggers)
    # Any text (the empty reply included) that does not begin like a call.
    text_rule = f"TEXT: /(?s:.*)/ & ~/\\s*({starts})(?s:.*)/"
    return "\n".join(["start: TEXT | calls", *lines, text_rule]) + "\n"
