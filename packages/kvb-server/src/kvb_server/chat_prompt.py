"""A chat request's prompt and reply constraint: its messages rendered by the model's chat template (tool
definitions, calls and results included) and what its reply is constrained to (the tools' call grammar, else
``response_format``)."""

from __future__ import annotations

import json
from typing import Any

import jinja2

from kvb_cache.chat import render_chat as render_template
from kvb_cache.chat_content import template_source
from kvb_cache.errors import InvalidRequestError
from kvb_cache.structured import ResponseFormat
from kvb_server import constraints
from kvb_server.engine import ServingEngine
from kvb_server.errors import InvalidParameterError
from kvb_server.reasoning import ReasoningPlan
from kvb_server.schemas.generation_requests import ChatCompletionRequest
from kvb_server.tag_tokens import grammar_tags
from kvb_server.tool_calls import ToolPlan, ToolSyntax, template_messages, tool_grammar
from kvb_server.tool_calls.grammar import json_after_thinking


def chat_messages(
    req: ChatCompletionRequest, syntax: ToolSyntax, engine: ServingEngine, tools: ToolPlan | None = None
) -> list[dict[str, Any]]:
    """Messages as ``engine``'s chat template expects them (tool calls and results included; see
    :func:`kvb_server.tool_calls.template_messages`), with what the template refuses probed once:
    :func:`accepts_system`, :func:`repeats_user`."""
    return template_messages(
        req.messages, syntax, tools, system_role=accepts_system(engine), user_after_user=repeats_user(engine)
    )


#: Chat template source -> whether it renders a system message (probed once per template).
_SYSTEM_ROLE: dict[str, bool] = {}
_USER = {"role": "user", "content": "b"}
_SYSTEM = {"role": "system", "content": "a"}


def accepts_system(engine: ServingEngine) -> bool:
    """Whether the model's chat template renders a system message before a user one (Gemma's and Mistral
    v0.1's refuse with ``raise_exception``). Probed once per template; a tokenizer without a template, or
    a probe that fails for another reason, counts as accepting (the request's own rendering says why)."""
    tokenizer = engine.tokenizer
    source = template_source(tokenizer)
    if not source or not hasattr(tokenizer, "apply_chat_template"):
        return True
    if source not in _SYSTEM_ROLE:
        # Refuses: renders a user message alone, not after a system one (a template that fails on both,
        # needing a chat_template_kwargs variable say, is not answering this question).
        _SYSTEM_ROLE[source] = not (
            _renders(tokenizer, [_USER]) and not _renders(tokenizer, [_SYSTEM, _USER])
        )
    return _SYSTEM_ROLE[source]


#: Chat template source -> whether it renders two user messages in a row (probed once per template).
_USER_AFTER_USER: dict[str, bool] = {}


def repeats_user(engine: ServingEngine) -> bool:
    """Whether the model's chat template renders a user message right after another (Gemma's and Mistral's
    raise "roles must alternate"). Tool results of a template without a tool syntax become a user turn, so
    on such a template a user message after them was refused for a turn the server wrote. Probed once per
    template, as :func:`accepts_system`."""
    tokenizer = engine.tokenizer
    source = template_source(tokenizer)
    if not source or not hasattr(tokenizer, "apply_chat_template"):
        return True
    if source not in _USER_AFTER_USER:
        _USER_AFTER_USER[source] = not (
            _renders(tokenizer, [_USER]) and not _renders(tokenizer, [_USER, _USER])
        )
    return _USER_AFTER_USER[source]


def _renders(tokenizer: Any, messages: list[dict[str, Any]]) -> bool:
    try:
        render_template(tokenizer, messages)
    except Exception:  # whatever the template raised: it did not render these
        return False
    return True


def check_tool_schemas(tools: ToolPlan | None) -> None:
    """Each tool's ``parameters`` must be a schema the grammar library handles: a 400 naming the tool.

    Compiled as the call grammar embeds them (``llguidance_schema``: zod's always-true spellings
    rewritten), so a schema is refused only for what the grammar could not enforce."""
    for i, tool in enumerate(tools.tools if tools is not None else ()):
        param = f"tools[{i}].function.parameters"
        try:
            source = json.dumps(tool.parameters, allow_nan=False)
        except ValueError as e:  # NaN / Infinity, which the body's JSON parser accepts: was a 500
            raise InvalidParameterError(f"{param} is not a valid JSON schema ({e})", param=param) from None
        constraints.check(ResponseFormat(kind="json_schema", source=source), param)


def reply_format(
    requested: tuple[dict[str, Any] | None, ResponseFormat | None],
    tools: ToolPlan | None,
    engine: ServingEngine,
    syntax: ToolSyntax,
    thinking: ReasoningPlan | None = None,
) -> ResponseFormat | None:
    """What the reply is constrained to: the tools' call grammar (after a thinking block, with
    ``thinking``), else the ``requested`` format (:func:`kvb_server.constraints.requested_format`:
    ``response_format`` or vLLM's guided-decoding fields)."""
    raw, fmt = requested
    if tools is None or tools.mode == "none":
        if thinking is not None and fmt is not None and fmt.kind == "json_schema":
            thought_then_json = ResponseFormat(
                kind="grammar",
                source=json_after_thinking(
                    fmt.source, thinking, tag_tokens=grammar_tags(engine, None, thinking)
                ),
            )
            constraints.check(thought_then_json, "response_format")
            return thought_then_json
        return fmt
    text_schema = None
    if tools.mode == "auto" and fmt is not None:
        text_schema = constraints.json_schema_of(raw)
        if text_schema is None:
            raise InvalidParameterError(
                "response_format: only json_object and json_schema combine with tools (tool_choice 'auto').",
                param="response_format",
            )
    grammar = tool_grammar(
        tools,
        tag_tokens=grammar_tags(engine, syntax, thinking),
        text_schema=text_schema,
        thinking=thinking,
    )
    tool_format = ResponseFormat(kind="grammar", source=grammar)
    constraints.check(tool_format, "tools")
    return tool_format


def template_options(
    tools: ToolPlan | None,
    *,
    add_generation_prompt: bool | None,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    content_format: str,
) -> dict[str, Any]:
    """``engine.chat_prompt``'s keywords for a request (the chat route and ``/tokenize`` alike): vLLM's
    template options, each passed only when it differs from the protocol's default (an engine may not take
    them all), and the tools' definitions for a native tool syntax. ``add_generation_prompt`` None: not sent.
    """
    options: dict[str, Any] = {}
    if add_generation_prompt is not None:
        options["add_generation_prompt"] = add_generation_prompt
    if continue_final_message:
        options["continue_final_message"] = True
        options.setdefault("add_generation_prompt", False)  # vLLM's rule: continuing implies no new turn
    if chat_template_kwargs:
        options["chat_template_kwargs"] = chat_template_kwargs
    if tools is not None and tools.syntax.native and tools.tools:
        options["tools"] = [t.definition() for t in tools.tools]
    if content_format != "auto":
        options["content_format"] = content_format
    return options


def render_chat(
    engine: ServingEngine,
    messages: list[dict[str, Any]],
    tools: ToolPlan | None,
    req: ChatCompletionRequest,
    content_format: str = "auto",
) -> list[int]:
    """The prompt's token ids: ``messages`` through the model's chat template, with the tools' definitions
    (native tool syntaxes), the request's template options and ``--chat-template-content-format``; a 400
    when the template refuses them."""
    options = template_options(
        tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
        content_format=content_format,
    )
    try:
        ids = engine.chat_prompt(messages, **options)
    except jinja2.TemplateError as exc:  # the template refused the conversation (its raise_exception)
        raise InvalidParameterError(
            f"The chat template refused these messages: {exc}", param="messages"
        ) from None
    except InvalidRequestError as exc:  # the engine's checks of those options
        raise InvalidParameterError(str(exc), param=exc.param or "messages") from None
    if not ids:  # e.g. Phi-3-mini's template drops system messages: a system-only chat renders nothing
        raise InvalidParameterError(
            "The chat template rendered these messages to an empty prompt (0 tokens): it leaves out every "
            "message sent (some templates drop system messages); send a user message.",
            param="messages",
        )
    return ids
