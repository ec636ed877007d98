"""A pydantic :class:`ValidationError` as the one OpenAI-style 400 a client reads.

pydantic reports every branch of a union: ``"stop": ["a", ...]`` fails the string branch ("Input should be a
valid string") before the list branch says what is really wrong ("at most 64 items"). The error that explains
a failure is the one from a branch whose type the input matched, so type mismatches rank last.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvb_server.errors import InvalidParameterError


def _is_type_mismatch(error: Any) -> bool:
    # pydantic names type mismatches "<type>_type" (string_type, list_type, int_type, model_type, ...).
    return str(error.get("type", "")).endswith("_type")


def _is_field(part: str | int) -> bool:
    # Union branches appear in ``loc`` under their type's name ("str", "list[constrained-str]", "TextPart");
    # request fields are lower-case identifiers.
    return isinstance(part, int) or (
        part.isidentifier() and part[:1].islower() and part not in {"str", "int", "float", "bool", "list"}
    )


def field_path(loc: tuple[str | int, ...]) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``, without union branch names."""
    path = ""
    for part in loc:
        if not _is_field(part):
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def invalid_parameter(exc: ValidationError) -> InvalidParameterError:
    """The 400 for ``exc``: ``param`` is the top-level field, the message names the full path."""
    errors = exc.errors()
    first = next((e for e in errors if not _is_type_mismatch(e)), errors[0])
    loc = tuple(first.get("loc", ()))
    param = str(loc[0]) if loc else None
    where = field_path(loc) or param
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {where}"
    elif first.get("type") == "missing":
        message = f"Missing required parameter: '{where}'."
    else:
        message = f"Invalid value for '{where}': {first.get('msg')} (got {first.get('input')!r})."
    return InvalidParameterError(message, param=param)
