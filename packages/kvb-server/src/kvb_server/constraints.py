"""OpenAI's ``response_format`` and ``logit_bias``, checked, as the engine's sampling settings.

``response_format`` becomes a :class:`kvb_cache.structured.ResponseFormat` (decoding is constrained to it, so
the reply always parses); its grammar is compile-checked here, before the request is queued, so a schema
llguidance cannot handle is a 400 naming the parameter instead of an error after admission.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from kvb_cache.errors import InvalidRequestError
from kvb_cache.structured import ResponseFormat, StructuredOutputsUnavailable, check_grammar
from kvb_server.errors import InvalidParameterError, UnsupportedFeatureError

_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _bad(message: str, param: str) -> InvalidParameterError:
    return InvalidParameterError(message, param=param)


def json_schema_of(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a ``json_object`` / ``json_schema`` response_format asks for (None: not JSON)."""
    if raw is None:
        return None
    if raw.get("type") == "json_object":
        return _ANY_OBJECT
    if raw.get("type") == "json_schema":
        inner = raw.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        return schema if isinstance(schema, dict) else _ANY_OBJECT
    return None


def response_format(raw: dict[str, Any] | None, *, param: str = "response_format") -> ResponseFormat | None:
    """Validate OpenAI's ``response_format`` (plus kvboost's ``regex`` and ``grammar`` types).

    ``json_schema`` with ``strict: false`` is still enforced (OpenAI only tries then; an enforced schema is a
    subset of what it allows). A missing ``schema`` means any JSON object, as on OpenAI.
    """
    if raw is None:
        return None
    kind = raw.get("type")
    if kind not in _TYPES:
        raise _bad(
            f"Invalid value for '{param}.type': {kind!r}; expected one of {', '.join(map(repr, _TYPES))}.",
            f"{param}.type",
        )
    if kind == "json_schema":
        inner = raw.get("json_schema")
        if not isinstance(inner, dict):
            raise _bad(f"Missing required parameter: '{param}.json_schema'.", f"{param}.json_schema")
        name = inner.get("name")
        if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
            raise _bad(
                f"Invalid value for '{param}.json_schema.name': {name!r}; 1-64 letters, digits, '_' or '-'.",
                f"{param}.json_schema.name",
            )
        unknown = set(inner) - {"name", "schema", "strict", "description"}
        if unknown:
            raise _bad(
                f"Unrecognized field in '{param}.json_schema': {sorted(unknown)[0]}.", f"{param}.json_schema"
            )
        schema = inner.get("schema", _ANY_OBJECT)
        if not isinstance(schema, dict):
            raise _bad(
                f"Invalid value for '{param}.json_schema.schema': expected an object.",
                f"{param}.json_schema.schema",
            )
        raw = {"type": "json_schema", "json_schema": {"schema": schema}}
        param = f"{param}.json_schema.schema"
    try:
        fmt = ResponseFormat.parse(raw)
    except InvalidRequestError as exc:
        raise _bad(str(exc), param) from None
    if fmt is not None:
        check(fmt, param)
    return fmt


@functools.lru_cache(maxsize=1024)
def _grammar_error(fmt: ResponseFormat) -> str | None:
    """llguidance's verdict on ``fmt`` (None: valid), remembered: an agent loop sends the same tools and
    schemas on every call, and each check costs ~1 ms per schema on the event loop."""
    try:
        check_grammar(fmt)
    except InvalidRequestError as exc:
        return str(exc)
    return None


def check(fmt: ResponseFormat, param: str) -> None:
    """Compile-check a grammar; a 400 naming ``param`` when llguidance refuses it."""
    try:
        error = _grammar_error(fmt)
    except StructuredOutputsUnavailable as exc:
        raise UnsupportedFeatureError(
            f"{param}: structured outputs need the grammar library on the server ({exc}).", param=param
        ) from None
    if error is not None:
        raise _bad(error.replace("response_format", param, 1), param)


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """``{"<token id>": bias}`` as the engine's ``{token_id: bias}`` (ids past the vocabulary: the engine's
    400 at admission)."""
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not key.isdigit():
            raise _bad(
                f"Invalid value for 'logit_bias': keys are token ids (digits as strings), got {key!r}.",
                "logit_bias",
            )
        out[int(key)] = float(value)
    return out
