"""Structured outputs on the embedded SmolLM2-135M-Instruct: 100% schema-valid JSON, greedy and sampled.

32 schemas (nested objects, arrays, enums, bounded numbers, optional fields, anyOf, string patterns) run as
one batch through the engine loop; every output must parse and validate with ``jsonschema``. A mild
repetition penalty (1.1) keeps the 135M model out of degenerate loops inside unbounded strings and numbers.
"""

from __future__ import annotations

import json

import pytest

from kvb_cache import KVBoost

pytest.importorskip("llguidance", reason='needs pip install "kvb-cache[structured]"')
jsonschema = pytest.importorskip("jsonschema")

STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required: list[str] | None = None, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": ("a person", obj(name=STR, age={"type": "integer", "minimum": 0, "maximum": 130})),
    "book": (
        "a book",
        obj(title=STR, author=STR, year={"type": "integer", "minimum": 1400, "maximum": 2030}),
    ),
    "city": ("a city", obj(name=STR, country=STR, population={"type": "integer", "minimum": 0})),
    "product": (
        "a product",
        obj(name=STR, price={"type": "number", "minimum": 0, "exclusiveMaximum": 10000}, in_stock=BOOL),
    ),
    "color_enum": ("a color", obj(color={"enum": ["red", "green", "blue"]})),
    "size_enum": ("a t-shirt order", obj(size={"type": "string", "enum": ["S", "M", "L", "XL"]}, qty=INT)),
    "tags": (
        "a blog post",
        obj(title=STR, tags={"type": "array", "items": STR, "minItems": 1, "maxItems": 4}),
    ),
    "scores": (
        "test scores",
        obj(
            scores={
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "maxItems": 5,
            }
        ),
    ),
    "nested_address": (
        "a person with an address",
        obj(name=STR, address=obj(street=STR, city=STR, zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    ),
    "nested_deep": ("a company", obj(name=STR, ceo=obj(name=STR, contact=obj(email=STR, phone=STR)))),
    "array_of_objects": (
        "a shopping list",
        obj(
            items={
                "type": "array",
                "items": obj(name=STR, qty={"type": "integer", "minimum": 1, "maximum": 99}),
                "maxItems": 3,
            }
        ),
    ),
    "optional_fields": ("a user profile", obj(["username"], username=STR, bio=STR, age=INT)),
    "all_optional": (
        "some settings",
        obj(
            [], theme={"enum": ["dark", "light"]}, font_size={"type": "integer", "minimum": 8, "maximum": 32}
        ),
    ),
    "anyof_scalar": (
        "an id",
        obj(id={"anyOf": [{"type": "integer", "maximum": 10**9}, {"type": "string", "maxLength": 16}]}),
    ),
    "anyof_objects": (
        "a shape",
        obj(shape={"anyOf": [obj(kind={"const": "circle"}, r=NUM), obj(kind={"const": "square"}, side=NUM)]}),
    ),
    "nullable": (
        "a middle name (may be null)",
        obj(first=STR, middle={"anyOf": [STR, {"type": "null"}]}, last=STR),
    ),
    "type_list": ("a value", obj(value={"type": ["string", "number", "null"]})),
    "date_pattern": (
        "an event",
        obj(name=STR, date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    ),
    "code_pattern": ("an airport", obj(name=STR, iata={"type": "string", "pattern": "^[A-Z]{3}$"})),
    "phone_pattern": (
        "a phone contact",
        obj(name=STR, phone={"type": "string", "pattern": "^\\+[0-9]{6,12}$"}),
    ),
    "bounded_float": ("a probability", obj(p={"type": "number", "minimum": 0, "maximum": 1})),
    "negative_range": ("a temperature", obj(celsius={"type": "integer", "minimum": -50, "maximum": 50})),
    "bools": ("feature flags", obj(dark_mode=BOOL, beta=BOOL, notifications=BOOL)),
    "string_lengths": ("a username", obj(username={"type": "string", "minLength": 3, "maxLength": 12})),
    "const": ("a version record", obj(schema_version={"const": 2}, name=STR)),
    "refs": (
        "two points",
        {"$defs": {"pt": obj(x=NUM, y=NUM)}, **obj(a={"$ref": "#/$defs/pt"}, b={"$ref": "#/$defs/pt"})},
    ),
    "matrix": (
        "a small matrix",
        obj(rows={"type": "array", "items": {"type": "array", "items": INT, "maxItems": 3}, "maxItems": 3}),
    ),
    "enum_array": (
        "pizza toppings",
        obj(
            toppings={"type": "array", "items": {"enum": ["cheese", "ham", "olive", "onion"]}, "maxItems": 4}
        ),
    ),
    "sentiment": (
        "a sentiment label for 'I love it'",
        obj(
            label={"enum": ["positive", "negative", "neutral"]},
            confidence={"type": "number", "minimum": 0, "maximum": 1},
        ),
    ),
    "tool_call": (
        "a weather tool call",
        obj(name={"const": "get_weather"}, arguments=obj(["city"], city=STR, unit={"enum": ["c", "f"]})),
    ),
    "top_level_array": ("three fruits", {"type": "array", "items": STR, "minItems": 3, "maxItems": 3}),
    "mixed": (
        "a movie review",
        obj(
            ["movie", "rating"],
            movie=STR,
            rating={"type": "integer", "minimum": 1, "maximum": 5},
            pros={"type": "array", "items": STR, "maxItems": 2},
            spoiler=BOOL,
        ),
    ),
}
MAX_NEW_TOKENS = 160
#: Without it, greedy SmolLM2-135M loops inside 2 of the 32 values ("john_johns_johns_...", a 160-digit id)
#: until max_new_tokens cuts the JSON short: the grammar allows any length, the model never closes it.
#: With it, anyof_scalar's unbounded id still ran away ("1234567890-A-B-C-...", then "2379840523123232...")
#: until both of its branches were bounded (maxLength, maximum).
REPETITION_PENALTY = 1.1


@pytest.fixture(scope="module")
def engine(smollm2):
    model, tokenizer = smollm2
    return KVBoost(model, tokenizer)


def _prompts(engine: KVBoost) -> list[list[int]]:
    return [
        engine.chat_prompt(
            [
                {
                    "role": "system",
                    "content": "Reply with JSON only, matching this schema: " + json.dumps(schema),
                },
                {"role": "user", "content": f"Give me {what}."},
            ]
        )
        for what, schema in SCHEMAS.values()
    ]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.95}], ids=["greedy", "sampled"])
def test_every_output_is_schema_valid(engine, sampling):
    assert len(SCHEMAS) >= 30
    rows = [
        {
            **sampling,
            "response_format": schema,
            "repetition_penalty": REPETITION_PENALTY,
            **({"seed": i} if sampling else {}),
        }
        for i, (_, schema) in enumerate(SCHEMAS.values())
    ]
    results = engine.generate_batch(_prompts(engine), sampling=rows, max_new_tokens=MAX_NEW_TOKENS)
    failures = []
    for (name, (_, schema)), result in zip(SCHEMAS.items(), results):
        try:
            jsonschema.validate(json.loads(result.output_text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name} ({result.finish_reason}): {result.output_text[:120]!r}: {str(e)[:80]}")
    assert not failures, "\n".join(failures)


#: Few-shot calls, one of them wrong (an unknown key): the model copies it unless the tag's schema holds it.
CALL_SHOTS = (
    'Q: weather in Rome?\nA: <function=get_weather>{"city": "Rome"}</function>\n'
    'Q: weather in Oslo?\nA: <function=get_weather>{"town": "Oslo", "unit": "C"}</function>\n'
    "Q: capital of Spain?\nA: Madrid.\n"
)


def test_structural_tag_holds_the_calls_and_leaves_other_text_alone(engine):
    city = obj(city=STR)
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<function=get_weather>", "schema": city, "end": "</function>"}],
        "triggers": ["<function="],
    }
    calls = 0
    for question in ("weather in Lima?", "weather in Paris?", "capital of Italy?", "weather in Cairo?"):
        prompt = CALL_SHOTS + f"Q: {question}\nA:"
        free = engine.generate(prompt, max_new_tokens=40, stop=["\nQ:"]).output_text
        held = engine.generate(prompt, response_format=tag, max_new_tokens=40, stop=["\nQ:"]).output_text
        if "<function=" not in held:  # no trigger: the grammar never narrowed a token
            assert held == free
            continue
        body = held.split("<function=get_weather>", 1)[1]
        jsonschema.validate(json.loads(body[: body.index("</function>")]), city)
        calls += 1
    assert calls >= 1, "the model made no call: nothing was checked"
