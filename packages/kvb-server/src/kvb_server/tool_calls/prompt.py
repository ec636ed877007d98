"""Chat history with tools, as the chat template receives it.

Templates that render tools themselves (:attr:`ToolSyntax.native`) get Hugging Face's message shapes:
assistant ``tool_calls`` with ``arguments`` as a dict (templates ``tojson`` them) and ``tool`` messages
with ``tool_call_id`` and the function's ``name``. Other templates get plain text: the tool list and the
call format in the system prompt (:func:`tools_system_prompt`), earlier calls written back in that format,
and tool results as a user turn in ``<tool_response>`` tags.

A message the server cannot render is a 400 whose ``param`` is the full path of what is wrong
(``messages[1].tool_call_id``), as OpenAI names it and as the schema's own errors do.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from kvb_server.errors import InvalidParameterError
from kvb_server.limits import loads_inner
from kvb_server.tool_calls.history import check_tool_history
from kvb_server.tool_calls.spec import ToolPlan
from kvb_server.tool_calls.syntax import ToolSyntax


def tools_system_prompt(plan: ToolPlan) -> str:
    """The system-prompt text teaching a template without tool support our (Hermes-tag) call format."""
    listing = "\n".join(json.dumps(tool.definition(), ensure_ascii=False) for tool in plan.tools)
    return (
        "You can use the following tools. Each line describes one function and the JSON schema of its "
        f"arguments:\n<tools>\n{listing}\n</tools>\n\n"
        "To use a tool, reply with one block per call and nothing else, exactly like this:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
        "A tool's result comes back to you inside <tool_response></tool_response> tags. "
        "When no tool is needed, answer normally."
    )


def call_text(name: str, arguments: Any, syntax: ToolSyntax) -> str:
    """One call written in ``syntax`` (compact JSON, as the grammar makes the model write it)."""
    body = json.dumps({"name": name, syntax.args_key: arguments}, ensure_ascii=False, separators=(",", ":"))
    return f"{syntax.call_open}{body}{syntax.call_close}"


def _text(msg: Any, where: str) -> str:
    """A message's content as one string: text parts joined by newlines, as vLLM joins them (joined with
    nothing, a document part and a question part would run into one word).

    An assistant message's refusal (a ``refusal`` part, or OpenAI's ``refusal`` field) is what the assistant
    said in that turn, so it is rendered as its text, as ``/v1/responses`` renders refusal parts; other
    roles cannot refuse, so a refusal part there is a 400.
    """
    content, assistant = msg.content, msg.role == "assistant"
    texts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = getattr(part, "type", None)
        if kind == "refusal" and not assistant:
            raise InvalidParameterError(
                f"{where}.content[{j}]: 'refusal' parts are only allowed in assistant messages, not in "
                f"'{msg.role}' messages; send text parts or a string.",
                param=f"{where}.content[{j}].type",
            )
        if kind not in ("text", "refusal"):
            raise InvalidParameterError(
                f"{where}.content[{j}]: only text parts are supported, got type '{kind}'; send text parts "
                "or a string.",
                param=f"{where}.content[{j}].type",
            )
        value = getattr(part, kind, None)
        if value is None:
            raise InvalidParameterError(
                f"Missing required parameter: '{where}.content[{j}].{kind}'.",
                param=f"{where}.content[{j}].{kind}",
            )
        texts.append(value)
    if assistant and msg.refusal is not None:
        texts.append(msg.refusal)
    return "\n".join(texts)


def _tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as ``{"id", "name", "arguments": <parsed JSON>}``."""
    if not isinstance(raw, list):
        raise InvalidParameterError(
            f"Invalid value for '{where}.tool_calls': expected an array.", param=f"{where}.tool_calls"
        )
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidParameterError(
                f"Invalid value for '{at}': expected {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}.",
                param=at,
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = loads_inner(arguments) if arguments.strip() else {}
            except ValueError:
                raise InvalidParameterError(
                    f"Invalid value for '{at}.function.arguments': not valid JSON.",
                    param=f"{at}.function.arguments",
                ) from None
        calls.append({"id": str(call.get("id") or ""), "name": function["name"], "arguments": arguments})
    return calls


_SHORT_ID = re.compile(r"[A-Za-z0-9]{9}")


def template_id(call_id: str, syntax: ToolSyntax) -> str:
    """A tool-call id as the template takes it: Mistral's templates refuse anything but 9 alphanumerics,
    so another backend's id (OpenAI's ``call_<24>``, a conversation begun elsewhere) becomes 9 hex digits of
    its hash: the same for the call and its result, and a different one for each id."""
    if not syntax.short_ids or _SHORT_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def template_messages(
    messages: list[Any],
    syntax: ToolSyntax,
    plan: ToolPlan | None,
    *,
    system_role: bool = True,
    user_after_user: bool = True,
) -> list[dict[str, Any]]:
    """``messages`` (the request's :class:`~kvb_server.schemas.generation_requests.ChatMessage` list) for
    the chat template. ``system_role``: the template renders a system message; when it does not (Gemma's,
    Mistral v0.1's raise), the tools' prompt of a template without tools goes before the first user
    message's text instead of into a system message of its own. ``user_after_user``: the template renders
    two user turns in a row; when it does not (Gemma's "roles must alternate"), tool results written as a
    user turn go before the text of a user message that follows them, in that message's turn."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for templates that print it
    pending_results: list[str] = []

    def results_text() -> str:
        body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in pending_results)
        pending_results.clear()
        return body

    def flush_results() -> None:
        if pending_results:
            out.append({"role": "user", "content": results_text()})

    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.role == "function":
            raise InvalidParameterError(
                f"{where}: 'function' messages (the deprecated function calling) are not supported; use 'tool'.",
                param=f"{where}.role",
            )
        # As on OpenAI, only an assistant turn that made calls or refused may leave its content out; any
        # other message without it would be rendered as an empty turn the client never meant to send.
        if msg.content is None and not (
            msg.role == "assistant" and (msg.tool_calls or msg.refusal is not None)
        ):
            raise InvalidParameterError(
                f"Missing required parameter: '{where}.content'"
                + (
                    " (an assistant message needs content, tool_calls or a refusal)."
                    if msg.role == "assistant"
                    else "."
                ),
                param=f"{where}.content",
            )
        content = _text(msg, where)
        if msg.role == "tool":
            call_id = msg.tool_call_id
            if not isinstance(call_id, str):
                raise InvalidParameterError(
                    f"Missing required parameter: '{where}.tool_call_id'.", param=f"{where}.tool_call_id"
                )
            if syntax.native:
                message = {"role": "tool", "content": content, "tool_call_id": template_id(call_id, syntax)}
                if call_id in names:
                    message["name"] = names[call_id]
                out.append(message)
            else:
                pending_results.append(content)
            continue
        if msg.role == "user" and pending_results and not user_after_user:
            content = f"{results_text()}\n\n{content}" if content else results_text()
        flush_results()
        if msg.role == "assistant" and msg.tool_calls:
            calls = _tool_calls(msg.tool_calls, where)
            names.update({c["id"]: c["name"] for c in calls})
            if syntax.native:
                out.append(
                    {
                        "role": "assistant",
                        "content": content,
                        **_reasoning(msg, where),
                        "tool_calls": [
                            {
                                "id": template_id(c["id"], syntax),
                                "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]},
                            }
                            for c in calls
                        ],
                    }
                )
            else:
                written = syntax.separator.join(call_text(c["name"], c["arguments"], syntax) for c in calls)
                out.append(
                    {
                        "role": "assistant",
                        "content": f"{content}\n{written}" if content else written,
                        **_reasoning(msg, where),
                    }
                )
            continue
        # Chat templates know "system"; OpenAI's newer "developer" role means the same to an open model.
        message = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
        if msg.role == "assistant":
            message.update(_reasoning(msg, where))
        out.append(message)
    flush_results()
    check_tool_history(messages)  # after each message's own fields were checked (those errors name them)
    if plan is not None and not syntax.native:
        prompt = tools_system_prompt(plan)
        if out and out[0]["role"] == "system":
            out[0] = {
                **out[0],
                "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt,
            }
        else:
            first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
            if system_role or first_user is None:
                out.insert(0, {"role": "system", "content": prompt})
            else:
                # The request sent no system message; a template that refuses one ("System role not
                # supported") refused the request for a message the server added.
                said = out[first_user]["content"]
                out[first_user] = {**out[first_user], "content": f"{prompt}\n\n{said}" if said else prompt}
    return out


def _reasoning(msg: Any, where: str) -> dict[str, str]:
    """An assistant turn's thinking (``reasoning``, vLLM's field, or ``reasoning_content``, DeepSeek's) under
    both names, for templates that render it again (Qwen3's reads ``reasoning_content``); none: nothing."""
    extra = msg.model_extra or {}
    for name in ("reasoning", "reasoning_content"):
        value = extra.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidParameterError(
                f"{where}.{name} must be a string, got {type(value).__name__}.", param=f"{where}.{name}"
            )
        return {"reasoning": value, "reasoning_content": value}
    return {}
