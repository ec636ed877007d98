"""The JSON-schema spellings zod 4 writes (openai-node, the AI SDK, LangChain.js) for constraints llguidance
enforces, accepted instead of refused (:mod:`kvb_cache.structured.schema_compat`)."""

from __future__ import annotations

import pytest

from kvb_cache.structured.schema_compat import llguidance_compatible
from kvb_server import constraints
from kvb_server.errors import InvalidParameterError

#: ``z.toJSONSchema(z.object({r: z.record(z.string(), z.number())}))``.
ZOD_RECORD = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "r": {
            "type": "object",
            "propertyNames": {"type": "string"},
            "additionalProperties": {"type": "number"},
        }
    },
    "required": ["r"],
    "additionalProperties": False,
}
#: ``z.object({s: z.cuid()})``: a format llguidance does not know, and the regex that defines it.
ZOD_CUID = {
    "type": "object",
    "properties": {"s": {"type": "string", "format": "cuid", "pattern": "^[cC][0-9a-z]{6,}$"}},
    "required": ["s"],
}


#: ``z.iso.duration()`` / ``z.hostname()``: formats llguidance knows, beside a look-ahead pattern it cannot
#: compile (the patterns here are shortened; zod's have the same look-ahead).
ZOD_DURATION = {"type": "string", "format": "duration", "pattern": r"^P(?!$)(\d+Y)?(\d+M)?(\d+D)?$"}
ZOD_HOSTNAME = {"type": "string", "format": "hostname", "pattern": r"^(?=.{1,253}\.?$)[a-zA-Z0-9.-]+$"}


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema", [ZOD_RECORD, ZOD_CUID], ids=["record", "cuid"])
def test_zod_spellings_compile(schema: dict) -> None:
    """Both were a 400 ("Unimplemented keys: ["propertyNames"]", "Unknown format: cuid")."""
    assert constraints.response_format(_json_schema(schema)) is not None


@pytest.mark.parametrize("schema", [ZOD_DURATION, ZOD_HOSTNAME], ids=["duration", "hostname"])
def test_a_known_format_with_a_look_around_pattern_is_enforced_by_its_format(schema: dict) -> None:
    """Both were a 400 ("regex parse error", an audit with the AI SDK's zod, 2026-11-30)."""
    assert llguidance_compatible(schema) == {"type": "string", "format": schema["format"]}
    assert constraints.response_format(_json_schema(schema)) is not None
    # A look-around pattern with no format llguidance knows is still refused (z.emoji()), and so is one
    # beside another format, where it may say more than the format (a review: it was dropped unsaid).
    for refused in (
        {"type": "string", "pattern": "^(?=a)a+$"},
        {"type": "string", "format": "email", "pattern": "^(?!.*@example\\.com$).*$"},
    ):
        with pytest.raises(InvalidParameterError, match="regex"):
            constraints.response_format(_json_schema(refused))
    # An escaped parenthesis is no look-around; a format that is not a string is left to llguidance.
    assert llguidance_compatible({"format": "hostname", "pattern": "^\\(?=x$"}) == {
        "format": "hostname",
        "pattern": "^\\(?=x$",
    }
    assert llguidance_compatible({"type": "string", "format": ["date"]}) == {
        "type": "string",
        "format": ["date"],
    }


def test_only_the_always_true_spellings_are_rewritten() -> None:
    rewritten = llguidance_compatible(
        {
            "anyOf": [ZOD_RECORD, {"$ref": "#/$defs/C"}],
            "$defs": {"C": ZOD_CUID},
            "items": [{"type": "string", "format": "e164", "pattern": r"^\+[1-9]\d{6,14}$"}],
        }
    )
    assert "propertyNames" not in rewritten["anyOf"][0]["properties"]["r"]
    assert rewritten["anyOf"][0]["properties"]["r"]["additionalProperties"] == {"type": "number"}
    assert rewritten["$defs"]["C"]["properties"]["s"] == {"type": "string", "pattern": "^[cC][0-9a-z]{6,}$"}
    assert "format" not in rewritten["items"][0]
    # LangChain.js' withStructuredOutput copies a title into every subschema
    titled = llguidance_compatible(
        {"propertyNames": {"type": "string", "title": "extract"}, "title": "extract"}
    )
    assert titled == {"title": "extract"}
    assert "propertyNames" in ZOD_RECORD["properties"]["r"]  # the request's schema is not modified
    kept = {
        # properties called like the keywords, and data, are not schema keywords
        "properties": {"format": {"type": "string"}, "propertyNames": {"type": "string"}},
        "enum": [{"format": "cuid", "pattern": "x"}],
        # formats llguidance enforces keep their format beside the pattern
        "anyOf": [{"type": "string", "format": "email", "pattern": "^a.*$"}],
    }
    assert llguidance_compatible(kept) == kept


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        # keys constrained: nothing would enforce it, so still refused by name
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        # an unknown format with no pattern to enforce instead
        ({"type": "string", "format": "cuid"}, "cuid"),
    ],
)
def test_constraints_that_would_not_be_enforced_are_still_a_400(schema: dict, message: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        constraints.response_format(_json_schema(schema))
    assert info.value.param == "response_format.json_schema.schema" and message in str(info.value)


def test_guided_json_is_rewritten_too() -> None:
    class Req:
        response_format = None
        guided_json = ZOD_RECORD
        structured_outputs = None

    assert constraints.requested_format(Req())[1] is not None
