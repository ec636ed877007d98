"""OpenAI's ``response_format`` and ``logit_bias``, checked, as the engine's sampling settings.

vLLM's own ways to ask for the same constraints are accepted too: the ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields and (vLLM >= 0.10) ``structured_outputs`` with ``json``,
``regex``, ``choice``, ``grammar`` or ``json_object`` (:func:`requested_format`).

``response_format`` becomes a :class:`kvb_cache.structured.ResponseFormat` (decoding is constrained to it, so
the reply always parses); its grammar is compile-checked here, before the request is queued, so a schema
llguidance cannot handle is a 400 naming the parameter instead of an error after admission.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from kvb_cache.errors import InvalidRequestError
from kvb_cache.structured import ResponseFormat, StructuredOutputsUnavailable, check_grammar
from kvb_server.errors import InvalidParameterError, UnsupportedFeatureError
from kvb_server.limits import loads_inner

_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "structural_tag")
#: The fields each ``response_format`` type takes (the others are refused, never ignored).
_TYPE_FIELDS = {
    "text": {"type"},
    "json_object": {"type"},
    "json_schema": {"type", "json_schema"},
    "regex": {"type", "pattern"},
    "grammar": {"type", "grammar"},
    "structural_tag": {"type", "structures", "triggers"},  # vLLM's (xgrammar's first form)
}
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
    """Validate OpenAI's ``response_format`` (plus kvboost's ``regex`` and ``grammar`` types and vLLM's
    ``structural_tag``).

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
    # NOTE: a field another type takes, or none does, was ignored: {"type": "json_object", "schema": {...}}
    # (what some providers' clients send) got JSON that ignored the schema, a regex's "flags" were dropped.
    unknown = sorted(set(raw) - _TYPE_FIELDS[kind])
    if unknown:
        hint = " (a schema goes in {'type': 'json_schema', 'json_schema': {'name', 'schema'}})"
        raise _bad(
            f"Unrecognized field in '{param}' of type {kind!r}: {unknown[0]}"
            + (hint if unknown[0] == "schema" else "")
            + ".",
            f"{param}.{unknown[0]}",
        )
    if kind == "json_schema":
        inner = raw.get("json_schema")
        if not isinstance(inner, dict):
            raise _bad(f"Missing required parameter: '{param}.json_schema'.", f"{param}.json_schema")
        name = inner.get("name")
        if name is None:  # OpenAI's wording (the message said "None", Python's word for missing)
            raise _bad(
                f"Missing required parameter: '{param}.json_schema.name'.", f"{param}.json_schema.name"
            )
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
        if inner.get("strict") is not None and not isinstance(inner["strict"], bool):
            raise _bad(
                f"Invalid value for '{param}.json_schema.strict': expected a boolean.",
                f"{param}.json_schema.strict",
            )
        schema = inner.get("schema", _ANY_OBJECT)
        if not isinstance(schema, dict):
            raise _bad(
                f"Invalid value for '{param}.json_schema.schema': expected an object.",
                f"{param}.json_schema.schema",
            )
        raw = {"type": "json_schema", "json_schema": {"schema": schema}}
        param = f"{param}.json_schema.schema"
    elif kind in ("regex", "grammar"):  # their errors name the field that holds the pattern or grammar
        param = f"{param}.{'pattern' if kind == 'regex' else 'grammar'}"
    try:
        fmt = ResponseFormat.parse(raw)
    except InvalidRequestError as exc:
        raise _bad(str(exc), param) from None
    if fmt is not None:
        check(fmt, param)
    return fmt


#: vLLM's ``structured_outputs`` options that change nothing here, either way: JSON is always written
#: without optional whitespace (``disable_any_whitespace: false`` only allows it, so compact JSON is one of
#: the outputs it allows), there is no fallback backend (``disable_fallback``), and objects that say nothing
#: about extra keys are always closed (``disable_additional_properties: true``, what its ``false`` allows a
#: subset of). Refused, they failed requests that vLLM clients send with their defaults.
_NO_OP_STRUCTURED_OPTIONS = frozenset(
    {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
)

#: vLLM's guided-decoding fields, and the ``structured_outputs`` keys that mean the same.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_KEYS = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "structural_tag": "structural_tag",
}


def _choice_grammar(choices: list[str]) -> str:
    """One regex lexeme ``/(?:c1|c2|...)/``, every character that is not a letter or digit written as
    ``\\x{hex}`` (so no choice text can be read as regex or Lark syntax).

    Not ``start: "c1" | "c2" | ...``: each literal is its own Earley item, and llguidance's parser caps a row
    at 2000 items, so 2000 or more choices compiled (the up-front check passed) and then failed at the first
    decoding step, a 400 after admission or an error event inside a 200 stream. As one lexeme the lexer's
    automaton holds them: 20,000 choices compile in ~0.15 s, 100,000 in ~0.9 s, masks 3-7 ms a token on
    SmolLM2's vocabulary (CPU)."""
    return "start: /(?:" + "|".join(_regex_literal(c) for c in choices) + ")/"


def _regex_literal(text: str) -> str:
    return "".join(ch if ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in text)


def _object(value: Any, param: str, what: str) -> dict[str, Any]:
    """A guided field's object, given as is or as its JSON text (how vLLM's clients send both)."""
    if isinstance(value, str):
        try:
            value = loads_inner(value)
        except ValueError:
            raise _bad(f"Invalid value for '{param}': not {what} (invalid JSON).", param) from None
    if not isinstance(value, dict):
        raise _bad(f"Invalid value for '{param}': expected {what} object.", param)
    return value


def _guided_raw(field: str, value: Any, param: str) -> dict[str, Any]:
    """One vLLM guided-decoding value as the ``response_format`` dict that asks for the same thing."""
    if field == "guided_json":
        return {"type": "json_schema", "json_schema": {"schema": _object(value, param, "a JSON schema")}}
    if field == "structural_tag":  # vLLM's StructuredOutputsParams holds it as JSON text
        value = _object(value, param, "a structural tag")
        if value.get("type", "structural_tag") != "structural_tag":
            raise _bad(f"Invalid value for '{param}.type': expected 'structural_tag'.", f"{param}.type")
        return {**value, "type": "structural_tag"}
    if field == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(f"Invalid value for '{param}': expected a non-empty list of non-empty strings.", param)
        return {"type": "grammar", "grammar": _choice_grammar(value)}
    if not isinstance(value, str) or not value:
        raise _bad(f"Invalid value for '{param}': expected a non-empty string.", param)
    if field == "guided_regex":
        return {"type": "regex", "pattern": value}
    return {"type": "grammar", "grammar": value}


def requested_format(req: Any) -> tuple[dict[str, Any] | None, ResponseFormat | None]:
    """The constraint a request asks for, from ``response_format`` or vLLM's fields (at most one of them):
    the ``response_format``-shaped dict (what :func:`json_schema_of` reads) and its checked
    :class:`ResponseFormat`. A 400 naming the field when two are given or one is invalid."""
    given: list[tuple[str, str, Any]] = [
        (f, f, getattr(req, f)) for f in GUIDED_FIELDS if getattr(req, f, None) is not None
    ]
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        if not isinstance(structured, dict):
            raise _bad("Invalid value for 'structured_outputs': expected an object.", "structured_outputs")
        for key, value in structured.items():
            if key in _STRUCTURED_KEYS and value is not None:
                given.append((_STRUCTURED_KEYS[key], f"structured_outputs.{key}", value))
            elif key == "json_object" and value is True:
                given.append(("json_object", "structured_outputs.json_object", value))
            elif key in _NO_OP_STRUCTURED_OPTIONS:
                if value is not None and not isinstance(value, bool):
                    raise _bad(
                        f"Invalid type for 'structured_outputs.{key}': expected a boolean.",
                        f"structured_outputs.{key}",
                    )
            elif key == "whitespace_pattern" and value is not None:
                raise _bad(
                    "structured_outputs.whitespace_pattern is not supported: JSON is always written compact (no "
                    "whitespace between its tokens); leave it out.",
                    "structured_outputs.whitespace_pattern",
                )
            elif key not in ("json_object", *_STRUCTURED_KEYS) and value is not None:
                raise _bad(f"Unrecognized field in 'structured_outputs': {key}.", f"structured_outputs.{key}")
    if req.response_format is not None and req.response_format.get("type") != "text":
        given.insert(0, ("response_format", "response_format", req.response_format))
    if len(given) > 1:
        names = ", ".join(param for _, param, _ in given)
        raise _bad(f"Give one output constraint, not several: {names}.", given[1][1])
    if not given:
        return req.response_format, response_format(req.response_format)
    field, param, value = given[0]
    if field == "response_format":
        return value, response_format(value)
    raw = {"type": "json_object"} if field == "json_object" else _guided_raw(field, value, param)
    try:
        fmt = ResponseFormat.parse(raw)
    except InvalidRequestError as exc:
        raise _bad(str(exc), param) from None
    if fmt is not None:
        check(fmt, param)
    return raw, fmt


def constraint_field(req: Any) -> str:
    """The request field the output constraint came in (``guided_regex``, ``structured_outputs.choice``,
    ``response_format``): what a 400 found while decoding names (:func:`requested_format` has refused
    requests giving several)."""
    response = getattr(req, "response_format", None)
    if isinstance(response, dict) and response.get("type") != "text":
        return "response_format"
    for field in GUIDED_FIELDS:
        if getattr(req, field, None) is not None:
            return field
    structured = getattr(req, "structured_outputs", None)
    for key, value in structured.items() if isinstance(structured, dict) else ():
        if (key in _STRUCTURED_KEYS and value is not None) or (key == "json_object" and value is True):
            return f"structured_outputs.{key}"
    return "response_format"


class _Verdicts:
    """llguidance's verdict on each grammar checked (None: valid), least recently used forgotten past
    ``max_entries``: an agent loop sends the same tools and schemas on every call, and each check costs ~1 ms
    per schema on the event loop.

    NOTE: keyed by :attr:`ResponseFormat.key` (a hash), not the format: ``functools.lru_cache`` kept each
    format, its whole schema text with it, so 1024 distinct multi-MB schemas held GBs (measured: 20 distinct
    schemas of 3 MB grew the process by 83 MB; now by 16, the allocator's noise).
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def error(self, fmt: ResponseFormat) -> str | None:
        key = fmt.key
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        try:
            check_grammar(fmt)
            verdict = None
        except InvalidRequestError as exc:
            verdict = str(exc)
        with self._lock:
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.max_entries:
                self._verdicts.popitem(last=False)
        return verdict


_VERDICTS = _Verdicts()


def check(fmt: ResponseFormat, param: str) -> None:
    """Compile-check a grammar; a 400 naming ``param`` when llguidance refuses it."""
    try:
        error = _VERDICTS.error(fmt)
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
        # ASCII digits only: str.isdigit() also admits "²" (int() then raised, a 500) and other scripts'
        # digits, which are no token id's spelling.
        if not (key.isascii() and key.isdigit()):
            raise _bad(
                f"Invalid value for 'logit_bias': keys are token ids (digits as strings), got {key!r}.",
                "logit_bias",
            )
        out[int(key)] = float(value)
    return out
