"""Rendering chat messages with the tokenizer's own chat template (``KVBoost.chat_prompt``)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvb_cache.chat_content import check_content_format, fit_content, template_source
from kvb_cache.chat_content import content_format as detect_content_format
from kvb_cache.errors import InvalidRequestError, PromptTypeError, check_utf8


def _apply_chat_template_arguments() -> frozenset[str]:
    """The named parameters of the installed transformers' ``apply_chat_template`` (``self`` included)."""
    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


#: ``apply_chat_template`` arguments that are not template variables: passing them through
#: ``chat_template_kwargs`` would change what the call returns or bypass the checks here. Read from the
#: installed signature too: transformers 5.2x added ``sanitize_control_tokens``, which a hand-written list
#: missed, so a request could switch how control tokens in user text are encoded (and ``self`` was a
#: TypeError 400 naming the messages).
RESERVED_TEMPLATE_KWARGS = _apply_chat_template_arguments() | frozenset(
    {
        "self",
        "sanitize_control_tokens",  # transformers 5.2x's; listed so older versions refuse it too
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def check_template_kwargs(kwargs: object) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables (a dict of names to JSON-like values)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError(
            "chat_template_kwargs must be a dict of template variable names to values",
            param="chat_template_kwargs",
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may only set template variables; {', '.join(reserved)} "
            "are arguments of their own (send them as request fields, where supported)",
            param="chat_template_kwargs",
        )
    return dict(kwargs)


def check_messages(messages: object) -> None:
    """Raise :class:`PromptTypeError` unless ``messages`` is a list of dicts whose ``role`` is a string.

    The template itself would fail on anything else with an untyped TypeError/AttributeError from inside
    transformers or jinja (``None`` is not iterable, a bare string has no ``items``, an int role cannot be
    concatenated), which names neither the argument nor the fix.
    """
    if not isinstance(messages, (list, tuple)):
        raise PromptTypeError(
            f'messages must be a list of {{"role": ..., "content": ...}} dicts, got {type(messages).__name__}',
            param="messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptTypeError(
                f'messages[{i}] must be a {{"role": ..., "content": ...}} dict, got {type(message).__name__}',
                param="messages",
            )
        if "role" in message and not isinstance(message["role"], str):
            raise PromptTypeError(
                f"messages[{i}]['role'] must be a string such as 'user', got {message['role']!r}",
                param="messages",
            )
        content = message.get("content")
        parts = content if isinstance(content, (list, tuple)) else [content]
        for part in parts:  # a text or a text part's; an unpaired surrogate failed inside the tokenizer
            text = part.get("text") if isinstance(part, Mapping) else part
            if isinstance(text, str):
                check_utf8(text, "messages")


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    content_format: str = "auto",
) -> list[int]:
    """Token ids of ``messages`` rendered by ``tokenizer``'s chat template (see ``KVBoost.chat_prompt``)."""
    check_content_format(content_format)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this tokenizer has no chat template; send a plain prompt", param="messages"
        )
    extra = check_template_kwargs(chat_template_kwargs)
    check_messages(messages)
    # "false" is truthy: the generation prompt was added anyway.
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequestError(
            f"add_generation_prompt must be a bool, got {add_generation_prompt!r}",
            param="add_generation_prompt",
        )
    # transformers also takes a string here: the field of the final message to continue ("reasoning_content").
    if not isinstance(continue_final_message, (bool, str)):
        raise InvalidRequestError(
            "continue_final_message must be a bool (or the name of the final message's field to continue), "
            f"got {continue_final_message!r}",
            param="continue_final_message",
        )
    if tools is not None:
        if not isinstance(tools, (list, tuple)):
            raise InvalidRequestError(
                f"tools must be a list of tool dicts (OpenAI's function schema) or functions, got {type(tools).__name__}",
                param="tools",
            )
        for i, tool in enumerate(tools):  # a function is read as a JSON schema by transformers
            if not (isinstance(tool, Mapping) or callable(tool)):
                raise InvalidRequestError(
                    f"tools[{i}] must be a tool dict (OpenAI's function schema) or a function, got {type(tool).__name__}",
                    param="tools",
                )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message continues the last message, so add_generation_prompt must be false",
            param="continue_final_message",
        )
    # Each content in the shape the template reads (a string, or a list of text parts): chat_content.py.
    # ("auto": read from the template's source; "string" / "openai": as the caller says, vLLM's flag).
    if content_format == "auto":
        content_format = detect_content_format(template_source(tokenizer, tools=bool(tools)))
    messages = fit_content(messages, content_format)  # type: ignore[arg-type]
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            tools=tools or None,
            **extra,
        )
    except Exception as exc:
        # A template's own raise_exception() ("roles must alternate"; jinja2's TemplateError, matched by
        # module so that jinja2 stays transformers' optional import), a final message that cannot be
        # continued (ValueError), or the template's code failing on a message's shape (a TypeError such as
        # "can only concatenate str (not "dict") to str", an AttributeError, a missing key): the request's
        # fault, not the server's, and untyped it named neither the argument nor the fix.
        if not isinstance(exc, (ValueError, TypeError, AttributeError, LookupError)) and not type(
            exc
        ).__module__.startswith("jinja2"):
            raise
        if extra and _renders_without_extra(
            tokenizer, messages, add_generation_prompt, continue_final_message, tools
        ):
            # The messages render alone: the template variables broke it ({"namespace": None}, say).
            raise InvalidRequestError(
                f"the chat template failed with these chat_template_kwargs: {exc}",
                param="chat_template_kwargs",
            ) from None
        raise InvalidRequestError(
            f"the chat template refused these messages: {exc}", param="messages"
        ) from None
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _renders_without_extra(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool | str,
    tools: Any,
) -> bool:
    """Whether ``messages`` render with no ``chat_template_kwargs`` (asked only once rendering with them
    failed, to say which of the two the template refused)."""
    try:
        tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            tools=tools or None,
        )
    except Exception:  # whatever it raised: the messages themselves are refused too
        return False
    return True
