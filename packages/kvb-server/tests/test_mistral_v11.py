"""Mistral's v11+ tool-call format (Mistral Small 3.1 and later, Magistral, Devstral):
``[TOOL_CALLS]get_weather[ARGS]{"unit": ...}`` per call, the name outside the JSON.

Before, a template that writes ``[ARGS]`` was read as the older ``[TOOL_CALLS][{"name": ...}]`` format, so the
grammar forced the model into a format it was not trained on (an audit, 2026-11-30). The template and tokens
below are written for these tests in the style of the released ones (control tokens held as special
tokens); the checkpoints cannot be downloaded here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import llguidance
import llguidance.hf
import openai
import pytest
from conftest import build_tiny_engine, serve
from test_tool_calls import accepts
from test_tool_templates import WEATHER, tokenizer_with

from kvb_server import ServerConfig, create_app
from kvb_server.tag_tokens import tag_tokens
from kvb_server.tool_calls import ToolCallStream, detect, scan_calls, split_reply, tool_grammar
from kvb_server.tool_calls.spec import tool_plan
from kvb_server.tool_calls.syntax import MISTRAL_V11

TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "required": []}},
}
CONTROL = (
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- set a = c.function.arguments %}"
    "{%- if a is not string %}{%- set a = a | tojson %}{% endif %}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ a }}{% endfor %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
CALL = '[TOOL_CALLS]get_weather[ARGS]{"unit":"celsius","days":2}'


def v11_tokenizer():
    return tokenizer_with(TEMPLATE, *CONTROL)  # control tokens held as special, as Mistral's are


@pytest.fixture(scope="module")
def tok():
    tokenizer = v11_tokenizer()
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def test_a_template_writing_args_is_detected_as_v11() -> None:
    assert detect(v11_tokenizer()) is MISTRAL_V11


def test_the_grammar_admits_tagged_calls(tok) -> None:
    tokenizer, _ = tok
    tags = {t: tokenizer.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}
    plan = tool_plan([WEATHER, TIME], "required", None, MISTRAL_V11)
    grammar = tool_grammar(plan, tag_tokens=tags)
    assert accepts(tok, grammar, CALL) and accepts(tok, grammar, CALL + "[TOOL_CALLS]get_time[ARGS]{}")
    assert accepts(tok, grammar, CALL.replace("[ARGS]", "[CALL_ID]a1B2c3D4e[ARGS]"))  # an id before the args
    assert not accepts(tok, grammar, CALL.replace("celsius", "kelvin"))  # that tool's schema
    assert not accepts(tok, grammar, '[TOOL_CALLS]get_time[ARGS]{"unit":"celsius","days":2}')
    assert not accepts(tok, grammar, CALL.replace("get_weather", "get_wether"))
    assert not accepts(
        tok, grammar, '[TOOL_CALLS][{"name":"get_weather","arguments":{}}]'
    )  # the older format
    auto = tool_grammar(tool_plan([WEATHER], "auto", None, MISTRAL_V11), tag_tokens=tags)
    assert accepts(tok, auto, "It is sunny.") and accepts(tok, auto, CALL)


def test_tagged_calls_are_read_whole_and_in_pieces() -> None:
    two = CALL + '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "UTC"}'
    calls, state = scan_calls(two, MISTRAL_V11)
    assert state == "done" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"unit": "celsius", "days": 2}),
        ("get_time", {"tz": "UTC"}),
    ]
    assert scan_calls("[TOOL_CALLS]get_wea", MISTRAL_V11) == ([], "partial")
    assert scan_calls("[TOOL_CALLS]get_weather[AR", MISTRAL_V11) == ([], "partial")
    calls, state = scan_calls('[TOOL_CALLS]get_weather[ARGS]{"unit":"ce', MISTRAL_V11)
    assert state == "partial" and (calls[0].name, calls[0].complete) == ("get_weather", False)
    assert scan_calls("[TOOL_CALLS]no such name![ARGS]{}", MISTRAL_V11)[1] == "bad"
    reply = split_reply(two, MISTRAL_V11)
    assert reply.content is None and [c.name for c in reply.calls] == ["get_weather", "get_time"]
    plan = tool_plan([WEATHER, TIME], "required", None, MISTRAL_V11)
    stream, deltas = ToolCallStream(plan), []
    for i in range(0, len(two), 5):
        deltas += stream.push(two[i : i + 5])
    deltas += stream.finish()
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [h["function"]["name"] for h in heads] == ["get_weather", "get_time"]
    assert all(len(h["id"]) == 9 for h in heads)  # what the template's ids are
    # A forced call cut inside its name: the one tool it can still be.
    cut = split_reply(
        "[TOOL_CALLS]get_t", MISTRAL_V11, truncated=True, forced=True, names=("get_weather", "get_time")
    )
    assert cut.content is None and [c.name for c in cut.calls] == ["get_time"]
    names = ("get", "get_time")  # a whole name that prefixes another: the tag after it settles it
    for text, name in (
        ("[TOOL_CALLS]get", None),
        ("[TOOL_CALLS]get[AR", "get"),
        ("[TOOL_CALLS]get[CALL_ID]a1", "get"),
    ):
        cut = split_reply(text, MISTRAL_V11, truncated=True, forced=True, names=names)
        assert [c.name for c in cut.calls] == ([name] if name else []), text


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = build_tiny_engine(context=2048, tokenizer=v11_tokenizer())
    assert set(tag_tokens(engine, "[TOOL_CALLS]", "[ARGS]")) == {"[TOOL_CALLS]", "[ARGS]"}
    with serve(create_app(engine, ServerConfig(model_names=("tiny-llama",), max_tokens=64))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_round_trips(client: openai.OpenAI, stream: bool) -> None:
    kwargs = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )
    if stream:
        calls: list[dict] = []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for piece in chunk.choices[0].delta.tool_calls or ():
                if piece.id:
                    calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
                calls[-1]["arguments"] += piece.function.arguments or ""
            assert not chunk.choices[0].delta.content
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.content is None
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls
        ]
    [call] = calls
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["unit"] in (
        "celsius",
        "fahrenheit",
    )
    history = [
        kwargs["messages"][0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    again = client.chat.completions.create(
        **{**kwargs, "messages": history, "tool_choice": "none", "max_tokens": 2}
    )
    assert again.choices[0].finish_reason in ("stop", "length")
