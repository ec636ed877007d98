"""The Lark grammar (llguidance dialect) a tool-calling reply is constrained to.

Calls: ``marker? [ call (sep call){0,max-1} ]`` where each call is the syntax's tags around a JSON object
``{"name": <one of the callable tools>, "<args_key>": <that tool's argument schema>}`` (llguidance's
``%json`` embeds a JSON schema in the grammar). ``auto`` adds an alternative: plain text that does not start
like a call (``&`` / ``~`` are llguidance's regex intersection and negation), or, with a JSON
``response_format``, that schema.

A tag that the tokenizer holds as one added token (Qwen's ``<tool_call>``, a reasoning model's
``</think>``, Mistral's ``[TOOL_CALLS]``) is written by its id (``<[id]>``): llguidance reads every added
token as a special token, whose text a string literal or regex never matches, so a literal tag would leave
the model to spell it byte by byte, which it was never trained to do (and llguidance's mask, which allowed
the token, disagreed with its parser, which refused it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kvb_cache.structured.backend import llguidance_schema
from kvb_cache.structured.schema_compat import DATA_KEYWORDS, JSON_OPTIONS, SCHEMA_MAPS
from kvb_server.reasoning import ReasoningPlan
from kvb_server.tool_calls.spec import ToolPlan


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
    return {"x-guidance": JSON_OPTIONS, **schema}


def _piece(text: str, tags: Mapping[str, int]) -> str:
    """``text`` as grammar items: a literal, or, where its stripped text is a tag held as one token (``tags``:
    tag text -> id), that token by id between literals of the whitespace around it."""
    tag = text.strip()
    if tag not in tags:
        return _literal(text)
    head, tail = text[: text.index(tag)], text[text.index(tag) + len(tag) :]
    return " ".join(
        [*([_literal(head)] if head else []), f"<[{tags[tag]}]>", *([_literal(tail)] if tail else [])]
    )


def _marker(plan: ToolPlan, tags: Mapping[str, int]) -> str:
    """The marker before the calls (and an optional space after it: Mistral v0.3's template writes
    ``[TOOL_CALLS] [``, Nemo's ``[TOOL_CALLS][``); an optional marker only when it is one token (its text
    spelled out is nothing a model writes)."""
    syntax = plan.syntax
    optional = syntax.optional_marker.strip()
    head = f"{_piece(optional, tags)}? " if optional in tags else ""
    return head + (f'{_piece(syntax.marker, tags)} " "? ' if syntax.marker else "")


def _regex(text: str) -> str:
    return re.escape(text).replace("/", "\\/")


def _thinking(thinking: ReasoningPlan, tags: Mapping[str, int]) -> tuple[str, str]:
    """The thinking block's grammar item and its rules (each line ending with a newline).

    Tags that are text: one lexeme for the block and the blank space after it, everything up to the first
    end tag (a lexeme so that the lexer, which is greedy, ends it at that tag, not past it). An end tag held
    as one token: a rule, the text before it (which cannot hold that token, nor the tag spelled out) then
    the token and the blank space after it."""
    start, end = thinking.syntax.start.strip(), thinking.syntax.end.strip()
    # The blank after the block: a few ASCII whitespace characters (Qwen3 and R1 write "\n\n"), bounded
    # because a small model offered unbounded space loops on it (a random one on Unicode spaces) until
    # max_tokens, as it does in JSON (``JSON_OPTIONS``).
    space = "[ \\t\\r\\n]{0,8}"
    if end not in tags:
        opening = "" if thinking.opened or start in tags else _regex(start)
        lexeme = f"THINK: /{opening}(?s:.*){_regex(end)}{space}/ & ~/{opening}(?s:.*){_regex(end)}(?s:.*){_regex(end)}(?s:.*)/\n"
        if thinking.opened or start not in tags:
            return "THINK", lexeme
        return "think", f"think: {_piece(start, tags)} THINK\n{lexeme}"
    opening = "" if thinking.opened else f"{_piece(start, tags)} "
    return "think", (
        f"think: {opening}THINK_TEXT {_piece(end, tags)} THINK_SPACE\n"
        f"THINK_TEXT: /(?s:.*)/ & ~/(?s:.*){_regex(end)}(?s:.*)/\n"
        f"THINK_SPACE: /{space}/\n"
    )


def json_after_thinking(
    schema_source: str, thinking: ReasoningPlan, *, tag_tokens: Mapping[str, int] | None = None
) -> str:
    """The grammar of a JSON reply (a ``json_schema`` response format's ``schema_source``) that a reasoning
    model may think before (must, when the prompt opened the block): as vLLM starts the structured-output
    grammar once the thinking ends. ``tag_tokens``: the tags held as one token (tag text -> id)."""
    schema = {"x-guidance": JSON_OPTIONS, **llguidance_schema(json.loads(schema_source))}
    return _grammar(f"%json {json.dumps(schema)}", "", thinking, tag_tokens or {})


def _grammar(
    start: str, rules: str, thinking: ReasoningPlan | None, tags: Mapping[str, int], after: str | None = None
) -> str:
    """A Lark grammar whose reply is ``start`` (a rule body; ``rules``: the rules it uses, each line ending
    with a newline), after a thinking block when ``thinking`` is given (required when the prompt opened it);
    ``after``: the reply's body after a thinking block, when it differs."""
    if thinking is None:
        return f"start: {start}\n{rules}"
    name, think_rules = _thinking(thinking, tags)
    if after is not None:
        direct = "" if thinking.opened else " | reply"
        return (
            f"start: {name} reply_after{direct}\nreply: {start}\nreply_after: {after}\n{rules}{think_rules}"
        )
    optional = "" if thinking.opened else "?"
    return f"start: {name}{optional} reply\nreply: {start}\n{rules}{think_rules}"


def tool_grammar(
    plan: ToolPlan,
    *,
    tag_tokens: Mapping[str, int] | None = None,
    text_schema: dict[str, Any] | None = None,
    thinking: ReasoningPlan | None = None,
) -> str:
    """The grammar of ``plan``'s reply (``plan.mode`` is ``"calls"`` or ``"auto"``).

    Args:
        tag_tokens: the syntax's and the thinking block's tags that the tokenizer holds as one added token
            (tag text -> id; :func:`kvb_server.tag_tokens.tag_tokens`), written by id.
        text_schema: in ``auto``, the JSON schema a text reply must match (``response_format``).
        thinking: a reasoning model's thinking block may come first (``--reasoning-parser``); it must when
            the prompt opened it.
    """
    # A text reply must not open a thinking block either: text may follow anything, so a block read as
    # text would let an unchecked call follow it.
    opens = (thinking.syntax.start,) if thinking is not None and not thinking.opened else ()
    tags = tag_tokens or {}
    start, rules = _tool_rules(plan, tags=tags, text_schema=text_schema, not_first=opens)
    after = None
    if thinking is not None and thinking.syntax.end.strip() in tags and "TEXT" in start.split(" | "):
        # After a block closed by its token, its blank (THINK_SPACE) and a text reply both begin with a
        # blank, and the greedy lexer gave "\n\n" to TEXT, which then refused the call after it: no call
        # could follow "</think>\n\n" in auto (a review). There a text reply begins with anything else.
        starts = "|".join(_regex(t) for t in (*plan.syntax.triggers, *opens))
        rules += f"TEXT_AFTER: /([^ \\t\\r\\n](?s:.*))?/ & ~/\\s*({starts})(?s:.*)/\n"
        after = start.replace("TEXT", "TEXT_AFTER")
    return _grammar(start, rules, thinking, tags, after)


def _tool_rules(
    plan: ToolPlan,
    *,
    tags: Mapping[str, int],
    text_schema: dict[str, Any] | None = None,
    not_first: tuple[str, ...] = (),
) -> tuple[str, str]:
    """The reply's start rule body and the rules it uses (``not_first``: more openings a text reply must
    not begin with)."""
    syntax = plan.syntax
    if syntax.args_tag:
        lines = _tagged_call_rules(plan, tags)
    else:
        lines = _object_call_rules(plan, tags)
    if plan.mode == "calls":
        return "calls", "\n".join(lines) + "\n"
    if text_schema is not None:
        text_rule = (
            f"text: %json {json.dumps({'x-guidance': JSON_OPTIONS, **llguidance_schema(text_schema)})}"
        )
        return "text | calls", "\n".join([*lines, text_rule]) + "\n"
    starts = "|".join(_regex(t) for t in (*syntax.triggers, *not_first))
    # Any text (the empty reply included) that does not begin like a call.
    text_rule = f"TEXT: /(?s:.*)/ & ~/\\s*({starts})(?s:.*)/"
    return "TEXT | calls", "\n".join([*lines, text_rule]) + "\n"


def _tagged_call_rules(plan: ToolPlan, tags: Mapping[str, int]) -> list[str]:
    """``calls`` for a syntax whose name is outside the JSON (``mistral_v11``): per call the marker, one
    callable tool's name, an optional call id, the arguments tag, then that tool's arguments."""
    syntax = plan.syntax
    call_id = ""
    if syntax.call_id_tag.strip() in tags:  # a model that writes ids writes the tag as its one token
        call_id = f"({_piece(syntax.call_id_tag, tags)} /[A-Za-z0-9]{{9}}/)? "
    args = _piece(syntax.args_tag, tags)
    lines = [
        f"calls: call{{1,{plan.max_calls}}}",
        f"call: {_piece(syntax.marker, tags)} ("
        + " | ".join(f"{_literal(tool.name)} {call_id}{args} args{i}" for i, tool in enumerate(plan.callable))
        + ")",
    ]
    for i, tool in enumerate(plan.callable):
        schema = {"x-guidance": JSON_OPTIONS, **llguidance_schema(tool.parameters)}
        lines.append(f"args{i}: %json {json.dumps(schema)}")
    return lines


def _object_call_rules(plan: ToolPlan, tags: Mapping[str, int]) -> list[str]:
    """``calls`` for a syntax whose calls are ``{"name": ..., "<args_key>": {...}}`` objects."""
    syntax = plan.syntax
    call = (
        f"{_piece(syntax.call_open, tags)} obj {_piece(syntax.call_close, tags)}"
        if syntax.call_open
        else "obj"
    )
    sep = f"{_literal(syntax.separator)} " if syntax.separator else ""
    more = f"({sep}call){{0,{plan.max_calls - 1}}}" if plan.max_calls > 1 else ""
    body = f"call {more}".strip()
    if syntax.bracket:
        body = f'"[" {body} "]"'
    return [
        f"calls: {_marker(plan, tags)}{body}",
        f"call: {call}",
        f"obj: %json {json.dumps(call_schema(plan))}",
    ]
