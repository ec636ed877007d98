"""What a request's output must match: a normalized, hashable ``response_format``.

Parsing needs no grammar library (it runs when :class:`~kvb_cache.SamplingParams` is built); compiling
does (see :mod:`kvb_cache.structured.backend`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from kvb_cache.errors import InvalidRequestError, check_utf8
from kvb_cache.structured import structural_tag

GrammarKind = Literal["json_schema", "regex", "grammar", "structural_tag"]

#: ``"json"`` / ``{"type": "json_object"}``: any JSON object.
ANY_JSON_OBJECT = '{"type":"object"}'

_ACCEPTED = (
    "a JSON schema dict, a pydantic model class, 'json', {'type': 'json_object'}, "
    "{'type': 'json_schema', 'json_schema': {'schema': ...}}, {'type': 'regex', 'pattern': ...} or "
    "{'type': 'grammar', 'grammar': <Lark or GBNF text>} or vLLM's {'type': 'structural_tag', 'structures': [...], "
    "'triggers': [...]}"
)


def _bad(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"response_format {why}; expected {_ACCEPTED}", param="response_format")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseFormat:
    """A grammar the output must match: ``kind`` and its canonical ``source`` text.

    ``json_schema`` sources are the schema serialized compactly (equal schemas share one compiled grammar;
    key order matters, since properties are generated in declared order); ``regex`` is a pattern matched against the whole output; ``grammar`` is Lark (or GBNF, with
    ``::=`` rules) text; ``structural_tag`` is the checked tag set as compact JSON
    (:mod:`kvb_cache.structured.structural_tag`).
    """

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "regex", "grammar", "structural_tag"):
            raise _bad(f"kind must be json_schema, regex, grammar or structural_tag, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise _bad("needs a non-empty source")
        check_utf8(self.source, "response_format")

    @property
    def key(self) -> str:
        """Stable identity of this grammar (the compiled-grammar cache key, with the tokenizer's)."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @classmethod
    def parse(cls, value: Any) -> ResponseFormat | None:
        """Normalize any accepted ``response_format`` (None and ``{"type": "text"}`` mean unconstrained)."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        # Type checks before ==: a numpy array compared elementwise ("truth value ... is ambiguous").
        if isinstance(value, str) and value == "json":
            return cls(kind="json_schema", source=ANY_JSON_OBJECT)
        if isinstance(value, str):
            raise _bad(f"got the string {value!r}")
        if isinstance(value, type) and callable(getattr(value, "model_json_schema", None)):
            return cls._schema(value.model_json_schema())  # a pydantic model class
        if not isinstance(value, dict):
            raise _bad(f"got {type(value).__name__}")
        kind = value.get("type")
        if not isinstance(kind, str):  # a bare schema ({"anyOf": ...}, "type": ["string", "null"]); never ==
            return cls._schema(value)
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(kind="json_schema", source=ANY_JSON_OBJECT)
        if kind == "json_schema":
            inner = value.get("json_schema", value)
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if schema is None:
                raise _bad("of type json_schema needs json_schema.schema")
            return cls.parse(schema) if isinstance(schema, type) else cls._schema(schema)
        if kind == "regex":
            pattern = value.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                raise _bad("of type regex needs a non-empty 'pattern' string")
            return cls(kind="regex", source=pattern)
        if kind == "grammar":
            grammar = value.get("grammar")
            if not isinstance(grammar, str) or not grammar.strip():
                raise _bad("of type grammar needs a non-empty 'grammar' string (Lark or GBNF)")
            return cls(kind="grammar", source=grammar)
        if kind == "structural_tag":
            return cls(kind="structural_tag", source=structural_tag.canonical(value))
        return cls._schema(value)

    @classmethod
    def _schema(cls, schema: Any) -> ResponseFormat:
        if not isinstance(schema, (dict, bool)):
            raise _bad(f"schema must be a JSON object, got {type(schema).__name__}")
        try:
            # NOTE: key order kept: properties are generated in the schema's declared order.
            source = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise _bad(f"schema is not JSON-serializable ({e})") from None
        return cls(kind="json_schema", source=source)
