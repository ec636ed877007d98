"""``/v1/responses`` over real HTTP on the fake engine: the openai SDK's ``client.responses`` parses what the
route answers, the prompt is the chat route's, ``previous_response_id`` continues a stored conversation, and
what is not supported is a 400 naming the parameter."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import serve
from fakes import FakeEngine

from kvb_server import ServerConfig, create_app
from kvb_server.config import TenantKey
from kvb_server.responses_api.objects import ResponseObject, ResponseStreamEvent

MODEL = "fake-model"


class StoppingFake(FakeEngine):
    """Finishes with ``stop`` at the first ``e`` (within 26 tokens), so responses can complete."""

    context_length = 2000

    def add_request(self, prompt, params, **kw):
        return super().add_request(prompt, dataclasses.replace(params, stop=("e",)), **kw)


def prompt_text(fake: FakeEngine, index: int = -1) -> str:
    return "".join(chr(t) for t in fake.added[index].prompt)


def wait_until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture()
def fake() -> StoppingFake:
    return StoppingFake()


@pytest.fixture()
def url(fake: FakeEngine) -> Iterator[str]:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100))) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def sse_events(text: str) -> list[dict[str, Any]]:
    """Parse SSE text, checking each ``event:`` line names its ``data``'s type."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        ResponseStreamEvent.model_validate(data)  # the OpenAPI document describes it
        events.append(data)
    return events


def test_create_matches_the_chat_route_and_the_sdk_parses_it(
    client: openai.OpenAI, url: str, fake: FakeEngine
) -> None:
    resp = client.responses.create(model=MODEL, input="Hi there", instructions="Be brief.", temperature=0)
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "temperature": 0,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        },
    ).json()
    assert prompt_text(fake) == prompt_text(fake, 0) == "<system>Be brief.<user>Hi there<assistant>"
    assert resp.output_text == chat["choices"][0]["message"]["content"] == "klmnopqrstuvwxyzabcd"
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].type == "output_text"
    assert resp.instructions == "Be brief." and resp.model == MODEL and resp.temperature == 0
    assert resp.tool_choice == "auto" and resp.tools == [] and resp.parallel_tool_calls is True
    assert resp.text.format.type == "text" and resp.store is True and resp.previous_response_id is None
    usage = resp.usage
    assert usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert usage.output_tokens == chat["usage"]["completion_tokens"] == 21  # the stop "e" counts
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == chat["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert usage.output_tokens_details.reasoning_tokens == 0
    ResponseObject.model_validate(client.responses.retrieve(resp.id).to_dict())


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI, fake: FakeEngine) -> None:
    resp = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=3, top_p=0.5, extra_body={"seed": 4}
    )
    assert fake.added[-1].params.max_new_tokens == 3 and fake.added[-1].params.seed == 4
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and len(resp.output_text) == 3
    assert resp.max_output_tokens == 3 and resp.top_p == 0.5


def test_input_items_become_chat_messages(client: openai.OpenAI, fake: FakeEngine) -> None:
    client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": "Rules."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "c", "annotations": []}],
            },
            {"role": "user", "content": "d"},
        ],
    )
    # The chat route renders developer as system.
    # Text parts are joined by newlines, as on the chat route.
    assert prompt_text(fake) == "<system>Rules.<user>a\nb<assistant>c<user>d<assistant>"


def test_previous_response_id_continues_the_stored_conversation(
    client: openai.OpenAI, fake: FakeEngine
) -> None:
    first = client.responses.create(model=MODEL, input="One", instructions="Sys.")
    first_prompt = prompt_text(fake)
    second = client.responses.create(
        model=MODEL, input="Two", previous_response_id=first.id, instructions="Sys."
    )
    # The follow-up's prompt starts with the whole first turn (a guaranteed prefix-cache hit).
    assert prompt_text(fake) == f"{first_prompt}{first.output_text}<user>Two<assistant>"
    assert second.previous_response_id == first.id
    third = client.responses.create(model=MODEL, input="Three", previous_response_id=second.id)
    # Instructions are not carried over (OpenAI's rule); the conversation is.
    assert prompt_text(fake) == (
        f"<user>One<assistant>{first.output_text}<user>Two<assistant>{second.output_text}"
        "<user>Three<assistant>"
    )
    assert third.usage.input_tokens == len(fake.added[-1].prompt)


def test_store_false_and_unknown_ids(client: openai.OpenAI, url: str) -> None:
    unstored = client.responses.create(model=MODEL, input="x", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    assert err.value.body["code"] == "previous_response_not_found"
    kept = client.responses.create(model=MODEL, input="x", metadata={"k": "v"}, user="u1")
    got = client.responses.retrieve(kept.id)
    assert got.to_dict() == kept.to_dict() and got.metadata == {"k": "v"} and got.user == "u1"
    client.responses.delete(kept.id)
    assert httpx.get(f"{url}/v1/responses/{kept.id}").status_code == 404
    assert httpx.delete(f"{url}/v1/responses/{kept.id}").status_code == 404


def test_retrieve_options_this_server_cannot_serve_are_refused_by_name(
    client: openai.OpenAI, url: str
) -> None:
    # retrieve(id, stream=True) got the stored JSON and read it as an empty stream: no events, no error.
    kept = client.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError) as err:
        list(client.responses.retrieve(kept.id, stream=True))
    assert (err.value.body["param"], err.value.body["code"]) == ("stream", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.retrieve(kept.id, include=["file_search_call.results"])
    assert err.value.body["param"] == "include" and "file_search_call.results" in err.value.body["message"]
    # What this server adds at creation is accepted here too (the stored response is returned as it is).
    assert client.responses.retrieve(kept.id, include=["message.output_text.logprobs"]).id == kept.id
    got = httpx.get(f"{url}/v1/responses/{kept.id}", params={"starting_after": 3})
    assert (got.status_code, got.json()["error"]["param"]) == (400, "starting_after")
    assert client.responses.retrieve(kept.id, extra_query={"stream": "false"}).id == kept.id


def test_stored_responses_are_scoped_by_api_key(fake: FakeEngine) -> None:
    keys = (TenantKey(key="key-a", salt="a"), TenantKey(key="key-b", salt="b"))
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), tenant_keys=keys))) as url:
        a = openai.OpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=f"{url}/v1", api_key="key-b", max_retries=0)
        resp = a.responses.create(model=MODEL, input="secret")
        assert fake.added[-1].cache_salt is not None
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(resp.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=MODEL, input="more", previous_response_id=resp.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(resp.id)
        assert a.responses.retrieve(resp.id).id == resp.id
        a.responses.create(model=MODEL, input="more", previous_response_id=resp.id)


def test_stream_events_in_openai_order(url: str, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "input": "Hi there", "stream": True}
    resp = httpx.post(f"{url}/v1/responses", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert len(deltas) > 3
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in events[3:-2])
    text = "".join(e["delta"] for e in deltas)
    assert events[-4]["text"] == text == final["output"][0]["content"][0]["text"]
    assert final["id"] == created["id"] and final["status"] == "completed"
    assert final["usage"]["output_tokens"] == len(text) + 1  # the stop string counts
    # Streamed and stored: the follow-up continues it, and GET returns the final object.
    assert client.responses.retrieve(final["id"]).output_text == text
    assert text == client.responses.create(model=MODEL, input="Hi there").output_text


def test_sdk_stream_helpers_parse_the_events(client: openai.OpenAI) -> None:
    raw = list(client.responses.create(model=MODEL, input="Hi", stream=True))
    assert raw[-1].type == "response.completed"
    text = "".join(e.delta for e in raw if e.type == "response.output_text.delta")
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == text == raw[-1].response.output_text
    truncated = list(client.responses.create(model=MODEL, input="Hi", stream=True, max_output_tokens=2))
    assert truncated[-1].type == "response.incomplete"
    assert truncated[-1].response.incomplete_details.reason == "max_output_tokens"
    assert truncated[-1].response.output[0].status == "incomplete"


def test_failure_after_the_stream_began_is_an_error_event_then_response_failed(fake: FakeEngine) -> None:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        fake.fail_step(3, RuntimeError("kernel exploded"))
        resp = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True})
        assert resp.status_code == 200
        events = sse_events(resp.text)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert "kernel exploded" in events[-2]["message"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["message"] == events[-2]["message"]
        assert httpx.get(f"{url}/v1/responses/{failed['id']}").status_code == 404  # not stored


def test_stream_disconnect_aborts_the_request() -> None:
    fake = FakeEngine(token_delay_s=0.02)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 150, "stream": True}
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            assert next(lines) == "event: response.created"
        wait_until(lambda: len(fake.aborted) == 1)  # long before 150 * 20 ms


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"bogus": 1}, "bogus"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"temperature": 2.5}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x" * 1960, "max_output_tokens": 50}, "max_output_tokens"),  # beyond the context window
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, "input[0].id"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": []}]}, "input[0].type"),  # never a 500: types are looked up only when strings
        ({"tools": [{"type": {"a": 1}}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": 5}]}]}, "input[0].content[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"include": ["message.output_text.logprobs", "message.input_image.image_url"]}, "include"),
        ({"truncation": "middle"}, "truncation"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2, "tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"service_tier": "turbo"}, "service_tier"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        # The chat route's own checks, named as this route's fields.
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]},
            "tools[0].parameters",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "nonsense"}}}},
            "text.format.schema",
        ),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools"),
        ({"model": "other"}, "model"),
    ],
)
def test_refusals_name_the_parameter(url: str, extra: dict, param: str) -> None:
    resp = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]
    # Messages speak this route's names too: max_output_tokens was worded as the chat route's
    # max_completion_tokens (the field the translated request carries).
    assert "max_completion_tokens" not in error["message"] and "max_tokens" not in error["message"]


def test_defaults_and_nulls_an_sdk_may_send_are_accepted(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL,
        input="hi",
        background=False,
        truncation="disabled",
        include=[],
        reasoning={"effort": None, "summary": None},
        top_logprobs=0,
        text={"format": {"type": "text"}, "verbosity": "medium"},
        tool_choice="auto",
        parallel_tool_calls=False,
        service_tier="auto",
        prompt_cache_key="k",
        prompt_cache_retention="in_memory",
        safety_identifier="s",
        stream_options=None,
        max_tool_calls=3,
    )
    assert resp.status == "completed" and resp.parallel_tool_calls is False
    assert resp.prompt_cache_key == "k" and resp.max_tool_calls == 3
    assert resp.prompt_cache_retention == "in_memory"


def test_verbosity_is_accepted_and_echoed_as_on_the_chat_route(client: openai.OpenAI) -> None:
    """The served models have no verbosity control: any of OpenAI's values is accepted and ignored (as chat's
    ``verbosity``), and echoed as asked."""
    resp = client.responses.create(model=MODEL, input="hi", text={"verbosity": "low"})
    assert resp.status == "completed" and resp.text.verbosity == "low"
    assert client.responses.create(model=MODEL, input="hi").text.verbosity == "medium"


def test_openapi_documents_the_route(url: str) -> None:
    doc = httpx.get(f"{url}/openapi.json").json()
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"
    }
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    schemas = doc["components"]["schemas"]
    assert schemas["ResponsesRequest"]["additionalProperties"] is False
    assert set(schemas["ResponsesRequest"]["required"]) == {"input"}  # model: the first served one
    assert {"ResponseObject", "ResponseStreamEvent"} <= set(schemas)
    assert "/v1/responses/{response_id}" in doc["paths"]


def _entries(logprobs: list) -> list[tuple[str, float, int]]:
    return [(lp["token"], lp["logprob"], len(lp["top_logprobs"])) for lp in logprobs]


@pytest.mark.parametrize("ask", [{"include": ["message.output_text.logprobs"]}, {"top_logprobs": 2}])
def test_message_logprobs_streamed_and_not(url: str, fake: FakeEngine, ask: dict) -> None:
    """``include: ["message.output_text.logprobs"]`` (or ``top_logprobs``) puts the message text's token
    logprobs in its ``output_text`` part, in OpenAI's shape: the same entries whole and streamed, where each
    ``output_text.delta`` carries those of its own text and ``output_text.done`` all of them. They were a 400."""
    body = {"model": MODEL, "input": "hi", **ask}
    whole = httpx.post(f"{url}/v1/responses", json=body).json()
    part = whole["output"][0]["content"][0]
    assert whole["top_logprobs"] == ask.get("top_logprobs", 0)
    tokens = [lp["token"] for lp in part["logprobs"]]
    assert tokens and "".join(tokens) == part["text"] + "e"  # the stop string's token too, as on chat
    assert all(set(lp) == {"token", "logprob", "bytes", "top_logprobs"} for lp in part["logprobs"])
    assert {len(lp["top_logprobs"]) for lp in part["logprobs"]} == {ask.get("top_logprobs", 0)}
    ResponseObject.model_validate(whole)
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    streamed = [lp for e in deltas for lp in e["logprobs"]]
    # As on the chat route, a streamed reply leaves out the stop string's token, which a whole one keeps.
    assert _entries(done["logprobs"]) == _entries(part["logprobs"])[: len(done["logprobs"])]
    assert len(part["logprobs"]) - len(done["logprobs"]) in (0, 1)
    assert _entries(streamed) == _entries(done["logprobs"])
    for e in deltas:  # a delta's logprobs spell its own text
        assert "".join(lp["token"] for lp in e["logprobs"]) == e["delta"]
    for event in events:
        ResponseStreamEvent.model_validate(event)
    completed = next(e for e in events if e["type"] == "response.completed")
    assert _entries(completed["response"]["output"][0]["content"][0]["logprobs"]) == _entries(
        done["logprobs"]
    )


def test_without_logprobs_asked_none_are_computed(url: str, fake: FakeEngine) -> None:
    resp = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi"}).json()
    assert resp["output"][0]["content"][0]["logprobs"] == [] and fake.added[-1].params.logprobs is None


def test_encrypted_reasoning_is_accepted_as_nothing_to_add(client: openai.OpenAI) -> None:
    """Clients that keep no server state (the Agents SDK, Codex with ``store: false``) always ask for
    ``reasoning.encrypted_content``; it was a 400 that failed every request of theirs."""
    resp = client.responses.create(
        model=MODEL, input="hi", include=["reasoning.encrypted_content"], store=False
    )
    assert resp.status == "completed" and resp.output_text


class ShortContext(StoppingFake):
    context_length = 150


def test_truncation_auto_drops_the_oldest_items_until_the_prompt_fits() -> None:
    """OpenAI's ``truncation: "auto"``: a conversation longer than the context loses its oldest items (never
    the instructions; a tool result with its call) instead of a 400; the stored response keeps them all, and
    the response echoes ``"auto"``. Without it, or when the last item alone does not fit, the 400 stands.
    It was a 400 naming the field."""
    fake = ShortContext()
    history = [
        {"role": "user", "content": "first " + "a" * 40},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "b" * 30},
        {"role": "user", "content": "second " + "c" * 30},
        {"role": "user", "content": "last question"},
    ]
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=20))) as url:
        body = {"model": MODEL, "input": history, "instructions": "be brief", "max_output_tokens": 10}
        refused = httpx.post(f"{url}/v1/responses", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        resp = httpx.post(f"{url}/v1/responses", json={**body, "truncation": "auto"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["truncation"] == "auto"
        seen = prompt_text(fake)
        assert "be brief" in seen and "last question" in seen and "first" not in seen
        assert "b" * 30 not in seen  # the tool result left with its call
        assert len(fake.added[-1].prompt) + 10 <= ShortContext.context_length
        kept = httpx.get(f"{url}/v1/responses/{resp.json()['id']}/input_items").json()["data"]
        assert len(kept) == len(history)  # only what the model read was cut
        alone = {**body, "input": "x" * 200, "truncation": "auto"}
        still = httpx.post(f"{url}/v1/responses", json=alone)
        assert still.status_code == 400 and still.json()["error"]["code"] == "context_length_exceeded"
        # The newest item fits, the budget beside it does not: the 400 names the budget, not the input
        # (the first, untruncated try's error said to shorten the messages).
        budget = httpx.post(
            f"{url}/v1/responses", json={**body, "truncation": "auto", "max_output_tokens": 140}
        )
        assert budget.status_code == 400 and budget.json()["error"]["param"] == "max_output_tokens", (
            budget.text
        )
        count = {"model": MODEL, "input": history, "truncation": "auto"}
        counted = httpx.post(f"{url}/v1/responses/input_tokens", json=count)
        assert (counted.status_code, counted.json()["error"]["param"]) == (400, "truncation")


def test_model_may_be_left_out_as_on_the_other_routes(url: str) -> None:
    """Chat, completions and /tokenize take a request without ``model`` (the first served one, as vLLM);
    this route answered 400 "Missing required parameter" (a docs audit)."""
    resp = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL


def test_follow_up_without_model_keeps_the_previous_responses_name() -> None:
    """Two served names (aliases): a follow-up that leaves ``model`` out continues under the name its
    previous response was served by, not the first served name; a fresh request still gets the first."""
    fake = StoppingFake()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL, "alias"), max_tokens=20))) as url:
        first = httpx.post(
            f"{url}/v1/responses", json={"model": "alias", "input": "hi", "max_output_tokens": 4}
        )
        assert first.status_code == 200, first.text
        follow = {"input": "and?", "previous_response_id": first.json()["id"], "max_output_tokens": 4}
        resp = httpx.post(f"{url}/v1/responses", json=follow)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "alias"
        fresh = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 4})
        assert fresh.json()["model"] == MODEL


def test_input_tokens_model_is_checked_as_on_the_other_routes(url: str) -> None:
    """An explicit ``"model": null`` is a 400 naming ``model`` (as chat, completions and POST /v1/responses
    answer it) and an unknown name a 404; left out, the first served model counts."""
    count = f"{url}/v1/responses/input_tokens"
    resp = httpx.post(count, json={"model": None, "input": "hi"})
    assert (resp.status_code, resp.json()["error"]["param"]) == (400, "model")
    assert httpx.post(count, json={"model": "nope", "input": "hi"}).status_code == 404
    assert httpx.post(count, json={"input": "hi"}).status_code == 200
