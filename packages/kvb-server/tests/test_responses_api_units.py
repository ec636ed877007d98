"""The Responses translator's parts without a server: request to chat, chat results (tool calls included) to
output items and stream events, and the bounded, per-key store."""

from __future__ import annotations

from typing import Any

import pytest

from kvb_server.errors import InvalidParameterError
from kvb_server.responses_api.build import ResponseEnvelope, assistant_message, output_items
from kvb_server.responses_api.convert import responses_error, to_chat
from kvb_server.responses_api.events import StreamTranslator
from kvb_server.responses_api.objects import ResponseObject, ResponseStreamEvent
from kvb_server.responses_api.schemas import ResponsesRequest
from kvb_server.responses_api.store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_tools_tool_choice_and_text_format_become_chat_fields() -> None:
    chat = to_chat(
        request(
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,
            text={
                "format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}
            },
            max_output_tokens=7,
        )
    ).request
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert chat.max_completion_tokens == 7 and chat.stream is False
    assert to_chat(request(text={"format": {"type": "json_object"}})).request.response_format == {
        "type": "json_object"
    }
    # Without tools, 'auto'/'none' mean nothing to send.
    plain = to_chat(request(tool_choice="auto", parallel_tool_calls=True)).request
    assert plain.tools is None and plain.tool_choice is None and plain.parallel_tool_calls is None
    assert to_chat(request(stream=True)).request.stream_options.include_usage is True


def test_function_calls_and_outputs_become_tool_messages() -> None:
    t = to_chat(
        request(
            instructions="Sys.",
            input=[
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
                {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": "{}"},
            ],
        )
    )  # fmt: skip
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        for i, args in ((1, '{"city":"Paris"}'), (2, '{"city":"Rome"}'), (3, "{}"))
    ]
    assert list(t.conversation) == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls[:2]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": calls[2:]},
    ]
    # Instructions lead the chat messages but are not part of the stored conversation.
    assert t.request.messages[0].role == "system" and t.request.messages[0].content == "Sys."
    assert len(t.request.messages) == len(t.conversation) + 1


def test_inherited_conversation_comes_first_and_is_not_mutated() -> None:
    inherited = ({"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": []})
    t = to_chat(
        request(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]), inherited
    )
    assert t.conversation[:2] == inherited and t.conversation[0] is inherited[0]
    assert inherited[1]["tool_calls"] == []  # a new assistant message, not appended to the stored one
    assert t.conversation[2]["tool_calls"][0]["id"] == "c"


def test_tool_choice_naming_an_undeclared_function_is_refused() -> None:
    with pytest.raises(InvalidParameterError) as err:
        to_chat(request(tools=[WEATHER], tool_choice={"type": "function", "name": "other"}))
    assert err.value.param == "tool_choice"


def test_chat_parameter_names_are_renamed_in_errors() -> None:
    exc = responses_error(InvalidParameterError("Reduce the prompt or max_tokens.", param="max_tokens"))
    assert exc.param == "max_output_tokens" and "max_output_tokens" in exc.message
    assert responses_error(InvalidParameterError("x", param="messages")).param == "input"
    assert responses_error(InvalidParameterError("x", param="response_format")).param == "text.format"
    assert responses_error(InvalidParameterError("x", param="temperature")).param == "temperature"
    nested = responses_error(
        InvalidParameterError("tools[1].function.parameters: bad", param="tools[1].function.parameters")
    )
    assert nested.param == "tools[1].parameters" and nested.message == "tools[1].parameters: bad"
    schema = responses_error(InvalidParameterError("x", param="response_format.json_schema.schema"))
    assert schema.param == "text.format.schema"
    assert responses_error(InvalidParameterError("x", param="messages[3].content")).param == "input"


def test_chat_message_with_tool_calls_becomes_function_call_items() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
            {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    items = output_items(message, "tool_calls")
    assert [(i["type"], i["call_id"], i["name"], i["arguments"], i["status"]) for i in items] == [
        ("function_call", "call_a", "f", '{"x":1}', "completed"),
        ("function_call", "call_b", "g", "{}", "completed"),
    ]
    assert all(i["id"].startswith("fc_") for i in items)
    # Stored for a follow-up: the same assistant turn the chat route produced.
    assert assistant_message(items) == {
        "role": "assistant",
        "content": None,
        "tool_calls": message["tool_calls"],
    }
    text_and_call = output_items({**message, "content": "Let me check."}, "tool_calls")
    assert [i["type"] for i in text_and_call] == ["message", "function_call", "function_call"]
    truncated = output_items({"role": "assistant", "content": "abc"}, "length")
    assert truncated[0]["status"] == "incomplete"
    # A call cut before its arguments began (blank) or inside them stays out of the stored history: no tool
    # message can answer it, and every previous_response_id follow-up was a 400. Blank arguments of a
    # completed call (a function without parameters) stay.
    for cut in ("", '{"city":"'):
        calls = [{"id": "call_c", "type": "function", "function": {"name": "f", "arguments": cut}}]
        items = output_items({"role": "assistant", "content": None, "tool_calls": calls}, "length")
        assert items[-1]["status"] == "incomplete" and "tool_calls" not in assistant_message(items)
    blank = [{"id": "call_d", "type": "function", "function": {"name": "f", "arguments": ""}}]
    done = output_items({"role": "assistant", "content": None, "tool_calls": blank}, "tool_calls")
    assert assistant_message(done)["tool_calls"][0]["id"] == "call_d"
    assert output_items({"role": "assistant", "content": ""}, "stop")[0]["content"][0]["text"] == ""


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}


def run(payloads: list[dict[str, Any]], **fields: Any) -> tuple[list[dict[str, Any]], StreamTranslator]:
    translator = StreamTranslator(ResponseEnvelope.new(request(**fields)))
    events = translator.start()
    for payload in payloads:
        events += translator.feed(payload)
        if translator.failed:
            break
    else:
        events += translator.final().events
    for e in events:
        ResponseStreamEvent.model_validate(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, translator


def test_streamed_tool_calls_become_function_call_events() -> None:
    payloads = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "On it."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
        chunk(finish="tool_calls"),
        USAGE,
    ]  # fmt: skip
    events, translator = run(payloads, tools=[WEATHER])
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    added = events[8]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress" and added["arguments"] == ""
    assert (added["call_id"], added["name"]) == ("call_a", "f")
    assert events[11]["arguments"] == '{"x":1}' and events[11]["item_id"] == added["id"]
    final = events[-1]["response"]
    ResponseObject.model_validate(final)
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][1]["arguments"] == '{"x":1}' and final["output"][2]["call_id"] == "call_b"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 8
    assert final["tools"][0]["name"] == "get_weather"
    assert assistant_message(translator.output)["tool_calls"][0]["function"]["arguments"] == '{"x":1}'


def test_empty_generation_still_yields_a_message_item() -> None:
    events, _ = run([chunk({"role": "assistant", "content": ""}), chunk(finish="stop"), USAGE])
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == ""


def test_truncated_stream_ends_incomplete() -> None:
    events, _ = run([chunk({"content": "ab"}), chunk({"content": "c"}), chunk(finish="length"), USAGE])
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["completed_at"] is None
    assert final["output"][0]["content"][0]["text"] == "abc"


def test_error_payload_ends_the_stream_with_error_then_failed() -> None:
    error = {"error": {"message": "boom", "type": "server_error", "param": "max_tokens", "code": None}}
    events, translator = run([chunk({"content": "ab"}), error])
    assert translator.failed
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "boom" and events[-2]["param"] == "max_output_tokens"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    # The message being streamed is closed (incomplete) before the failure, and the failed response holds
    # it: it was left open and the output empty (an audit, 2026-11-30).
    types = [e["type"] for e in events]
    assert types[-5:-2] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [(i["type"], i["status"]) for i in events[-1]["response"]["output"]] == [("message", "incomplete")]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "ab"


def test_a_failed_responses_error_code_is_one_the_sdk_types_allow() -> None:
    """The chat error's own code (``timeout``) failed the SDK's ``ResponseError`` validation."""
    from openai.types.responses import ResponseFailedEvent

    error = {"error": {"message": "took too long", "type": "timeout_error", "param": None, "code": "timeout"}}
    events, _ = run([chunk({"content": "ab"}), error])
    assert events[-2]["code"] == "timeout"  # the error event keeps it
    assert events[-1]["response"]["error"]["code"] == "server_error"
    ResponseFailedEvent.model_validate(events[-1])  # raises on a code outside OpenAI's list


def stored(i: int, text: str = "x") -> dict[str, Any]:
    return {"id": f"resp_{i}", "output": [], "text": text}


def test_store_is_an_lru_bounded_in_entries_and_characters() -> None:
    store = ResponseStore(max_entries=3)
    for i in range(3):
        store.put(None, stored(i), ({"role": "user", "content": str(i)},))
    assert store.get(None, "resp_0") is not None  # now the most recently used
    store.put(None, stored(3), ())
    assert store.get(None, "resp_1") is None and len(store) == 3
    assert store.get(None, "resp_0").conversation == ({"role": "user", "content": "0"},)
    small = ResponseStore(max_chars=1000)
    small.put(None, stored(0, "a" * 400), ())
    small.put(None, stored(1, "b" * 400), ())
    small.put(None, stored(2, "c" * 400), ())
    assert small.get(None, "resp_0") is None and small.get(None, "resp_2") is not None
    with pytest.raises(ValueError, match="max_entries"):
        ResponseStore(max_entries=0)


def test_store_entries_belong_to_their_api_key() -> None:
    store = ResponseStore()
    store.put("salt-a", stored(1), ())
    assert store.get("salt-b", "resp_1") is None and store.get(None, "resp_1") is None
    assert not store.delete("salt-b", "resp_1")
    assert store.delete("salt-a", "resp_1") and store.get("salt-a", "resp_1") is None


def _call(arguments: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_a_stored_call_cut_off_mid_arguments_does_not_block_follow_ups() -> None:
    # A stream stopped at max_output_tokens inside a call's arguments stored '{"city":"'; every
    # previous_response_id follow-up was then the chat route's 400 on 'messages[1].tool_calls[0]...'.
    cut = {"role": "assistant", "content": None, "tool_calls": [_call('{"city":"')]}
    both = {"role": "assistant", "content": "x", "tool_calls": [_call('{"city":"Paris"}'), _call("{")]}
    inherited = ({"role": "user", "content": "Weather?"}, cut, both)
    t = to_chat(request(input="ok", tools=[WEATHER]), inherited)
    _user, first, second, new = t.request.messages
    assert (first.content, first.tool_calls) == ("", None)
    assert [c["function"]["arguments"] for c in second.tool_calls] == ['{"city":"Paris"}']
    assert new.content == "ok"
    # Stored messages are shared between responses: they are left as they were.
    assert cut["tool_calls"] and len(both["tool_calls"]) == 2


@pytest.mark.parametrize("status", [None, "incomplete"])
def test_a_function_call_item_with_arguments_that_are_not_json_names_its_input_item(
    status: str | None,
) -> None:
    item = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"'}
    if status:
        item["status"] = status
    with pytest.raises(InvalidParameterError) as info:
        to_chat(request(input=[{"role": "user", "content": "x"}, item], tools=[WEATHER]))
    assert info.value.param == "input[1].arguments"
    assert ("max_output_tokens" in info.value.message) == (status == "incomplete")
    # Blank arguments are no arguments, as on the chat route.
    to_chat(request(input=[{"role": "user", "content": "x"}, {**item, "arguments": " "}], tools=[WEATHER]))


def test_function_call_output_items_dumped_by_the_sdk_are_accepted_as_input() -> None:
    # model_dump(by_alias=True) of the SDK's ResponseFunctionToolCall adds async, caller and namespace
    # (null): a 400 naming input[1].async, although the item came from this server's own output.
    from openai.types.responses import ResponseFunctionToolCall

    call = ResponseFunctionToolCall(
        type="function_call", id="fc_1", call_id="call_1", name="get_weather", arguments='{"city":"Paris"}'
    )
    dumped = call.model_dump(by_alias=True)
    assert {"async", "caller", "namespace"} <= dumped.keys()
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    chat = to_chat(request(input=[{"role": "user", "content": "x"}, dumped, output], tools=[WEATHER])).request
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
