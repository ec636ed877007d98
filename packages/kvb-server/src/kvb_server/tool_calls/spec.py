"""OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, validated, as a :class:`ToolPlan`.

The plan carries the grammar that constrains the reply (:mod:`kvb_server.tool_calls.grammar`): with
``tool_choice="required"`` or a named function the reply *is* a valid call of the tools' argument schemas;
with ``"auto"`` it is either plain text or such calls; with ``"none"`` the tools stay in the prompt (the
same prefix as every other call of an agent loop, so it still hits the cache) and the reply is text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from kvb_server.errors import InvalidParameterError
from kvb_server.tool_calls.syntax import ToolSyntax

ChoiceMode = Literal["none", "auto", "calls"]

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: Most calls one reply may hold when ``parallel_tool_calls`` is on (a small model may otherwise repeat
#: calls until max_tokens); OpenAI sets no documented limit.
MAX_PARALLEL_CALLS = 8
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    """One function tool: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        """OpenAI's (and Hugging Face chat templates') ``{"type": "function", "function": {...}}`` form."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt and its reply.

    Attributes:
        tools: every declared tool (all go into the prompt, whatever ``tool_choice`` says).
        callable: the tools the reply may call (one for a named ``tool_choice``; none for ``"none"``).
        mode: ``"calls"`` (required / named: the reply is calls), ``"auto"`` (text or calls), ``"none"``.
        max_calls: most calls in one reply.
        syntax: how the model writes calls.
        named: ``tool_choice`` named the function: the reply is that call, and (as on OpenAI and vLLM) it
            finishes ``"stop"``, not ``"tool_calls"``, which says the model chose to call tools.
    """

    tools: tuple[Tool, ...]
    callable: tuple[Tool, ...]
    mode: ChoiceMode
    max_calls: int
    syntax: ToolSyntax
    named: bool = False

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def _bad(message: str, param: str) -> InvalidParameterError:
    return InvalidParameterError(message, param=param)


def parse_tools(raw: list[Any] | None) -> tuple[Tool, ...]:
    """Validate ``tools`` (400 naming ``tools[i]...`` for the first problem)."""
    tools: list[Tool] = []
    seen: set[str] = set()
    for i, item in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"Invalid value for '{where}': expected an object.", where)
        if item.get("type") != "function":
            raise _bad(
                f"Invalid value for '{where}.type': only 'function' tools are supported, got {item.get('type')!r}.",
                f"{where}.type",
            )
        unknown = set(item) - {"type", "function"}
        if unknown:
            raise _bad(f"Unrecognized field in '{where}': {sorted(unknown)[0]}.", where)
        function = item.get("function")
        if not isinstance(function, dict):
            raise _bad(f"Missing required parameter: '{where}.function'.", f"{where}.function")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(
                f"Unrecognized field in '{where}.function': {sorted(unknown)[0]}.", f"{where}.function"
            )
        name = function.get("name")
        if name is None:
            raise _bad(f"Missing required parameter: '{where}.function.name'.", f"{where}.function.name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad(
                f"Invalid value for '{where}.function.name': {name!r}; a function name is 1-64 letters, digits, "
                "underscores or dashes.",
                f"{where}.function.name",
            )
        if name in seen:
            raise _bad(f"Invalid value for 'tools': the function name {name!r} is declared twice.", "tools")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"Invalid value for '{where}.function.description': expected a string.", where)
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise _bad(
                f"Invalid value for '{where}.function.parameters': expected a JSON schema object.",
                f"{where}.function.parameters",
            )
        kind = parameters.get("type", "object")
        if kind != "object":
            # A call's arguments are named parameters: an object. OpenAI refuses other schemas; accepted, an
            # array schema made arguments "[1,2,3]", which the SDK's parsed arguments and agents cannot use.
            raise _bad(
                f"Invalid schema for function {name!r}: '{where}.function.parameters' must be a JSON schema of "
                f"type 'object', got type {kind!r}.",
                f"{where}.function.parameters",
            )
        if not parameters:
            # {} reads as "no parameters", as leaving it out does: as "any object" a small model invented
            # arguments until max_tokens.
            parameters = _EMPTY_PARAMETERS
        elif "type" not in parameters:  # e.g. {"properties": {...}}: constrained to an object all the same
            parameters = {"type": "object", **parameters}
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _bad(f"Invalid value for '{where}.function.strict': expected a boolean.", where)
        tools.append(Tool(name=name, description=description, parameters=parameters))
    return tuple(tools)


def _choice(raw: Any, tools: tuple[Tool, ...]) -> tuple[ChoiceMode, tuple[Tool, ...]]:
    if raw is None:
        return ("auto", tools) if tools else ("none", ())
    if raw == "none":
        return "none", ()
    if not tools:
        raise _bad(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified.",
            "tool_choice",
        )
    if raw == "auto":
        return "auto", tools
    if raw == "required":
        return "calls", tools
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            # {"type": "function", "name": ...} is the Responses API's shape: say what chat expects.
            raise _bad(
                "Invalid value for 'tool_choice.function': expected an object with the function's 'name' "
                '({"type": "function", "function": {"name": ...}}).',
                "tool_choice.function",
            )
        return "calls", (_declared(function["name"], tools, "tool_choice.function.name"),)
    if isinstance(raw, dict) and raw.get("type") == "allowed_tools":
        return _allowed(raw.get("allowed_tools"), tools)
    raise _bad(
        "Invalid value for 'tool_choice': expected 'none', 'auto', 'required', "
        '{"type": "function", "function": {"name": ...}} or '
        '{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [...]}}.',
        "tool_choice",
    )


def _declared(name: str, tools: tuple[Tool, ...], param: str) -> Tool:
    for tool in tools:
        if tool.name == name:
            return tool
    raise _bad(
        f"Invalid value for '{param}': no function named {name!r} in 'tools' "
        f"(declared: {', '.join(t.name for t in tools)}).",
        param,
    )


def _allowed(spec: Any, tools: tuple[Tool, ...]) -> tuple[ChoiceMode, tuple[Tool, ...]]:
    """OpenAI's ``allowed_tools`` choice: ``mode`` ``auto`` (text or a call) or ``required`` (calls) over a
    subset of ``tools``, all of which stay declared (so the prompt, and its cached prefix, do not change
    with the subset: why clients such as pydantic-ai send it)."""
    param = "tool_choice.allowed_tools"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
        raise _bad(
            f'Invalid value for \'{param}\': expected {{"mode": "auto" | "required", "tools": '
            '[{"type": "function", "function": {"name": ...}}, ...]}.',
            param,
        )
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise _bad(
            f"Invalid value for '{param}.tools': expected a non-empty list of functions.", f"{param}.tools"
        )
    subset: list[Tool] = []
    for i, entry in enumerate(listed):
        where = f"{param}.tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            entry = {}
        # Chat's shape, or the Responses API's ({"type": "function", "name": ...}).
        function = entry.get("function", entry)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise _bad(
                f'Invalid value for \'{where}\': expected {{"type": "function", "function": {{"name": ...}}}}.',
                where,
            )
        tool = _declared(name, tools, f"{where}.function.name")
        if tool not in subset:
            subset.append(tool)
    return ("auto" if spec["mode"] == "auto" else "calls"), tuple(subset)


def tool_plan(
    tools_raw: list[Any] | None, choice_raw: Any, parallel: bool | None, syntax: ToolSyntax
) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, or None when it declares no tools."""
    tools = parse_tools(tools_raw)
    mode, callable_ = _choice(choice_raw, tools)
    if not tools:
        return None
    # A named tool_choice forces one call of that function (as on OpenAI); otherwise parallel calls are on
    # unless the request turns them off.
    named = isinstance(choice_raw, dict) and choice_raw.get("type") == "function"
    max_calls = MAX_PARALLEL_CALLS if (parallel is None or parallel) and not named else 1
    if syntax.max_calls is not None:
        max_calls = min(max_calls, syntax.max_calls)
    return ToolPlan(
        tools=tools, callable=callable_, mode=mode, max_calls=max_calls, syntax=syntax, named=named
    )
