"""A message's ``content`` in the shape the chat template reads: one string, or OpenAI's list of parts.

Most templates print ``message['content']`` as a string; some (SmolVLM / Idefics3, Llama 3.2 Vision,
Qwen2-VL and other multimodal families) loop over it as a list of ``{"type": "text", "text": ...}`` parts.
Handed the other shape, a template fails (``'str object' has no attribute 'text'``; ``can only
concatenate str (not "list") to str``) or, worse, renders a wrong prompt without a word: a loop over a
string's characters finds no ``type`` and prints nothing, so the user's text vanished from the prompt.
So, as vLLM's ``--chat-template-content-format auto`` does, the template's source is read once: a template
that loops over a message's content (or indexes it by position) gets parts, any other gets a string.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from kvb_cache.errors import InvalidRequestError

ContentFormat = Literal["string", "openai"]
#: What a caller may ask for (vLLM's ``--chat-template-content-format``): ``auto`` reads the template.
CONTENT_FORMATS = ("auto", "string", "openai")


def check_content_format(value: object, param: str = "content_format") -> None:
    """Raise :class:`~kvb_cache.errors.InvalidRequestError` unless ``value`` is one of
    :data:`CONTENT_FORMATS`."""
    if value not in CONTENT_FORMATS:
        raise InvalidRequestError(
            f"{param} must be one of {', '.join(CONTENT_FORMATS)}, got {value!r}", param=param
        )


def _is_content(node: Any, jinja_nodes: Any) -> bool:
    """``x['content']`` or ``x.content``."""
    if isinstance(node, jinja_nodes.Getattr):
        return node.attr == "content"
    return (
        isinstance(node, jinja_nodes.Getitem)
        and isinstance(node.arg, jinja_nodes.Const)
        and node.arg.value == "content"
    )


@functools.lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """``"openai"`` when ``template`` (a chat template's jinja source) loops over a message's content or
    takes an item of it by position (``message['content'][0]['text']``), else ``"string"``; a template
    jinja cannot parse is left to fail as it will (``"string"``)."""
    try:
        import jinja2.nodes as jinja_nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # transformers renders templates with jinja2; without it nothing renders anyway
        return "string"
    try:
        # NOTE: parsed in the environment apply_chat_template renders in (transformers' private compile
        # function, cached there): a plain jinja2 Environment refuses {% break %} and {% generation %},
        # which Hub templates use, and such a template read as "string" lost the user's text again.
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:  # a template that does not compile fails as it will when rendered
        return "string"
    for loop in tree.find_all(jinja_nodes.For):
        if _is_content(loop.iter, jinja_nodes):
            return "openai"
    for item in tree.find_all(jinja_nodes.Getitem):
        if (
            _is_content(item.node, jinja_nodes)
            and isinstance(item.arg, jinja_nodes.Const)
            and isinstance(item.arg.value, int)
        ):
            return "openai"
    return "string"


def template_source(tokenizer: Any, *, tools: bool = False) -> str:
    """The chat template source ``apply_chat_template`` renders with: of named templates, ``tool_use``
    when ``tools`` are given and it has one, else ``default``; "" when there is none."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        name = "tool_use" if tools and "tool_use" in template else "default"
        template = template.get(name)
    return template if isinstance(template, str) else ""


def _text_parts(content: Sequence[Any]) -> list[str] | None:
    """The texts of ``content`` when every part is a text part, else None."""
    texts = []
    for part in content:
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            return None
        texts.append(part["text"])
    return texts


def fit_content(messages: Sequence[Mapping[str, Any]], fmt: ContentFormat) -> list[dict[str, Any]]:
    """``messages`` with each content in ``fmt``'s shape: for ``"openai"`` a string becomes one text part
    and a missing content (an assistant turn that only made tool calls) no parts; for ``"string"`` a list
    of text parts becomes their texts joined by newlines (as vLLM joins them). Anything else (an image
    part, a dict) is left as given, for the template to take or refuse."""
    out = []
    for message in messages:
        content = message.get("content")
        if fmt == "openai" and (isinstance(content, str) or content is None):
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else []
            message = {**message, "content": parts}
        elif fmt == "string" and isinstance(content, (list, tuple)):
            texts = _text_parts(content)
            if texts is not None:
                message = {**message, "content": "\n".join(texts)}
        out.append(dict(message))
    return out
