"""A pydantic :class:`ValidationError` as the one OpenAI-style 400 a client reads.

pydantic reports every branch of a union: ``"stop": ["a", ...]`` fails the string branch ("Input should be a
valid string") before the list branch says what is really wrong ("at most 64 items"). The error that explains
a failure is the one from a branch whose type the input matched, so type mismatches rank last.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Discriminator, Tag, ValidationError
from pydantic.fields import FieldInfo

from kvb_server.errors import InvalidParameterError

_TEMPLATE = (
    "messages are rendered with the server's chat template (the model's, or the one the server was started "
    "with by --chat-template); to render them otherwise, send the prompt text to /v1/completions (POST "
    "/tokenize with messages shows this server's rendering)"
)
#: vLLM's request extras this server does not take, with what to do instead: an unknown field stays a 400
#: (never silently ignored), and for these the message names the fix.
VLLM_EXTRAS: dict[str, str] = {
    "chat_template": _TEMPLATE,
    "documents": _TEMPLATE,
    "use_beam_search": "beam search is not supported; sample several choices with 'n'",
    "length_penalty": "beam search is not supported; sample several choices with 'n'",
    "request_id": "the server assigns response ids",
    "guided_decoding_backend": "the server picks the grammar library",
    "guided_whitespace_pattern": "JSON is always written compact (no whitespace between its tokens); leave it out",
    "echo": "echo is a /v1/completions option (chat: continue_final_message continues the last message)",
    "best_of": "best_of is a /v1/completions option; sample several choices with 'n'",
}


def _is_type_mismatch(error: Any) -> bool:
    # pydantic names type mismatches "<type>_type" (string_type, list_type, int_type, model_type, ...).
    return str(error.get("type", "")).endswith("_type")


def _is_field(part: str | int) -> bool:
    # Without the model to walk, a guess: union branches appear in ``loc`` under their type's name ("str",
    # "list[constrained-str]", "TextPart"); request fields are lower-case identifiers.
    return isinstance(part, int) or (
        part.isidentifier() and part[:1].islower() and part not in {"str", "int", "float", "bool", "list"}
    )


def _unwrap(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``tp`` without its ``Annotated`` layers, and their metadata."""
    meta: tuple[Any, ...] = ()
    while get_origin(tp) is Annotated:
        tp, *extra = get_args(tp)
        meta += tuple(extra)
    return tp, meta


def _discriminator(meta: tuple[Any, ...]) -> str | Discriminator | None:
    for item in meta:
        if isinstance(item, Discriminator):
            return item
        if isinstance(item, FieldInfo) and item.discriminator is not None:
            return item.discriminator
    return None


def _model(tp: Any) -> type[BaseModel] | None:
    inner = _unwrap(tp)[0]
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


#: pydantic's names of a smart union's members by kind (``"constrained-str"``, ``"list[TextPart]"``, ...).
_KIND_NAMES: dict[str, tuple[Any, ...]] = {
    "list": (list, Sequence),
    "tuple": (tuple,),
    "dict": (dict,),
    "str": (str,),
    "int": (int,),
    "float": (float,),
    "bool": (bool,),
    "literal": (Literal,),
}


def _branch(members: list[Any], label: str | int, discriminator: str | Discriminator | None) -> Any | None:
    """The member of a union that pydantic names ``label`` in an error's ``loc``: a discriminated union
    names it by its tag (a :class:`Tag`, or the value of its discriminator field), a smart union by its
    type (a model's class name, ``"str"``, ``"constrained-str"``, ``"list[...]"``, ``"tagged-union[...]"``).
    None when no member fits (the rest of the path is then guessed)."""
    if not isinstance(label, str):
        return None
    for member in members:
        inner, meta = _unwrap(member)
        if any(isinstance(m, Tag) and m.tag == label for m in meta):
            return member
        model = _model(inner)
        if model is not None:
            field = model.model_fields.get(discriminator) if isinstance(discriminator, str) else None
            if field is not None and label in get_args(field.annotation):
                return member
            if model.__name__ == label:
                return member
    kind = label.split("[", 1)[0].removeprefix("constrained-")
    for member in members:
        inner = _unwrap(member)[0]
        if kind == "tagged-union" and _is_union(inner):
            return member
        origins = _KIND_NAMES.get(kind, ())
        if inner in origins or get_origin(inner) in origins:
            return member
    return None


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _field(model: type[BaseModel], name: str | int) -> FieldInfo | None:
    """The field ``loc`` calls ``name`` (its alias when it has one, as pydantic reports it)."""
    for field_name, field in model.model_fields.items():
        if (field.alias or field_name) == name:
            return field
    return None


def _walk(tp: Any, loc: tuple[str | int, ...]) -> list[str | int]:
    """The parts of ``loc`` that name fields and indexes, found by following ``loc`` through the type
    ``tp``: the union branch names and discriminator tags pydantic inserts are left out."""
    kept: list[str | int] = []
    discriminator: str | Discriminator | None = None
    i = 0
    while i < len(loc):
        part = loc[i]
        tp, meta = _unwrap(tp)
        discriminator = _discriminator(meta) or discriminator
        if _is_union(tp):
            members = [m for m in get_args(tp) if m is not type(None)]
            if len(members) > 1:  # pydantic names the member it tried (X | None is one nullable X: no name)
                branch = _branch(members, part, discriminator)
                if branch is None:
                    break
                i += 1
            else:
                branch = members[0]
            tp, discriminator = branch, None
            continue
        discriminator = None
        model = _model(tp)
        origin = get_origin(tp)
        if model is not None:
            field = _field(model, part)
            if field is None:  # an unknown field (extra_forbidden) is named by itself
                kept.append(part)
                i += 1
                break
            kept.append(part)
            tp, discriminator = field.annotation, field.discriminator
        elif origin in (list, tuple, Sequence) and isinstance(part, int):
            kept.append(part)
            tp = (get_args(tp) or (Any,))[0]
        elif origin is dict:
            # A key is the client's data, not a parameter's name: the path ends at the mapping.
            return kept
        else:
            break
        i += 1
    return kept + [p for p in loc[i:] if _is_field(p)]


def field_path(loc: tuple[str | int, ...], model: type[BaseModel] | None = None) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``, without pydantic's union branch names and
    discriminator tags (``("text", "format", "json_schema", "name")`` is ``text.format.name``): followed
    through ``model``'s types when given, else guessed by :func:`_is_field`."""
    parts = _walk(model, loc) if model is not None else [p for p in loc if _is_field(p)]
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _rank(error: Any, model: type[BaseModel] | None) -> tuple[bool, int]:
    """Which of a union's errors explains the failure (the smallest first; ties keep pydantic's order): a
    value error before a type mismatch, and among type mismatches the deepest one. ``"stop": [1, 2]`` fails
    the string branch at ``stop`` and the list branch at ``stop[0]``: the list branch matched the input's
    type, so ``stop[0]`` is what is wrong."""
    if not _is_type_mismatch(error):
        return (False, 0)
    loc = tuple(error.get("loc", ()))
    depth = len(_walk(model, loc)) if model is not None else sum(map(_is_field, loc))
    return (True, -depth)


def invalid_parameter(exc: ValidationError, model: type[BaseModel] | None = None) -> InvalidParameterError:
    """The 400 for ``exc`` (raised validating ``model``): ``param`` and the message name the full path,
    as OpenAI's do (``text.format.name``, ``messages[0].content``)."""
    errors = exc.errors()
    first = min(errors, key=lambda e: _rank(e, model))
    loc = tuple(first.get("loc", ()))
    param = field_path(loc, model) or (str(loc[0]) if loc else None)
    where = param
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {where}"
        if where in VLLM_EXTRAS:
            message += f" (vLLM's; not supported by this server: {VLLM_EXTRAS[where]})."
    elif first.get("type") == "missing":
        message = f"Missing required parameter: '{where}'."
    else:
        message = f"Invalid value for '{where}': {first.get('msg')} (got {_shown(first.get('input'))})."
    return InvalidParameterError(message, param=param)


#: Most characters of a refused value an error message repeats (a 70-item stop list, a 4 MiB string were
#: echoed whole).
SHOWN_CHARS = 200


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
