"""JSON-schema spellings that llguidance refuses although it enforces what they mean, rewritten before compiling.

zod 4's ``z.toJSONSchema`` (what openai-node's ``zodResponseFormat`` / ``zodFunction``, the AI SDK's
``generateObject`` and tools, and LangChain.js' ``withStructuredOutput`` send) writes two such spellings:

- ``z.record(z.string(), V)`` is ``{"type": "object", "propertyNames": {"type": "string"},
  "additionalProperties": V}``. JSON object keys are always strings, so that ``propertyNames`` constrains
  nothing, but llguidance refuses the keyword (``Unimplemented keys: ["propertyNames"]``) and the request was
  a 400 where OpenAI serves it. Only the always-true forms are dropped (annotations aside: LangChain.js
  adds a ``title`` to every subschema); a ``propertyNames`` that constrains the keys (a ``pattern``, an
  ``enum``) is still refused, since it would not be enforced.
- string formats llguidance does not know (``cuid``, ``nanoid``, ``e164``, ``base64``, ``lowercase``,
  ``starts_with``, ...) come with the regex that defines them in ``pattern``. llguidance refuses an unknown
  ``format`` (``Unknown format: cuid``); the ``pattern`` states the whole constraint, and JSON Schema makes
  ``format`` an annotation unless a validator knows it, so the unknown ``format`` is dropped and the
  ``pattern`` enforced. An unknown ``format`` with no ``pattern`` is left for llguidance to refuse: nothing
  would enforce it.
- ``duration`` and ``hostname``, which llguidance enforces, written with the look-ahead ``pattern`` zod
  derives from them (``z.iso.duration()``, ``z.hostname()``; its look-aheads only say "not empty" and "at
  most 253 characters"), which llguidance's regex engine refuses ("regex parse error"): the ``pattern`` is
  dropped and the ``format`` enforced, as OpenAI's structured outputs enforce them. Only these two
  formats: beside any other, a look-around ``pattern`` may say more than the format (an email not at one
  domain), so it stays a 400 rather than go unenforced.

Applied where every JSON schema is compiled (:func:`kvb_cache.structured.backend.llguidance_schema`), so
``response_format``, vLLM's ``guided_json``, the Responses API's ``text.format`` and a server's tool
``parameters`` all take them. Everything else is passed through untouched, so a keyword that cannot be enforced is still a 400 naming it
(docs/structured.md: refusing beats silently ignoring).
"""

from __future__ import annotations

import re
from typing import Any

#: llguidance's JSON options for every schema compiled here (``response_format``, a structural tag's
#: segments, the server's tool arguments): compact JSON, no optional whitespace, since small models otherwise
#: loop on spaces and newlines.
JSON_OPTIONS = {"whitespace_flexible": False}

#: The ``format`` values llguidance 1.x enforces (others are "Unknown format" errors).
LLGUIDANCE_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)

#: Look-ahead / look-behind (an unescaped ``(?=``, ``(?!``, ``(?<=``, ``(?<!``), which llguidance's regex
#: engine (Rust's ``regex``) does not implement.
_LOOK_AROUND = re.compile(r"(?<!\\)\(\?<?[=!]")
#: Formats whose zod pattern uses look-ahead to say what the format already says.
_LOOK_AHEAD_FORMATS = frozenset({"duration", "hostname"})

#: ``propertyNames`` values every JSON object satisfies (its keys are strings), once annotations are removed.
_ALWAYS_TRUE_PROPERTY_NAMES: tuple[Any, ...] = (True, {}, {"type": "string"})
#: Keywords that describe and do not constrain: LangChain.js copies ``title`` into every subschema.
_ANNOTATIONS = frozenset(
    {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly"}
)

#: Keywords whose value maps names to subschemas (shared by every walk over schema positions).
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
#: Keywords whose value is a subschema (``items`` may also be draft-7's list of subschemas).
SCHEMA_VALUES = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
#: Keywords whose value is a list of subschemas.
SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
#: Keywords whose values are data, not schemas: never walked, never rewritten.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def llguidance_compatible(schema: Any) -> Any:
    """``schema`` with the spellings above rewritten (a new object; ``schema`` is not modified).

    Only schema positions are walked (``properties`` values, ``items``, ``anyOf`` members, ...), so a
    property that happens to be called ``format`` or ``propertyNames``, and data under ``enum``, ``const``
    or ``default``, are left alone.
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: llguidance_compatible(sub) for name, sub in value.items()}
        elif (key in SCHEMA_LISTS or key == "items") and isinstance(value, list):
            out[key] = [llguidance_compatible(sub) for sub in value]
        elif key in SCHEMA_VALUES:
            out[key] = llguidance_compatible(value)
        else:
            out[key] = value
    if "propertyNames" in out and _always_true(out["propertyNames"]):
        del out["propertyNames"]
    fmt = out.get("format")
    pattern = out.get("pattern")
    if isinstance(fmt, str) and fmt not in LLGUIDANCE_FORMATS and isinstance(pattern, str):
        del out["format"]
    elif (
        isinstance(fmt, str)
        and fmt in _LOOK_AHEAD_FORMATS
        and isinstance(pattern, str)
        and _LOOK_AROUND.search(pattern)
    ):
        del out["pattern"]
    return out


def _always_true(names: Any) -> bool:
    """Whether every object's keys satisfy the ``propertyNames`` schema ``names``."""
    if isinstance(names, dict):
        names = {key: value for key, value in names.items() if key not in _ANNOTATIONS}
    return any(names == v and type(names) is type(v) for v in _ALWAYS_TRUE_PROPERTY_NAMES)
