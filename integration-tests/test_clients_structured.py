"""Structured outputs and tool calling through the real client libraries against ``kvboost-server`` (SmolLM2).

The openai SDK, LangChain (``langchain-openai``), Instructor and LlamaIndex (``OpenAILike``), each driving
``/v1/chat/completions`` on the embedded SmolLM2-135M-Instruct exactly as they would drive OpenAI. What is
asserted is what constrained decoding guarantees: every structured answer parses and validates against the
schema the client sent (``jsonschema`` and the client's own pydantic parsing); never that a 135M model's
answer is right. Greedy (temperature 0) throughout, so streamed and non-streamed calls must agree.

The request bodies each client method sends are listed in docs/structured.md ("Clients"). A client whose
package is missing is skipped. ``llama_index.llms.openai.OpenAI`` is not used: it refuses model names it does
not know (``ValueError: Unknown model`` from its context-window table) before sending anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from conftest import server_process
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason='needs pip install "kvb-cache[structured]"')

MODEL = "smollm2-135m"
#: Per request; the values are bounded (maxLength, ranges, enums) so a reply never needs more.
MAX_TOKENS = 96
TEXT = "Maria Lopez is a 34-year-old engineer who lives in Madrid."


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=130)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": WEATHER_PARAMS,
        "strict": True,
    },
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
EXTRACT = [{"role": "user", "content": f"Extract the person from this text as JSON: {TEXT}"}]
#: ``json_object`` only guarantees *a* JSON object: shown the keys, SmolLM2 fills them in (without them it
#: copies the JSON schema that instructor's JSON mode puts in the system prompt).
EXTRACT_KEYS = [
    {"role": "user", "content": f'Text: {TEXT} Return {{"name": "<her name>", "age": <her age>}}.'}
]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    flags = ("--model", MODEL, "--max-tokens", "128", "--chunk-size", "32", "--log-level", "warning")
    with server_process("kvb_server", *flags) as url:
        yield url


@pytest.fixture()
def client(server_url: str) -> Any:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=300)


def assert_weather_args(arguments: str | dict) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, WEATHER_PARAMS)
    GetWeather.model_validate(args)


def assert_calls_finished(finish_reason: str, completion_tokens: int, *, named: bool = False) -> None:
    """Parallel calls stay on (the clients' default) and the reply still ends after its calls: the
    system-prompt format has no newline between calls, which SmolLM2 otherwise took to repeat its call.
    A call forced by a named tool_choice finishes "stop" (as on OpenAI and vLLM)."""
    assert finish_reason == ("stop" if named else "tool_calls") and completion_tokens < MAX_TOKENS


# --- openai SDK ---------------------------------------------------------------------------------------------


def test_openai_json_schema_response_format(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=EXTRACT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
        },
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


def test_openai_json_object_response_format(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=EXTRACT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_openai_tools_required(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    choice = resp.choices[0]
    assert_calls_finished(choice.finish_reason, resp.usage.completion_tokens)
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert call.function.name == "get_weather"
        assert_weather_args(call.function.arguments)


def test_openai_named_tool_choice_is_one_call(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        tools=[
            WEATHER_TOOL,
            {"type": "function", "function": {"name": "person", "parameters": PERSON_SCHEMA}},
        ],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert resp.choices[0].finish_reason == "stop"  # a forced call, as OpenAI and vLLM answer
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert_weather_args(call.function.arguments)


def test_openai_tool_choice_auto_is_text_or_valid_calls(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        parallel_tool_calls=False,
    )
    choice = resp.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert_weather_args(call.function.arguments)
    else:
        assert choice.message.content and not choice.message.content.startswith("<tool_call>")


def test_openai_completions_json_schema(client) -> None:
    # The SDK's completions.create has no response_format argument; extra_body sends it all the same.
    resp = client.completions.create(
        model=MODEL,
        prompt=f"{TEXT}\nThe person as JSON:",
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON_SCHEMA}}
        },
    )
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].text), PERSON_SCHEMA)


def test_openai_parse_pydantic_response_format(client) -> None:
    resp = client.chat.completions.parse(
        model=MODEL, messages=EXTRACT, temperature=0, max_tokens=MAX_TOKENS, response_format=Person
    )
    assert isinstance(resp.choices[0].message.parsed, Person)


def test_openai_parse_pydantic_function_tool(client) -> None:
    resp = client.chat.completions.parse(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
    )
    (call,) = resp.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_openai_streamed_tool_calls_equal_non_streamed(client) -> None:
    request = {
        "model": MODEL,
        "messages": WEATHER_QUESTION,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "tools": [openai.pydantic_function_tool(GetWeather)],
        "tool_choice": "required",
    }
    full = client.chat.completions.parse(**request).choices[0]
    expected = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]

    # The SDK's stream helper: accumulates the deltas and parses the arguments.
    with client.chat.completions.stream(**request) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected
    assert [(e.name, e.arguments) for e in done] == expected
    assert all(isinstance(e.parsed_arguments, GetWeather) for e in done)
    assert final.finish_reason == full.finish_reason == "tool_calls"

    # Raw chunks, accumulated by hand as OpenAI streams them: the first delta of a call carries its id,
    # type and name; later deltas carry only the index and pieces of the arguments.
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert finish == "tool_calls"


def test_openai_tool_result_in_history(client) -> None:
    first = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_tokens=MAX_TOKENS,
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    (call,) = first.choices[0].message.tool_calls
    history = [
        *WEATHER_QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=history, temperature=0, max_tokens=24, tools=[WEATHER_TOOL], tool_choice="none"
    ).choices[0]
    assert second.message.tool_calls is None
    assert second.finish_reason in ("stop", "length") and second.message.content


# --- LangChain ----------------------------------------------------------------------------------------------


@pytest.fixture()
def chat_model(server_url: str) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        base_url=f"{server_url}/v1",
        api_key="none",
        model=MODEL,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=300,
    )


@pytest.fixture()
def weather_tool() -> Any:
    tools = pytest.importorskip("langchain_core.tools")

    @tools.tool(args_schema=GetWeather)
    def get_weather(city: str, unit: str) -> str:
        """Get the current weather in a city."""
        return f"21 degrees {unit} in {city}"

    return get_weather


@pytest.mark.parametrize("tool_choice", ["required", "any", "get_weather"])
def test_langchain_bind_tools(chat_model, weather_tool, tool_choice: str) -> None:
    message = chat_model.bind_tools([weather_tool], tool_choice=tool_choice).invoke(
        WEATHER_QUESTION[0]["content"]
    )
    assert message.tool_calls and not message.invalid_tool_calls
    for call in message.tool_calls:
        assert call["name"] == "get_weather" and call["id"]
        assert_weather_args(call["args"])
    assert_calls_finished(
        message.response_metadata["finish_reason"],
        message.usage_metadata["output_tokens"],
        named=tool_choice == "get_weather",
    )
    if tool_choice == "get_weather":  # a named choice forces exactly one call
        assert len(message.tool_calls) == 1


def test_langchain_streamed_tool_calls_equal_invoke(chat_model, weather_tool) -> None:
    bound = chat_model.bind_tools([weather_tool], tool_choice="required")
    invoked = bound.invoke(WEATHER_QUESTION[0]["content"])
    merged = None
    for chunk in bound.stream(WEATHER_QUESTION[0]["content"]):
        merged = chunk if merged is None else merged + chunk
    strip = [{"name": c["name"], "args": c["args"]} for c in invoked.tool_calls]
    assert [{"name": c["name"], "args": c["args"]} for c in merged.tool_calls] == strip


def test_langchain_tool_message_round_trip(chat_model, weather_tool) -> None:
    messages = pytest.importorskip("langchain_core.messages")
    history: list[Any] = [messages.HumanMessage(WEATHER_QUESTION[0]["content"])]
    ai = chat_model.bind_tools([weather_tool], tool_choice="get_weather").invoke(history)
    history += [ai, messages.ToolMessage("21 degrees celsius, sunny", tool_call_id=ai.tool_calls[0]["id"])]
    answer = chat_model.bind_tools([weather_tool], tool_choice="none").invoke(history)
    assert not answer.tool_calls and isinstance(answer.content, str) and answer.content


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_langchain_with_structured_output(chat_model, method: str) -> None:
    structured = chat_model.with_structured_output(Person, method=method, include_raw=True)
    prompt = f"Extract the person from this text. Answer in JSON with keys name and age. Text: {TEXT}"
    result = structured.invoke(prompt)
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Person)


# --- Instructor ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["JSON", "TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(client, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(client, mode=instructor.Mode[mode])
    person = patched.chat.completions.create(
        model=MODEL,
        messages=EXTRACT_KEYS,
        response_model=Person,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,  # no second chance: the first answer must validate
        strict=False,  # pydantic's lax mode: json_object does not type the values ("34" for an int)
    )
    assert isinstance(person, Person)


# --- LlamaIndex ---------------------------------------------------------------------------------------------


@pytest.fixture()
def llama_llm(server_url: str) -> Any:
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    return openai_like.OpenAILike(
        model=MODEL,
        api_base=f"{server_url}/v1",
        api_key="none",
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=8192,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=300,
    )


def test_llamaindex_structured_predict(llama_llm) -> None:
    prompts = pytest.importorskip("llama_index.core.prompts")
    template = prompts.PromptTemplate("Extract the person from this text: {text}")
    assert isinstance(llama_llm.structured_predict(Person, template, text=TEXT), Person)


def test_llamaindex_as_structured_llm(llama_llm) -> None:
    llms = pytest.importorskip("llama_index.core.llms")
    response = llama_llm.as_structured_llm(Person).chat([llms.ChatMessage(role="user", content=TEXT)])
    assert isinstance(response.raw, Person)
    Person.model_validate_json(response.message.content)


def test_llamaindex_chat_with_tools(llama_llm) -> None:
    tools = pytest.importorskip("llama_index.core.tools")

    def get_weather(city: str, unit: str) -> str:
        return f"21 degrees {unit} in {city}"

    tool = tools.FunctionTool.from_defaults(
        fn=get_weather, name="get_weather", description=GetWeather.__doc__, fn_schema=GetWeather
    )
    response = llama_llm.chat_with_tools([tool], user_msg=WEATHER_QUESTION[0]["content"], tool_required=True)
    selections = llama_llm.get_tool_calls_from_response(response)
    assert selections and all(s.tool_name == "get_weather" for s in selections)
    for selection in selections:
        assert_weather_args(selection.tool_kwargs)
