"""``/v1/responses`` with function tools and ``text.format`` on a tiny random Llama (real engine, real grammar).

The chat route constrains replies to valid calls / schema-valid JSON whatever the weights; these tests check
that the Responses route carries that through: ``function_call`` items (and their stream events) with valid
arguments, a ``function_call_output`` follow-up by ``previous_response_id``, and JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from conftest import build_tiny_engine, serve

from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather now",
    "parameters": {
        "type": "object",
        "properties": {"unit": UNIT, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["unit", "days"],
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    # The tool prompt of a template without tools is ~800 tokens with this tiny vocabulary.
    engine = build_tiny_engine(context=2048)
    with serve(create_app(engine, ServerConfig(model_names=(MODEL,), max_tokens=160))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"unit", "days"} and args["unit"] in UNIT["enum"] and 1 <= args["days"] <= 7


def test_required_tool_gives_function_calls_and_a_follow_up_reads_their_output(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    resp = client.responses.create(**kw, input="weather?", parallel_tool_calls=False)
    assert resp.status == "completed", resp.output
    [call] = resp.output
    assert call.type == "function_call" and call.status == "completed" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    check_weather(call.arguments)
    assert resp.output_text == "" and resp.tools[0].name == "get_weather"

    follow = client.responses.create(
        model=MODEL,
        previous_response_id=resp.id,
        tools=[WEATHER],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        max_output_tokens=8,
        temperature=0,
    )
    assert [item.type for item in follow.output] == ["message"]
    # The follow-up's prompt starts with the first turn (its tool prompt included): served from the cache.
    assert follow.usage.input_tokens_details.cached_tokens >= resp.usage.input_tokens // 2


def test_streamed_function_calls_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "input": "weather?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    streamed = events[-1].response.output
    assert [(i.type, i.name, i.arguments) for i in streamed] == [
        (i.type, i.name, i.arguments) for i in whole.output
    ]
    for index, item in enumerate(streamed):
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.output_index == index
        ]
        assert "".join(deltas) == item.arguments
        check_weather(item.arguments)
    with client.responses.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [i.arguments for i in final.output] == [i.arguments for i in whole.output]


def test_a_named_tool_choice_completes_with_its_call(client: openai.OpenAI) -> None:
    """Chat finishes a forced call "stop" (not "tool_calls"); the Responses status reads only "length", so
    the response and its streamed final event stay completed with the call as a completed function_call."""
    kw = {
        "model": MODEL,
        "input": "weather?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.incomplete_details is None
    [call] = whole.output
    assert (call.type, call.status, call.name) == ("function_call", "completed", "get_weather")
    check_weather(call.arguments)
    events = list(client.responses.create(**kw, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.status == "completed"
    assert [(i.type, i.name) for i in events[-1].response.output] == [("function_call", "get_weather")]


def test_a_forced_call_cut_before_its_name_is_an_incomplete_function_call(client: openai.OpenAI) -> None:
    """max_output_tokens ends a required call inside ``<tool_call>``: the response's output was a message
    whose text was the call syntax (an audit with openai-node, 2026-11-30); it is the one callable tool's
    call, incomplete, streamed and not."""
    kw = {
        "model": MODEL,
        "input": "weather?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "temperature": 0,
    }
    whole = client.responses.create(**kw, max_output_tokens=3)
    assert whole.status == "incomplete" and whole.output_text == ""
    assert [(i.type, i.name, i.arguments, i.status) for i in whole.output] == [
        ("function_call", "get_weather", "", "incomplete")
    ]
    events = list(client.responses.create(**kw, max_output_tokens=3, stream=True))
    assert "response.output_text.delta" not in [e.type for e in events]
    final = events[-1].response
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", "get_weather", "")]


def test_allowed_tools_restricts_the_calls_and_is_echoed(client: openai.OpenAI) -> None:
    """``allowed_tools`` (pydantic-ai's OpenAIResponsesModel restricts a run with it): it was refused by
    type; the calls are of the allowed function only, and the response repeats the choice."""
    alarm = {
        **WEATHER,
        "name": "set_alarm",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}},
    }
    choice = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "set_alarm"}],
    }
    resp = client.responses.create(
        model=MODEL, input="weather?", tools=[WEATHER, alarm], tool_choice=choice, temperature=0
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and {c.name for c in calls} == {"set_alarm"}
    assert resp.tool_choice.type == "allowed_tools" and resp.tool_choice.mode == "required"


def test_a_tool_whose_parameters_refer_to_their_own_defs_is_called(client: openai.OpenAI) -> None:
    """The Agents SDK's ``@function_tool`` with a pydantic argument: ``$defs`` and a ``$ref`` (a 400 before)."""
    city = {
        "properties": {"unit": UNIT},
        "required": ["unit"],
        "type": "object",
        "additionalProperties": False,
    }
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "$defs": {"City": city},
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    }
    resp = client.responses.create(
        model=MODEL,
        input="weather?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    [call] = resp.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]["unit"] in UNIT["enum"]


def test_text_format_json_schema_gives_schema_valid_text(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"unit": UNIT, "ok": {"type": "boolean"}},
        "required": ["unit", "ok"],
    }
    resp = client.responses.create(
        model=MODEL,
        input="weather?",
        text={"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}},
        temperature=0,
    )
    data = json.loads(resp.output_text)
    assert set(data) == {"unit", "ok"} and data["unit"] in UNIT["enum"]
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "w"


def test_langchain_with_use_responses_api(client: openai.OpenAI) -> None:
    """LangChain's ``ChatOpenAI(use_responses_api=True)``: text, tool calls (streamed too) and a follow-up
    that sends the call back as ``function_call`` and ``function_call_output`` items."""
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    messages = pytest.importorskip("langchain_core.messages")

    def get_weather(unit: Literal["celsius", "fahrenheit"], days: int) -> str:
        """Weather now."""
        return "sunny"

    def llm(max_tokens: int) -> Any:
        return chat_openai(
            model=MODEL,
            base_url=str(client.base_url),
            api_key="x",
            use_responses_api=True,
            temperature=0,
            max_tokens=max_tokens,
        )

    text = llm(6).invoke("hello")
    assert text.response_metadata["status"] == "incomplete" and text.usage_metadata["output_tokens"] == 6
    tools = llm(160).bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False)
    call = tools.invoke("weather?")
    [tool_call] = call.tool_calls
    assert tool_call["name"] == "get_weather" and tool_call["args"]["unit"] in UNIT["enum"]
    streamed = list(tools.stream("weather?"))
    whole = streamed[0]
    for piece in streamed[1:]:
        whole = whole + piece
    assert [c["args"] for c in whole.tool_calls] == [tool_call["args"]]
    follow = (
        llm(6)
        .bind_tools([get_weather])
        .invoke(
            [
                messages.HumanMessage("weather?"),
                call,
                messages.ToolMessage("sunny", tool_call_id=tool_call["id"]),
            ]
        )
    )
    assert follow.response_metadata["status"] == "incomplete" and follow.text
