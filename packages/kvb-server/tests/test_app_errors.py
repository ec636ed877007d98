"""Error paths over real HTTP: 400/401/404/413/503/504 bodies in OpenAI's shape, cancellation on disconnect."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import serve
from fakes import FakeEngine

from kvb_server import AdmissionDecision, AdmissionRequest, ServerConfig, create_app
from kvb_server.schemas.generation_requests import ChatMessage
from kvb_server.tool_calls.history import check_tool_history

MODEL = "fake-model"


def wait_until(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture()
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def url(fake: FakeEngine) -> Iterator[str]:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100))) as base:
        yield base


def post(url: str, path: str, body: object | bytes, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(url + path, json=body, **kw)


def assert_openai_error(
    resp: httpx.Response, status: int, *, param: str | None = None, code: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_malformed_json_is_400(url: str) -> None:
    assert_openai_error(post(url, "/v1/completions", b'{"model": "fake-model", "prompt": '), 400)
    assert_openai_error(post(url, "/v1/chat/completions", b"[1, 2]"), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": "10"}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "prompt": 5}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "hi", "presence_penalty": -3}, "presence_penalty"),
        ({"model": MODEL, "prompt": "hi", "stop": ["a"] * 65}, "stop"),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop[0]"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),  # --max-logprobs 20
        ({"model": MODEL, "prompt": "hi", "bogus_param": 1}, "bogus_param"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": 5, "prompt": "hi"}, "model"),
        ({"model": MODEL, "prompt": "x" * 150, "max_tokens": 80}, "max_tokens"),  # 150 + 80 > context 200
    ],
)
def test_invalid_completion_parameters_are_400_naming_the_parameter(url: str, body: dict, param: str) -> None:
    assert_openai_error(post(url, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x" * 150, "max_tokens": 80}, "max_tokens"),  # 150 + 80 > 200
        ("/v1/completions", {"prompt": "x" * 250}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 150}], "max_tokens": 80},
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 250}]}, "messages"),
        ("/v1/responses", {"input": "x" * 150, "max_output_tokens": 80}, "max_output_tokens"),
        # Beyond the window but above --max-tokens (100): checked before the clamp, as vLLM checks it.
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100000},
            "max_completion_tokens",
        ),
        ("/v1/responses", {"input": "x", "max_output_tokens": 100000}, "max_output_tokens"),
    ],
)
def test_context_window_overflow_is_context_length_exceeded(
    url: str, path: str, body: dict, param: str
) -> None:
    """OpenAI's code (and what docs/server.md promised) for a prompt, or prompt plus max_tokens, beyond the
    context window; the check before queueing answered it with ``code: null``."""
    assert_openai_error(
        post(url, path, {"model": MODEL, **body}), 400, param=param, code="context_length_exceeded"
    )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_min_tokens_above_the_budget_names_the_request_fields(url: str, path: str) -> None:
    """The engine's check said ``max_new_tokens=2``, a name no client sends."""
    body = {"model": MODEL, "max_tokens": 2, "min_tokens": 5}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    err = assert_openai_error(post(url, path, body), 400, param="min_tokens")
    assert "max_new_tokens" not in err["message"] and "max_tokens" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**63), ("top_k", 1e308), ("repetition_penalty", 1e-308), ("repetition_penalty", 1e308)],
)
def test_sampling_values_the_batched_sampler_cannot_hold_are_400(
    url: str, fake: FakeEngine, path: str, field: str, value: float
) -> None:
    """Accepted, each failed the engine step (int64 overflow; NaN probabilities), and with it every request
    decoding beside it: one client could end everybody's streams."""
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert_openai_error(post(url, path, body), 400, param=field)
    assert not fake.added


def test_a_budget_within_the_window_is_clamped_to_the_server_cap(url: str, fake: FakeEngine) -> None:
    """Only a budget the window cannot hold is refused: one that fits is still served at ``--max-tokens``
    (100 here), the operator's cap, as vLLM caps a request by its generation config."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 150}
    resp = post(url, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert fake.added[-1].params.max_new_tokens == 100


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (  # a $ref chain past the grammar library's stack: it crashed the server (an audit, 2026-11-30)
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "$defs": {
                                **{
                                    f"d{i}": {
                                        "type": "object",
                                        "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}},
                                    }
                                    for i in range(1000)
                                },
                                "d1000": {"type": "integer"},
                            },
                            "$ref": "#/$defs/d0",
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"service_tier": "turbo"}, "service_tier"),
        ({"verbosity": "loud"}, "verbosity"),
        ({"prompt_cache_key": 3}, "prompt_cache_key"),
        ({"safety_identifier": "x" * 129}, "safety_identifier"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"logit_bias": {"\u00b2": 5}}, "logit_bias"),  # "²": str.isdigit() but not int(): was a 500
        ({"logit_bias": {"\uff14\uff12": 5}}, "logit_bias"),  # full-width "42"
        ({"logit_bias": {"1": 500}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",  # the full path, as the schema's own errors name it
        ),
    ],
)
def test_unsupported_or_invalid_chat_features_are_400(url: str, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    err = assert_openai_error(post(url, "/v1/chat/completions", body), 400, param=param)
    assert err["type"] == "invalid_request_error"


def test_openai_client_raises_bad_request_with_param(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "xml"},  # type: ignore[arg-type]
        )
    assert info.value.param == "response_format.type"


def test_openai_chat_hints_are_accepted_and_service_tier_is_echoed(url: str) -> None:
    """service_tier, prompt_cache_key, prompt_cache_retention, safety_identifier and verbosity are OpenAI chat
    parameters the SDK sends when set: accepted (they change nothing here), and a named tier is answered
    with ``"default"``, the only one, in the completion and every chunk; without one it is null."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    kwargs: dict = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        service_tier="flex",
        prompt_cache_key="agent-1",
        prompt_cache_retention="24h",
        safety_identifier="user-1",
        verbosity="low",
    )
    resp = client.chat.completions.create(**kwargs)
    assert resp.service_tier == "default" and resp.choices[0].message.content
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks and all(c.service_tier == "default" for c in chunks)
    plain = post(url, "/v1/chat/completions", {**kwargs, "service_tier": None}).json()
    assert plain["service_tier"] is None
    completion = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).json()
    assert "service_tier" not in completion  # OpenAI's text_completion has no such field


def test_unknown_model_is_404_in_openai_shape(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi")
    assert info.value.code == "model_not_found"
    assert_openai_error(httpx.get(url + "/v1/models/gpt-9"), 404, code="model_not_found")
    assert_openai_error(httpx.get(url + "/v1/nope"), 404)


def test_an_openai_route_not_served_says_so_by_name(url: str) -> None:
    """LangChain's ``OpenAIEmbeddings`` posts to ``/v1/embeddings``: the 404 says embeddings are not
    served here (it said "Unknown route", which reads like a wrong base URL)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model=MODEL, input="hi")
    assert "is not served" in str(info.value) and "not embeddings" in str(info.value)
    assert "/v1/chat/completions" in str(info.value)  # what is served instead
    err = assert_openai_error(post(url, "/v1/moderations", {"input": "hi"}), 404)
    assert err["type"] == "invalid_request_error" and "not moderations" in err["message"]
    err = assert_openai_error(post(url, "/v1/audio/transcriptions", {}), 404)
    assert "not audio" in err["message"]
    # A route nobody has is still unknown, and the served routes still answer.
    assert "Unknown route GET /v1/nope" in assert_openai_error(httpx.get(url + "/v1/nope"), 404)["message"]
    assert "Unknown route" in assert_openai_error(httpx.get(url + "/v1/embeddingsx"), 404)["message"]
    assert post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_sdk_routes_under_served_prefixes_say_why_they_are_not_served(url: str) -> None:
    """openai-node's ``chat.completions.list/retrieve``, ``responses.cancel/compact`` and ``models.delete``
    got a bare "Method Not Allowed" or "Unknown route" (an audit with JavaScript clients, 2026-11-30)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.list()
    assert info.value.status_code == 405 and "stored chat completions are not kept" in str(info.value)
    with pytest.raises(openai.NotFoundError, match="stored chat completions are not kept"):
        client.chat.completions.retrieve("chatcmpl-x")
    with pytest.raises(openai.NotFoundError, match="only background responses can be cancelled"):
        client.responses.cancel("resp_x")
    err = assert_openai_error(post(url, "/v1/responses/compact", {"model": MODEL, "input": "hi"}), 405)
    assert "does not compact responses" in err["message"]
    err = assert_openai_error(httpx.delete(url + "/v1/models/x"), 405)
    assert "cannot be deleted" in err["message"]
    # Another method on a served route is still a plain 405.
    assert "Method Not Allowed" in assert_openai_error(httpx.get(url + "/v1/completions"), 405)["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ],
)
def test_a_missing_name_is_a_missing_required_parameter(url: str, extra: dict, param: str) -> None:
    """OpenAI's wording; the message read "Invalid value ...: None" (Python's word for missing)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    err = assert_openai_error(post(url, "/v1/chat/completions", body), 400)
    assert err["message"] == f"Missing required parameter: '{param}'." and err["param"] == param


def test_model_left_out_is_the_first_served_one(url: str) -> None:
    """vLLM serves a body without ``model`` with its (first) model; OpenAI's SDK always sends one."""
    chat = post(
        url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == MODEL
    completion = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True})
    assert completion.status_code == 200 and f'"model":"{MODEL}"' in completion.text
    assert_openai_error(post(url, "/v1/completions", {"model": None, "prompt": "hi"}), 400, param="model")


def test_text_parts_in_chat_content_are_joined_by_newlines(url: str, fake: FakeEngine) -> None:
    """As vLLM joins them: joined with nothing, "...the document." + "Question" would run together."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        "max_tokens": 3,
    }
    resp = post(url, "/v1/chat/completions", body)
    assert resp.status_code == 200
    # Fake chat template: "<user>a\nb<assistant>"
    assert fake.added[-1].prompt == list(map(ord, "<user>a\nb<assistant>"))
    missing_text = {**body, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    err = assert_openai_error(
        post(url, "/v1/chat/completions", missing_text), 400, param="messages[0].content[0].text"
    )
    assert "messages[0].content[0].text" in err["message"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "system"}, {"role": "user", "content": "hi"}],
        [{"role": "developer"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c"}],
    ],
)
def test_a_message_without_content_is_a_400_naming_it(url: str, messages: list[dict]) -> None:
    """OpenAI requires content in every message but an assistant turn with tool_calls (or a refusal); left
    out, it was rendered as an empty turn the client never meant to send."""
    at = next(i for i, m in enumerate(messages) if m.get("content") is None)
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    err = assert_openai_error(post(url, "/v1/chat/completions", body), 400, param=f"messages[{at}].content")
    assert f"Missing required parameter: 'messages[{at}].content'" in err["message"]


def _call(call_id: str | None) -> dict:
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    return call if call_id is None else {"id": call_id, **call}


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        # a tool result no call asked for
        (
            [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}],
            "messages[1].role",
            "must be a response to a preceding message with 'tool_calls'",
        ),
        # a result answering another id than the call's
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [_call("c1")]},
                {"role": "tool", "tool_call_id": "c2", "content": "x"},
            ],
            "messages[2].tool_call_id",
            "'c2' not found in 'tool_calls' of messages[1]",
        ),
        # a call never answered before the conversation goes on, or at its end
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [_call("c1"), _call("c2")]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
                {"role": "user", "content": "and?"},
            ],
            "messages[1].tool_calls",
            "did not have response messages: c2",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [_call("c1")]}],
            "messages[1].tool_calls",
            "did not have response messages: c1",
        ),
        # a tool message after a plain assistant turn (its calls were answered two turns back)
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [_call("c1")]},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
                {"role": "assistant", "content": "done"},
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
            ],
            "messages[4].role",
            "must be a response",
        ),
    ],
)
def test_unpaired_tool_history_is_a_400_naming_the_message(
    url: str, messages: list[dict], param: str, words: str
) -> None:
    """OpenAI refuses a history whose tool calls and tool messages do not pair up; it was rendered as sent
    (the model read results of calls it never made, or calls without results)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    err = assert_openai_error(post(url, "/v1/chat/completions", body), 400, param=param)
    assert words in err["message"]


def test_paired_tool_histories_are_served(url: str) -> None:
    # Calls without ids (some open-model clients) cannot be matched: not checked.
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [_call(None)]},
        {"role": "tool", "tool_call_id": "anything", "content": "1"},
    ]
    resp = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    # Two calls answered in another order, then the conversation goes on (no context here: checked alone).
    answered = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [_call("c1"), _call("c2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": "both done"},
        {"role": "user", "content": "thanks"},
    ]
    check_tool_history([ChatMessage.model_validate(m) for m in answered])


def test_an_empty_list_of_content_parts_is_a_400(url: str) -> None:
    # OpenAI: content must be a string or a non-empty array; [] was served as an empty turn.
    body = {"model": MODEL, "messages": [{"role": "user", "content": []}], "max_tokens": 2}
    err = assert_openai_error(post(url, "/v1/chat/completions", body), 400)
    assert "messages[0].content" in err["param"]


@pytest.mark.parametrize("schema", [{"type": "array", "items": {"type": "integer"}}, {"type": "string"}])
def test_tool_parameters_must_be_an_object_schema(url: str, schema: dict) -> None:
    # OpenAI refuses them; accepted, an array schema made the call's arguments "[1,2,3]".
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 2}
    err = assert_openai_error(
        post(url, "/v1/chat/completions", body), 400, param="tools[0].function.parameters"
    )
    assert "type 'object'" in err["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_tool_parameters_holding_a_non_finite_number_are_a_400(url: str, literal: str) -> None:
    # Python's JSON parser reads these literals; re-serialising the schema raised ValueError, a 500.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minimum": 0}}}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    raw = json.dumps(body).replace('"minimum": 0', f'"minimum": {literal}').encode()
    err = assert_openai_error(
        post(url, "/v1/chat/completions", raw), 400, param="tools[0].function.parameters"
    )
    assert "not a valid JSON schema" in err["message"]


def test_an_assistant_turn_with_tool_calls_may_leave_content_out(url: str) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    resp = post(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_refusals_in_assistant_history_are_its_text(url: str, fake: FakeEngine) -> None:
    """OpenAI's history may hold an assistant refusal (a ``refusal`` part, or the ``refusal`` field of a
    message an OpenAI model returned): it is what the assistant said, rendered as its text as /v1/responses
    renders refusal parts. Only assistants refuse: elsewhere a refusal part is a 400."""
    history = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}],
        },
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": None, "refusal": "never"},
        {"role": "user", "content": "q3"},
    ]
    resp = post(url, "/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    # Fake chat template: "<role>content" per message.
    expected = "<user>q<assistant>a\nno<user>q2<assistant>never<user>q3<assistant>"
    assert fake.added[-1].prompt == list(map(ord, expected))
    for role in ("user", "system", "developer"):
        bad = [
            {"role": role, "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "user", "content": "q"},
        ]
        err = assert_openai_error(
            post(url, "/v1/chat/completions", {"model": MODEL, "messages": bad}),
            400,
            param="messages[0].content[0].type",
        )
        assert (
            "only allowed in assistant messages" in err["message"]
            and "messages[0].content[0]" in err["message"]
        )
    no_text = [{"role": "assistant", "content": [{"type": "refusal"}]}, {"role": "user", "content": "q"}]
    err = assert_openai_error(
        post(url, "/v1/chat/completions", {"model": MODEL, "messages": no_text}),
        400,
        param="messages[0].content[0].refusal",
    )
    assert "'messages[0].content[0].refusal'" in err["message"]


def test_api_key_is_enforced_on_v1_routes_only() -> None:
    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), api_key="s3cret"))) as url:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
        for path in ("/v1/models", "/v1/stats"):
            assert_openai_error(httpx.get(url + path), 401, code="invalid_api_key")
        assert_openai_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_openai_error(post(url, "/v1/warm", {"text": "x"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text == "bc"
        assert fake.warmed == []


def test_gate_refusal_is_413_and_never_queued() -> None:
    class SmallOnly:
        def __init__(self) -> None:
            self.seen: list[AdmissionRequest] = []

        def admit(self, request: AdmissionRequest) -> AdmissionDecision:
            self.seen.append(request)
            if max(request.prompt_tokens) > 10:
                return AdmissionDecision(
                    admitted=False,
                    message="prompt too long for free memory; shorten it",
                    details={"limit_tokens": 10},
                )
            return AdmissionDecision(admitted=True)

    fake, gate = FakeEngine(), SmallOnly()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)), gate=gate)) as url:
        err = assert_openai_error(
            post(url, "/v1/completions", {"model": MODEL, "prompt": "x" * 11}), 413, code="request_too_large"
        )
        assert err["details"] == {"limit_tokens": 10}
        assert fake.added == []
        ok = post(url, "/v1/completions", {"model": MODEL, "prompt": "short", "max_tokens": 4, "n": 2})
        assert ok.status_code == 200
    assert gate.seen[-1].prompt_tokens == (5,)
    assert gate.seen[-1].max_new_tokens == 4
    assert gate.seen[-1].n == 2


def test_queue_full_is_503_then_recovers() -> None:
    """Only requests not running yet count: one running + one waiting fills a queue of one."""
    fake = FakeEngine(max_num_seqs=1)
    fake.pause_before_step = 2  # the first request runs one step, then the engine stalls
    config = ServerConfig(model_names=(MODEL,), max_queue_size=1)
    with serve(create_app(fake, config)) as url:

        async def scenario() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
                running = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.to_thread(wait_until, fake.stalled.is_set)
                assert (await c.get("/health")).json()["queue_depth"] == 0  # running: not counted
                queued = asyncio.create_task(c.post("/v1/completions", json=body))
                while (await c.get("/health")).json()["queue_depth"] < 1:
                    await asyncio.sleep(0.01)
                rejected = await c.post("/v1/completions", json=body)
                assert_openai_error(rejected, 503, code="queue_full")
                assert rejected.headers["retry-after"] == "1"  # the openai SDKs wait this long
                fake.hold.set()
                return [r.status_code for r in await asyncio.gather(running, queued)]

        assert asyncio.run(scenario()) == [200, 200]
        assert len(fake.added) == 2  # the refused request never reached the engine


def test_a_burst_the_server_has_room_for_is_served_whole() -> None:
    """Requests on their way to free running slots are not queued: 6 at once to an idle server with 2
    slots and a queue of 4 were answered {200: 4, 503: 2}; a 7th is beyond its room."""
    fake = FakeEngine(max_num_seqs=2, token_delay_s=0.2)
    config = ServerConfig(model_names=(MODEL,), max_queue_size=4)
    with serve(create_app(fake, config)) as url:
        httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=30
        )

        async def burst(count: int) -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 5}
                return [
                    r.status_code
                    for r in await asyncio.gather(
                        *(c.post("/v1/completions", json=body) for _ in range(count))
                    )
                ]

        assert asyncio.run(burst(6)) == [200] * 6
        assert sorted(asyncio.run(burst(7))) == [200] * 6 + [503]


def test_more_choices_than_the_queue_holds_is_400_not_queue_full() -> None:
    """A request is queued whole or not at all, so one with more choices (prompts x n) than
    ``--max-queue-size`` could never be queued: it was a 503 ``queue_full`` (which the openai SDK retries)
    saying the queue already held that many requests, on an idle server."""
    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_queue_size=4))) as url:
        many = {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 2, "n": 2}
        err = assert_openai_error(post(url, "/v1/completions", many), 400, param="prompt")
        assert "6" in err["message"] and "4" in err["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 5}
        assert_openai_error(post(url, "/v1/chat/completions", chat), 400, param="n")
        assert fake.added == []
        fits = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "n": 2}
        assert post(url, "/v1/completions", fits).status_code == 200
        # Scoring a prompt (echo, max_tokens 0) queues no generation: the limit does not apply.
        score = {**many, "max_tokens": 0, "echo": True}
        assert post(url, "/v1/completions", score).status_code == 200


def test_timeout_is_504_and_aborts_the_request() -> None:
    fake = FakeEngine(token_delay_s=0.05)
    config = ServerConfig(model_names=(MODEL,), request_timeout_s=0.4)
    with serve(create_app(fake, config)) as url:
        t0 = time.monotonic()
        resp = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100}, timeout=30)
        assert_openai_error(resp, 504, code="timeout")
        # The openai SDKs retried a 504 twice, each retry costing another --request-timeout of engine time.
        assert resp.headers["x-should-retry"] == "false"
        assert time.monotonic() - t0 < 3
        wait_until(lambda: len(fake.aborted) == 1)  # the engine was told to stop, not left running 5 s
        assert fake.aborted == [fake.added[0].request_id]
        stream = post(
            url,
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 100, "stream": True},
            timeout=30,
        )
        assert stream.status_code == 200  # streaming had started: the timeout arrives as an error event
        assert '"code":"timeout"' in stream.text
        assert stream.text.rstrip().endswith("data: [DONE]")  # after the error event, as vLLM
        wait_until(lambda: len(fake.aborted) == 2)
        ok = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200


def test_request_timing_out_before_reaching_the_engine_is_504_and_dropped() -> None:
    fake = FakeEngine()
    fake.pause_before_step = 1
    config = ServerConfig(model_names=(MODEL,), request_timeout_s=0.5)
    with serve(create_app(fake, config)) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                first = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": "a"}))
                await asyncio.to_thread(
                    wait_until, fake.stalled.is_set
                )  # the engine thread is stuck in a step
                late = await c.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]},
                )
                assert_openai_error(late, 504, code="timeout")
                assert_openai_error(await first, 504, code="timeout")

        asyncio.run(scenario())
        fake.hold.set()
        wait_until(lambda: len(fake.aborted) == 1)  # the running one is aborted after its step ...
        assert len(fake.added) == 1  # ... and the late one was dropped without reaching the engine


def test_stream_disconnect_aborts_the_request() -> None:
    fake = FakeEngine(token_delay_s=0.02)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 150, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(5)]
        assert any(line.startswith("data: ") for line in got)
        wait_until(lambda: len(fake.aborted) == 1, timeout=3)  # stopped long before 150 * 20 ms
        t0 = time.monotonic()
        ok = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}, timeout=30)
        assert ok.json()["choices"][0]["text"] == "bcd"
        assert time.monotonic() - t0 < 2


class GoneBeforeFirstByte:
    """ASGI middleware: a client that leaves before the status line of a streamed response reaches it (an
    ASGI 2.4 server's ``send`` raises ``OSError`` then; Starlette cancels the response before iterating
    its body)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.4"}}

        async def gone(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200:
                headers = dict(message["headers"])
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    raise OSError("client gone")
            await send(message)

        await self.app(scope, receive, gone)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 150}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 150}),
    ],
)
def test_stream_whose_client_left_before_the_first_byte_is_aborted(path: str, body: dict) -> None:
    fake = FakeEngine(token_delay_s=0.02)
    app = GoneBeforeFirstByte(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150)))
    with serve(app) as base:
        with pytest.raises(httpx.HTTPError):  # the server drops the connection (or answers 500)
            post(base, path, {"model": MODEL, "stream": True, **body}).raise_for_status()
        # The body generator never ran; the engine request is aborted anyway, long before 150 * 20 ms.
        wait_until(lambda: len(fake.aborted) == 1, timeout=2)
        assert (
            post(base, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code
            == 200
        )


def test_non_stream_disconnect_aborts_the_request() -> None:
    fake = FakeEngine(token_delay_s=0.02)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:
        with pytest.raises(httpx.ReadTimeout):
            post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 150}, timeout=0.3)
        wait_until(lambda: len(fake.aborted) == 1, timeout=3)
        assert (
            post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
        )


def test_empty_tool_parameters_mean_no_parameters() -> None:
    # {} compiled as "any object": a small model invented arguments until max_tokens.
    from kvb_server.tool_calls.spec import parse_tools

    [empty] = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    [omitted] = parse_tools([{"type": "function", "function": {"name": "f"}}])
    assert empty.parameters == omitted.parameters == {"type": "object", "properties": {}}
