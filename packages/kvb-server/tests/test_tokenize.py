"""``POST /tokenize`` and ``POST /detokenize``: vLLM's shapes, the same ids the generation routes queue."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import serve
from fakes import CharTokenizer, FakeEngine
from test_app_errors import assert_openai_error

from kvb_cache import KVBoost
from kvb_server import ServerConfig, create_app
from kvb_server.chat_prompt import chat_messages, render_chat
from kvb_server.engine import encode_text
from kvb_server.schemas.generation_requests import ChatCompletionRequest
from kvb_server.schemas.tokenize import DetokenizeResponse, TokenizeResponse
from kvb_server.tool_calls import detect, tool_plan

MODEL = "fake-model"
BOS = 2


class DecodingTokenizer(CharTokenizer):
    """One token per character, a BOS when special tokens are added, and the decoding side."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": [BOS, *ids] if add_special_tokens else ids}

    def __len__(self) -> int:
        return 256

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"<{i}>" for i in ids]


class TokenizingEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = DecodingTokenizer()

    def chat_prompt(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.tokenizer(
            text + ("<assistant>" if add_generation_prompt else ""), add_special_tokens=False
        )["input_ids"]


@pytest.fixture()
def fake() -> TokenizingEngine:
    return TokenizingEngine()


@pytest.fixture()
def url(fake: TokenizingEngine) -> Iterator[str]:
    config = ServerConfig(model_names=(MODEL, "alias"), max_tokens=20, max_body_bytes=4096)
    with serve(create_app(fake, config)) as base:
        yield base


def tokenize(url: str, **body: Any) -> httpx.Response:
    return httpx.post(url + "/tokenize", json=body)


def test_prompt_tokens_are_what_completions_queue(url: str, fake: TokenizingEngine) -> None:
    resp = tokenize(url, model=MODEL, prompt="hello")
    assert resp.status_code == 200, resp.text
    body = TokenizeResponse.model_validate(resp.json()).model_dump()
    assert body == {
        "count": 6,
        "max_model_len": 200,
        "tokens": [BOS, *map(ord, "hello")],
        "token_strs": None,
    }
    done = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert done.status_code == 200
    assert fake.added[-1].prompt == body["tokens"]
    assert done.json()["usage"]["prompt_tokens"] == body["count"]


def test_prompt_without_special_tokens_and_token_strings(url: str) -> None:
    body = tokenize(url, prompt="hi", add_special_tokens=False, return_token_strs=True).json()
    assert body["tokens"] == [104, 105] and body["count"] == 2
    assert body["token_strs"] == ["<104>", "<105>"]


def test_messages_tokens_are_what_chat_queues(url: str, fake: TokenizingEngine) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = tokenize(url, model="alias", messages=messages).json()
    assert body["tokens"] == list(map(ord, "<system>be brief<user>hi<assistant>"))
    chat = httpx.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1}
    )
    assert chat.status_code == 200
    assert fake.added[-1].prompt == body["tokens"]
    without = tokenize(url, messages=messages, add_generation_prompt=False).json()
    assert without["tokens"] == list(map(ord, "<system>be brief<user>hi"))
    # Content parts are flattened as the chat route flattens them; developer means system.
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}
    ]
    assert tokenize(url, messages=parts, add_generation_prompt=False).json()["tokens"] == list(
        map(ord, "<system>be \nbrief")
    )


def test_detokenize_round_trips(url: str) -> None:
    tokens = tokenize(url, prompt="héllo", add_special_tokens=False).json()["tokens"]
    resp = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": tokens})
    assert resp.status_code == 200
    assert DetokenizeResponse.model_validate(resp.json()).prompt == "héllo"
    assert httpx.post(url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
        ("/tokenize", {"model": MODEL}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "temperature": 1}, 400, "temperature"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
        ("/detokenize", {"tokens": [256]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_invalid_requests_get_openai_errors(url: str, path: str, body: dict, status: int, param: str) -> None:
    assert_openai_error(httpx.post(url + path, json=body), status, param=param)


def test_body_limits_apply(url: str) -> None:
    assert_openai_error(tokenize(url, prompt="x" * 5000), 413, code="body_too_large")
    deep = b'{"prompt": "x", "messages": ' + b"[" * 100 + b"]" * 100 + b"}"
    assert_openai_error(httpx.post(url + "/tokenize", content=deep), 400, code="json_too_deep")
    assert_openai_error(httpx.post(url + "/detokenize", content=b"\xff"), 400)


def test_engine_without_the_keyword_refuses_add_generation_prompt_false() -> None:
    fake = FakeEngine()  # its chat_prompt always adds the generation prompt
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as base:
        messages = [{"role": "user", "content": "x"}]
        assert tokenize(base, messages=messages).status_code == 200
        resp = tokenize(base, messages=messages, add_generation_prompt=False)
        assert_openai_error(resp, 400, param="add_generation_prompt", code="unsupported_parameter")


def test_api_key_guards_both_routes(fake: TokenizingEngine) -> None:
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), api_key="sekret"))) as base:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [120]})):
            assert_openai_error(httpx.post(base + path, json=body), 401, code="invalid_api_key")
            ok = httpx.post(base + path, json=body, headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200


def test_openapi_documents_the_routes(url: str) -> None:
    doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, request, response in (
        ("/tokenize", "TokenizeRequest", "TokenizeResponse"),
        ("/detokenize", "DetokenizeRequest", "DetokenizeResponse"),
    ):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response)
        assert {"400", "401", "404", "413"} <= set(op["responses"])
        assert schemas[request]["properties"]["model"]["enum"] == [MODEL, "alias"]
    assert {"prompt", "messages", "add_special_tokens", "add_generation_prompt"} <= set(
        schemas["TokenizeRequest"]["properties"]
    )


def test_real_engine_tokenizes_like_generation(tiny_url: str, tiny_engine: KVBoost) -> None:
    prompt = "The quick brown fox"
    body = httpx.post(tiny_url + "/tokenize", json={"model": "tiny-llama", "prompt": prompt}).json()
    assert body["tokens"] == encode_text(tiny_engine, prompt)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == tiny_engine.context_length
    messages = [{"role": "user", "content": "Where is Paris?"}]
    chat = httpx.post(tiny_url + "/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == tiny_engine.chat_prompt(messages)
    assert chat["token_strs"] == tiny_engine.tokenizer.convert_ids_to_tokens(chat["tokens"])
    usage = httpx.post(
        tiny_url + "/v1/chat/completions",
        json={"model": "tiny-llama", "messages": messages, "max_tokens": 1, "temperature": 0},
    ).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    bare = httpx.post(
        tiny_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    text = httpx.post(tiny_url + "/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text == tiny_engine.tokenizer.decode(body["tokens"])
    assert prompt in text
    vocab = len(tiny_engine.tokenizer)
    assert_openai_error(httpx.post(tiny_url + "/detokenize", json={"tokens": [vocab]}), 400, param="tokens")


def test_tools_are_rendered_as_the_chat_route_renders_them(tiny_url: str, tiny_engine: KVBoost) -> None:
    """vLLM's chat tokenize takes tools; they were a 400 here (extra field)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    plain = httpx.post(tiny_url + "/tokenize", json={"messages": messages}).json()
    with_tools = httpx.post(tiny_url + "/tokenize", json={"messages": messages, "tools": tools}).json()
    assert with_tools["count"] > plain["count"]  # the definitions are in the prompt
    # What the chat route queues (rendered as it renders; the route itself refuses this prompt: the tool
    # instructions outgrow the tiny model's 512-token context).
    req = ChatCompletionRequest.model_validate({"model": "tiny-llama", "messages": messages, "tools": tools})
    syntax = detect(tiny_engine.tokenizer)
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, syntax)
    assert (
        render_chat(tiny_engine, chat_messages(req, syntax, tiny_engine, plan), plan, req)
        == with_tools["tokens"]
    )
    assert_openai_error(
        httpx.post(tiny_url + "/tokenize", json={"prompt": "x", "tools": tools}), 400, param="tools"
    )
    bad = [{"type": "function", "function": {"name": "bad name!"}}]
    assert httpx.post(tiny_url + "/tokenize", json={"messages": messages, "tools": bad}).status_code == 400
