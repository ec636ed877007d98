"""``GET /v1/responses/{id}/input_items``, ``item_reference`` inputs and ``POST /v1/responses/input_tokens``,
over real HTTP on the fake engine, through the openai SDK's own methods."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import serve
from test_responses_api import MODEL, StoppingFake, prompt_text

from kvb_server import ServerConfig, create_app
from kvb_server.config import TenantKey
from kvb_server.responses_api.objects import InputItemList, InputTokenCount


@pytest.fixture()
def fake() -> StoppingFake:
    return StoppingFake()


@pytest.fixture()
def url(fake: StoppingFake) -> Iterator[str]:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=100))) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_input_items_list_the_whole_conversation_newest_first(client: openai.OpenAI, url: str) -> None:
    first = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "One"},
            {"type": "message", "id": "msg_mine", "role": "assistant", "content": "Two"},
        ],
        instructions="Not an item.",
    )
    second = client.responses.create(model=MODEL, input="Three", previous_response_id=first.id)
    page = client.responses.input_items.list(second.id)
    InputItemList.model_validate(httpx.get(f"{url}/v1/responses/{second.id}/input_items").json())
    items = list(reversed(page.data))  # OpenAI's default order is newest first
    assert [i.type for i in items] == ["message", "message", "message", "message"]
    assert [i.role for i in items] == ["user", "assistant", "assistant", "user"]
    texts = [i.content[0].text for i in items]
    assert texts == ["One", "Two", first.output_text, "Three"]
    # The client's id is kept, an output item keeps its id, new ids for the rest, all distinct.
    assert items[1].id == "msg_mine" and items[2].id == first.output[0].id
    assert len({i.id for i in items}) == 4
    assert items[0].content[0].type == "input_text" and items[1].content[0].type == "output_text"
    assert [i.id for i in client.responses.input_items.list(first.id, order="asc").data] == [
        i.id for i in items[:2]
    ]


def test_input_items_pages_follow_openai_cursors(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": str(i)} for i in range(7)])
    page = client.responses.input_items.list(resp.id, limit=3, order="asc")
    assert [i.content[0].text for i in page.data] == ["0", "1", "2"] and page.has_more
    # The SDK's auto-pagination sends after=<last id> until has_more is false.
    assert [i.content[0].text for i in page] == [str(i) for i in range(7)]
    ids = [i.id for i in page]
    assert page.last_id == ids[2] and page.first_id == ids[0]
    last = client.responses.input_items.list(resp.id, order="asc", after=ids[4])
    assert [i.id for i in last.data] == ids[5:] and not last.has_more
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(resp.id, after="msg_nope")
    assert err.value.body["param"] == "after"
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}):
        with pytest.raises(openai.BadRequestError):
            client.responses.input_items.list(resp.id, **bad)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(resp.id, include=["message.input_image.image_url"])
    assert err.value.body["param"] == "include"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    unstored = client.responses.create(model=MODEL, input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)


def test_item_reference_resends_a_stored_item(client: openai.OpenAI, fake: StoppingFake) -> None:
    """The Vercel AI SDK's replay with store on: earlier items by id, new ones in full, no
    previous_response_id. The prompt is the one the full items give."""
    first = client.responses.create(model=MODEL, input="One")
    user_item = client.responses.input_items.list(first.id).data[0]
    referenced = client.responses.create(
        model=MODEL,
        input=[
            {"type": "item_reference", "id": user_item.id},
            {"type": "item_reference", "id": first.output[0].id},
            {"role": "user", "content": "Two"},
        ],
    )
    by_reference = prompt_text(fake)
    client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "One"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Two"},
        ],
    )
    assert by_reference == prompt_text(fake) == f"<user>One<assistant>{first.output_text}<user>Two<assistant>"
    # The referenced items are listed as they were stored (their ids).
    listed = client.responses.input_items.list(referenced.id, order="asc").data
    assert [i.id for i in listed[:2]] == [user_item.id, first.output[0].id]


def test_item_reference_errors(client: openai.OpenAI, fake: StoppingFake) -> None:
    first = client.responses.create(model=MODEL, input="One")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_x"}]
        )
    assert err.value.body["param"] == "input[1].id" and "not found" in err.value.body["message"]
    # Already in the conversation previous_response_id continues: the model would read it twice.
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=[{"type": "item_reference", "id": first.output[0].id}, {"role": "user", "content": "b"}],
        )
    assert err.value.body["param"] == "input[0].id" and "Duplicate item" in err.value.body["message"]
    # The same item sent whole (an SDK model_dump of the last output), or one id twice in a request: read
    # twice, and stored it made input_items' "after" cursor return the same page forever (an audit).
    copied = first.output[0].model_dump(exclude_none=True)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, previous_response_id=first.id, input=[copied, {"role": "user", "content": "b"}]
        )
    assert err.value.body["param"] == "input[0].id" and "Duplicate item" in err.value.body["message"]
    twice = {"type": "message", "id": "msg_dup", "role": "user", "content": "c"}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[twice, twice])
    assert err.value.body["param"] == "input[1].id" and "an earlier input item" in err.value.body["message"]
    # Items are forgotten with the last stored response that holds them.
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": first.output[0].id}])
    # Sent whole without previous_response_id (the stateless style), the copy is the conversation's once.
    assert client.responses.create(model=MODEL, input=[copied, {"role": "user", "content": "b"}]).output


def test_item_references_are_scoped_by_api_key(fake: StoppingFake) -> None:
    keys = (TenantKey(key="key-a", salt="a"), TenantKey(key="key-b", salt="b"))
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), tenant_keys=keys))) as url:
        a = openai.OpenAI(base_url=f"{url}/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=f"{url}/v1", api_key="key-b", max_retries=0)
        resp = a.responses.create(model=MODEL, input="secret")
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model=MODEL, input=[{"type": "item_reference", "id": resp.output[0].id}])
        with pytest.raises(openai.NotFoundError):
            b.responses.input_items.list(resp.id)
        a.responses.create(model=MODEL, input=[{"type": "item_reference", "id": resp.output[0].id}])


def test_input_tokens_count_what_create_queues(client: openai.OpenAI, url: str, fake: StoppingFake) -> None:
    tools = [{"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    count = client.responses.input_tokens.count(
        model=MODEL, input="What time is it?", instructions="Be brief.", tools=tools
    )
    added = len(fake.added)
    assert count.object == "response.input_tokens"
    InputTokenCount.model_validate(count.to_dict())
    assert len(fake.added) == added  # nothing was generated
    resp = client.responses.create(
        model=MODEL, input="What time is it?", instructions="Be brief.", tools=tools
    )
    assert count.input_tokens == resp.usage.input_tokens == len(fake.added[-1].prompt)
    # A follow-up without new input: the conversation it would continue; model defaults to the served one.
    follow = client.responses.input_tokens.count(previous_response_id=resp.id)
    assert follow.input_tokens == len(f"<user>What time is it?<assistant>{resp.output_text}<assistant>")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_tokens.count(input="x", extra_body={"personality": "friendly"})
    assert err.value.body["param"] == "personality"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_tokens.count(input="x", truncation="auto")
    assert err.value.body["param"] == "truncation"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_tokens.count(input="x", extra_body={"temperature": 0.5})
    assert "temperature" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_tokens.count(model=MODEL)
    assert err.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="other", input="x")
    # Past the context window still counts (a client asks in order to know whether it fits).
    long = client.responses.input_tokens.count(input="y" * 2500)
    assert long.input_tokens > StoppingFake.context_length
    assert httpx.post(f"{url}/v1/responses/input_tokens", json={"input": "hi"}).status_code == 200
