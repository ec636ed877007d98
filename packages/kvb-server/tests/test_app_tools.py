"""Tool calling, response_format and logit_bias end to end on a tiny random Llama (real engine, real grammar).

A random model writes nonsense, but constrained decoding makes the *shape* a guarantee: these tests check
that every reply is a valid call / schema-valid JSON, whatever the weights. Schemas use enums and bounded
numbers so that replies end well within max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import build_tiny_engine, serve

from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather now",
        "parameters": {
            "type": "object",
            "properties": {"unit": UNIT, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["unit", "days"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    },
}
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # The tool prompt of a template without tools is ~800 tokens with this tiny vocabulary.
    engine = build_tiny_engine(context=2048)
    config = ServerConfig(model_names=(MODEL,), max_tokens=160)
    with serve(create_app(engine, config)) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"unit", "days"} and args["unit"] in UNIT["enum"] and 1 <= args["days"] <= 7
    else:
        assert name == "set_alarm" and set(args) == {"on"} and isinstance(args["on"], bool)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_required_and_named_choices_return_valid_tool_calls(client: openai.OpenAI, choice) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, ALARM], tool_choice=choice, temperature=0, max_tokens=160
    )
    choice0 = resp.choices[0]
    # A named choice forced the call: "stop", as OpenAI and vLLM answer; "tool_calls" when the model chose.
    assert choice0.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls"), choice0
    assert choice0.message.content is None and choice0.message.tool_calls
    for call in choice0.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function.name, call.function.arguments)
    if isinstance(choice, dict):
        assert [c.function.name for c in choice0.message.tool_calls] == ["set_alarm"]


def test_allowed_tools_required_calls_only_the_allowed_subset(client: openai.OpenAI) -> None:
    """``allowed_tools`` (pydantic-ai's restriction of a run to some tools) through the SDK: every call is
    one of the allowed functions, although both stay declared."""
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {
            "mode": "required",
            "tools": [{"type": "function", "function": {"name": "set_alarm"}}],
        },
    }
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[WEATHER, ALARM], tool_choice=choice, temperature=0, max_tokens=160
    )
    calls = resp.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"set_alarm"}
    for call in calls:
        check_call(call.function.name, call.function.arguments)


def test_streamed_tool_calls_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER, ALARM], tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=160).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, max_tokens=160, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for piece in choice.delta.tool_calls or ():
            entry = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
            entry["name"] += piece.function.name or ""
            entry["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    assert all(c["id"] for c in calls.values())


def test_a_named_tool_choice_finishes_stop_streamed_or_not(client: openai.OpenAI) -> None:
    """OpenAI and vLLM finish a call forced by a named tool_choice with "stop" ("tool_calls" means the model
    chose to call tools): the same streamed and not, with the call itself unchanged."""
    kwargs = dict(
        model=MODEL,
        messages=USER,
        tools=[WEATHER, ALARM],
        tool_choice={"type": "function", "function": {"name": "set_alarm"}},
        temperature=0,
        max_tokens=160,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and [c.function.name for c in whole.message.tool_calls] == [
        "set_alarm"
    ]
    finish, names = None, []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        names += [piece.function.name for piece in choice.delta.tool_calls or () if piece.function.name]
    assert (finish, names) == ("stop", ["set_alarm"])


def test_a_forced_call_cut_before_its_name_is_the_call_streamed_or_not(client: openai.OpenAI) -> None:
    """max_tokens ends a required call inside ``<tool_call>``: with one callable tool the reply is that call
    with no arguments yet, finish ``length``, streamed and not (it was the call syntax as ``content``)."""
    kwargs = dict(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, max_tokens=2).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", "")
    ]
    content, finish, calls = "", None, []
    for chunk in client.chat.completions.create(**kwargs, max_tokens=2, stream=True):
        choice = chunk.choices[0]
        calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or ()]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
    assert (content, finish, calls) == ("", "length", [("get_weather", "")])


def test_response_format_json_schema_is_schema_valid(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "unit": UNIT,
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["unit", "ok", "n"],
    }
    resp = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": schema, "strict": True},
        },
        temperature=0,
        max_tokens=160,
    )
    data = json.loads(resp.choices[0].message.content)
    assert set(data) == {"unit", "ok", "n"} and data["unit"] in UNIT["enum"] and 0 <= data["n"] <= 9
    text = client.completions.create(
        model=MODEL,
        prompt="unit:",
        temperature=0,
        max_tokens=20,
        extra_body={"response_format": {"type": "regex", "pattern": "(celsius|fahrenheit)"}},
    )
    assert text.choices[0].text in UNIT["enum"] and text.choices[0].finish_reason == "stop"


def test_logit_bias_steers_greedy_decoding(url: str, client: openai.OpenAI) -> None:
    token = httpx.post(
        url + "/tokenize", json={"model": MODEL, "prompt": "Z", "add_special_tokens": False}
    ).json()
    (z,) = token["tokens"]
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, logit_bias={str(z): 100}, temperature=0, max_tokens=5
    )
    assert resp.choices[0].message.content == "Z" * 5
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, logit_bias={"999999": 1}, max_tokens=2)
    assert info.value.param == "logit_bias"


def test_tool_history_is_accepted_and_shares_the_prefix(client: openai.OpenAI) -> None:
    tools = [WEATHER, ALARM]
    first = client.chat.completions.create(
        model=MODEL, messages=USER, tools=tools, tool_choice="required", temperature=0, max_tokens=160
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, tools=tools, tool_choice="none", temperature=0, max_tokens=4
    )
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "length"
    # The tool list and the first turn are a prefix of the second prompt: served from the cache.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


#: As pydantic writes a model with a nested model (instructor's ``Iterable[User]``): ``$defs`` and ``$ref``s.
PEOPLE = {
    "type": "function",
    "function": {
        "name": "IterableUser",
        "parameters": {
            "$defs": {
                "User": {
                    "properties": {"name": UNIT, "age": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["name", "age"],
                    "type": "object",
                }
            },
            "properties": {"tasks": {"items": {"$ref": "#/$defs/User"}, "type": "array", "maxItems": 2}},
            "required": ["tasks"],
            "type": "object",
        },
    },
}


@pytest.mark.parametrize(
    ("tools", "choice"),
    [([PEOPLE], {"type": "function", "function": {"name": "IterableUser"}}), ([ALARM, PEOPLE], "required")],
)
def test_tool_parameters_with_refs_to_their_own_defs_are_served(client: openai.OpenAI, tools, choice) -> None:
    """A ``$ref`` is relative to the tool's parameters, not to the grammar's call object (a 400 before)."""
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, tools=tools, tool_choice=choice, temperature=0, max_tokens=160
    )
    for call in resp.choices[0].message.tool_calls:
        if call.function.name == "IterableUser":
            for user in json.loads(call.function.arguments)["tasks"]:
                assert user["name"] in UNIT["enum"] and 1 <= user["age"] <= 9
        else:
            check_call(call.function.name, call.function.arguments)


def test_invalid_schema_is_a_400_before_queueing(client: openai.OpenAI) -> None:
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[bad], tool_choice="required")
    assert info.value.param == "tools[0].function.parameters"


@pytest.mark.parametrize(
    ("response_format", "param", "words"),
    [
        # Other providers' shape: the schema was ignored (any JSON object came back).
        ({"type": "json_object", "schema": {"type": "object"}}, "response_format.schema", "json_schema"),
        ({"type": "regex", "pattern": "a+", "flags": "i"}, "response_format.flags", "Unrecognized field"),
        ({"type": "regex", "pattern": "(unclosed"}, "response_format.pattern", "invalid"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, "response_format.grammar", "invalid"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict",
            "boolean",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
            },
            "response_format.json_schema.schema",
            "use anyOf",  # llguidance's "Enable 'coerce_one_of'" named an option no client can set
        ),
    ],
)
def test_response_format_fields_are_checked_not_ignored(
    client: openai.OpenAI, response_format: dict, param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, extra_body={"response_format": response_format}
        )
    assert info.value.param == param and words in str(info.value)


def test_a_tool_argument_named_like_a_data_keyword_is_served(client: openai.OpenAI) -> None:
    # "examples" with a $ref to its model was refused ("Pointer '/$defs/Example' does not exist").
    tool = {
        "type": "function",
        "function": {
            "name": "teach",
            "parameters": {
                "$defs": {"Example": {"type": "object", "properties": {"q": UNIT}, "required": ["q"]}},
                "type": "object",
                "properties": {
                    "examples": {"type": "array", "items": {"$ref": "#/$defs/Example"}, "maxItems": 2}
                },
                "required": ["examples"],
            },
        },
    }
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[tool], tool_choice="required", temperature=0, max_tokens=96
    )
    [call] = resp.choices[0].message.tool_calls
    for example in json.loads(call.function.arguments)["examples"]:
        assert example["q"] in UNIT["enum"]


def test_stream_opens_a_call_as_openai_does(url: str) -> None:
    """The first delta carries the role, content null and the call's id/type/name; no separate role chunk."""
    body = {
        "model": MODEL,
        "messages": USER,
        "tools": [ALARM],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 160,
        "stream": True,
    }
    lines = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    assert first["tool_calls"][0]["function"] == {"name": "set_alarm", "arguments": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


#: As zod 4 writes ``z.record(z.string(), ...)`` (openai-node's ``zodFunction``, the AI SDK's ``tool()``), and a
#: string format llguidance does not know beside the regex that defines it (``z.nanoid()``, ``z.cuid()``).
ZOD_RECORD = {
    "type": "object",
    "propertyNames": {"type": "string"},
    "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
    "maxProperties": 2,
}
ZOD_FORMAT = {"type": "string", "format": "nanoid", "pattern": "^[a-z]{3}$"}


def test_zod_records_and_formats_are_served_in_tools_and_response_format(client: openai.OpenAI) -> None:
    """Both were a 400 (``Unimplemented keys: ["propertyNames"]``, ``Unknown format: nanoid``)."""
    schema = {"type": "object", "properties": {"r": ZOD_RECORD, "id": ZOD_FORMAT}, "required": ["r", "id"]}
    tool = {"type": "function", "function": {"name": "tally", "parameters": schema}}
    calls = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[tool], tool_choice="required", temperature=0, max_tokens=160
    )
    answer = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
        temperature=0,
        max_tokens=160,
    )
    # A random model may write a record key until max_tokens (keys are any string): then the cut call is text.
    call = calls.choices[0]
    replies = [answer.choices[0].message.content]
    if call.finish_reason != "length":
        replies.append(call.message.tool_calls[0].function.arguments)
    for reply in map(json.loads, replies):
        assert len(reply["id"]) == 3 and reply["id"].isalpha() and reply["id"].islower()
        assert len(reply["r"]) <= 2 and all(0 <= v <= 9 for v in reply["r"].values())
