"""vLLM's ``structural_tag`` response format: free text in which a trigger starts a tagged segment whose body
must match a JSON schema.

The request (vLLM's ``StructuralTagResponseFormat``, xgrammar's original structural tag)::

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

The reply is any text until a trigger appears; from there it must continue with the ``begin`` of a structure
that starts with that trigger, then JSON matching that structure's schema, then its ``end``; then free text
again, any number of times. The text between segments is unconstrained (a model may also never call).

Compiled to llguidance's Lark dialect: each trigger ends a *lazy* lexeme (free text up to the first
occurrence of the trigger), so once the trigger is written the parser is inside the segment and only a
``begin`` continuation is allowed. A trigger, the rest of a ``begin``, or an ``end`` that the tokenizer holds
as one added token (Llama 3.1's ``<|python_tag|>``, Qwen's ``</tool_call>``) is written by its id: llguidance
reads added tokens as special tokens, which no text literal matches, so a literal would force the model to
spell the tag byte by byte (as in :mod:`kvb_server.tool_calls.grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvb_cache.errors import InvalidRequestError
from kvb_cache.structured.schema_compat import JSON_OPTIONS

#: Fields of the request and of each structure (others are refused, never ignored).
_FIELDS = frozenset({"type", "structures", "triggers"})
_STRUCTURE_FIELDS = frozenset({"begin", "schema", "end"})


def _bad(why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"response_format structural_tag {why}; expected {{'type': 'structural_tag', 'structures': [{{'begin': "
        "str, 'schema': {...}, 'end': str}, ...], 'triggers': [str, ...]}} (each begin starting with a trigger)",
        param="response_format",
    )


def canonical(value: Mapping[str, Any]) -> str:
    """The checked request as compact JSON (``{"structures": [...], "triggers": [...]}``, order kept): the
    :class:`~kvb_cache.structured.ResponseFormat` source, one compiled grammar per distinct tag set.

    Raises:
        InvalidRequestError: a missing, mistyped or unknown field, or a ``begin`` that starts with no trigger.
    """
    unknown = sorted(set(value) - _FIELDS)
    if unknown:
        raise _bad(f"has an unknown field {unknown[0]!r}")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise _bad("needs 'triggers', a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise _bad("needs 'structures', a non-empty list")
    out = []
    for i, item in enumerate(structures):
        if not isinstance(item, dict):
            raise _bad(f"structures[{i}] is not an object")
        unknown = sorted(set(item) - _STRUCTURE_FIELDS)
        if unknown:
            raise _bad(f"structures[{i}] has an unknown field {unknown[0]!r}")
        begin, schema, end = item.get("begin"), item.get("schema", True), item.get("end", "")
        if not isinstance(begin, str) or not begin:
            raise _bad(f"structures[{i}].begin must be a non-empty string")
        if not isinstance(end, str):
            raise _bad(f"structures[{i}].end must be a string")
        if not isinstance(schema, dict) and schema is not True:  # false would match no segment at all
            raise _bad(f"structures[{i}].schema must be a JSON schema object")
        if trigger_of(begin, triggers) is None:
            raise _bad(f"structures[{i}].begin {begin!r} starts with none of the triggers")
        out.append({"begin": begin, "schema": schema, "end": end})
    try:
        return json.dumps({"structures": out, "triggers": triggers}, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _bad(f"holds a schema that is not JSON ({e})") from None


def trigger_of(begin: str, triggers: Iterable[str]) -> str | None:
    """The shortest trigger ``begin`` starts with (None: none): free text ends at the first trigger completed,
    so with triggers ``<f`` and ``<func`` a segment starting ``<func=`` has begun at ``<f`` (filed under the
    longer one, it could never be reached)."""
    return min((t for t in triggers if begin.startswith(t)), key=len, default=None)


def schemas(source: str) -> list[Any]:
    """The structures' schemas of a :func:`canonical` source."""
    return [s["schema"] for s in json.loads(source)["structures"]]


def tag_texts(source: str) -> set[str]:
    """Every text of a :func:`canonical` source that may be one added token: the triggers, what each
    ``begin`` adds to its trigger, and the ``end`` s."""
    spec = json.loads(source)
    texts = set(spec["triggers"])
    for s in spec["structures"]:
        texts |= {s["begin"][len(trigger_of(s["begin"], spec["triggers"]) or "") :], s["end"]}
    return {t for t in texts if t}


def lark(source: str, prepare_schema: Any, token_ids: Mapping[str, int] | None = None) -> str:
    """The llguidance Lark grammar of a :func:`canonical` source.

    Args:
        prepare_schema: each schema as it is compiled (``backend.llguidance_schema``: strict objects, zod's
            spellings rewritten).
        token_ids: tag texts the tokenizer holds as one added token -> its id (written ``<[id]>``).
    """
    ids = token_ids or {}
    spec = json.loads(source)
    triggers: list[str] = list(dict.fromkeys(spec["triggers"]))  # repeated triggers: one rule

    def text(s: str) -> str:
        if not s:
            return ""
        return f"<[{ids[s]}]>" if s in ids else json.dumps(s)  # a JSON string is a Lark string literal

    rules = []
    segments = []
    for t, trigger in enumerate(triggers):
        bodies = []
        for s in spec["structures"]:
            if trigger_of(s["begin"], triggers) != trigger:
                continue
            prepared = {} if s["schema"] is True else prepare_schema(s["schema"])  # true: any JSON value
            schema = {"x-guidance": JSON_OPTIONS, **prepared}
            body = " ".join(
                part
                for part in (text(s["begin"][len(trigger) :]), f"%json {json.dumps(schema)}", text(s["end"]))
                if part
            )
            bodies.append(body)
        if not bodies:
            continue  # a trigger no structure starts with: it constrains nothing
        if trigger in ids:  # free text cannot hold an added token, so the text ends where it comes
            rules.append(f"seg_{t}: FREE {text(trigger)} ({' | '.join(bodies)})")
        else:  # lazy: the free text ends at the trigger's first occurrence
            rules.append(f"seg_{t}_open[lazy]: FREE {text(trigger)}")
            rules.append(f"seg_{t}: seg_{t}_open ({' | '.join(bodies)})")
        segments.append(f"seg_{t}")
    head = ["%llguidance {}", f"start: ({' | '.join(segments)})* FREE", r"FREE: /(.|\n)*/"]
    return "\n".join(head + rules) + "\n"
