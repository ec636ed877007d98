"""vLLM's ``--chat-template``: a Jinja chat template, from a file or given inline, that replaces the
tokenizer's own for every route that renders chat messages.

The value is read as vLLM's ``load_chat_template`` reads it: a file that can be opened is the template; a
value that cannot be opened but holds ``{``, ``}`` or a newline is the template text itself; anything else
looks like a path, and is refused naming it. The template is compiled once before the model loads, so a
syntax error is a usage error instead of a 400 on every chat request.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

#: A value that cannot be opened as a file is an inline template when it holds one of these (vLLM's rule).
JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text ``--chat-template value`` names, checked to compile as transformers compiles it.

    Raises:
        ValueError: a path that cannot be read, a file that is empty or not UTF-8, or a template that is
            not valid Jinja (names the path, or ``inline``, and the line).
    """
    if not value.strip():
        raise ValueError("--chat-template is empty; pass a Jinja template file, or the template text itself")
    try:
        text = Path(value).read_text(encoding="utf-8")
        source = value
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {value!r}: the file is not UTF-8 text") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the value, which no path holds
        if not any(c in value for c in JINJA_CHARS):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(
                f"--chat-template {value!r}: cannot read the file ({reason}); pass a Jinja template file, "
                "or the template text itself"
            ) from None
        text, source = value, "(inline)"
    if not text.strip():
        raise ValueError(f"--chat-template {source}: the template is empty")
    check_compiles(text, source)
    return text


def check_compiles(text: str, source: str) -> None:
    """Compile ``text`` in the environment ``apply_chat_template`` renders it in.

    Raises:
        ValueError: the template is not valid Jinja (names ``source`` and the line).
    """
    # NOTE: transformers' own (private) compile function, not a plain jinja2 Environment: its sandbox
    # enables loopcontrols ({% break %}) and the {% generation %} tag that Hub templates use, so a template
    # apply_chat_template accepts is never refused here.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(
            f"--chat-template {source}: not a valid Jinja template: {exc.message} (line {exc.lineno})"
        ) from None
    except jinja2.TemplateError as exc:
        raise ValueError(f"--chat-template {source}: not a valid Jinja template: {exc}") from None
