"""The OpenAPI document describes the bodies the routes parse, and real responses match its schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine

from kvb_server import ServerConfig, create_app
from kvb_server.schemas.errors import ErrorResponse
from kvb_server.schemas.generation_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)

MODEL = "fake-model"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve(create_app(FakeEngine(), ServerConfig(model_names=(MODEL,)))) as base:
        yield base


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def test_generation_routes_document_their_bodies(url: str) -> None:
    doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, field in (
        ("/v1/completions", "CompletionRequest", "prompt"),
        ("/v1/chat/completions", "ChatCompletionRequest", "messages"),
    ):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        props = schemas[model]["properties"]
        assert {field, "model", "max_tokens", "stream", "cache_salt"} <= set(props)
        assert schemas[model]["additionalProperties"] is False  # unknown parameters are refused (400)
        # model may be left out (the first served one, as vLLM answers)
        assert model in schemas and set(schemas[model]["required"]) == {field}
        ok = op["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        assert {"400", "401", "413", "503", "504"} <= set(op["responses"])
    for path in ("/v1/cache/reset", "/reset_prefix_cache", "/v1/warm"):
        assert "requestBody" in doc["paths"][path]["post"]
    # Every reference resolves: fuzzers and /docs need the whole graph.
    dangling = {r for r in refs(doc) if r.rsplit("/", 1)[1] not in schemas}
    assert dangling == set()
    assert {"CompletionChunk", "ChatCompletionChunk", "ErrorResponse"} <= set(schemas)
    assert httpx.get(url + "/docs").status_code == 200


def events(text: str) -> list[dict[str, Any]]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_responses_match_their_documented_models(url: str) -> None:
    base = {"model": MODEL, "max_tokens": 3, "n": 2}
    completion = {**base, "prompt": ["ab", "cd"], "logprobs": 2}
    chat = {**base, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    CompletionResponse.model_validate(httpx.post(url + "/v1/completions", json=completion).json())
    ChatCompletionResponse.model_validate(httpx.post(url + "/v1/chat/completions", json=chat).json())
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    chunks = events(httpx.post(url + "/v1/completions", json={**completion, **streamed}).text)
    assert chunks and all(CompletionChunk.model_validate(c) for c in chunks)
    chunks = events(httpx.post(url + "/v1/chat/completions", json={**chat, **streamed}).text)
    assert chunks and all(ChatCompletionChunk.model_validate(c) for c in chunks)
    ErrorResponse.model_validate(httpx.post(url + "/v1/completions", json={"model": MODEL}).json())


def test_documented_values_are_accepted(url: str) -> None:
    """What the schema allows the server takes: JSON's whole numbers as integers, the served model names,
    and for parameters it refuses by name only the values it accepts."""
    doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL]
    assert schemas["CompletionRequest"]["properties"]["suffix"]["enum"] == ["", None]
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == [
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
    ]
    assert schemas["WarmRequest"]["anyOf"] == [{"required": ["text"]}, {"required": ["texts"]}]
    # 0 is valid on completions (with echo: score the prompt only), never on chat.
    assert {"type": "integer", "minimum": 0} in schemas["CompletionRequest"]["properties"]["max_tokens"][
        "anyOf"
    ]
    assert {"type": "integer", "minimum": 1} in schemas["ChatCompletionRequest"]["properties"]["max_tokens"][
        "anyOf"
    ]
    assert {"type": "integer", "minimum": 1, "maximum": 16} in schemas["CompletionRequest"]["properties"][
        "n"
    ]["anyOf"]
    # --max-logprobs (20 by default) is the documented maximum: a fuzzer's larger value is not schema-valid.
    assert {"type": "integer", "minimum": 0, "maximum": 20} in schemas["CompletionRequest"]["properties"][
        "logprobs"
    ]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 20} in schemas["ChatCompletionRequest"]["properties"][
        "top_logprobs"
    ]["anyOf"]
    assert '"ge"' not in json.dumps(doc)  # JSON Schema's "minimum", never pydantic's raw keyword
    body = {"model": MODEL, "prompt": [97.0, 98], "max_tokens": 3.0, "n": 1.0, "seed": 7.0, "echo": False}
    resp = httpx.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    for bad in ({"max_tokens": "3"}, {"max_tokens": 3.5}, {"max_tokens": True}):
        resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    extras = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "modalities": ["text"]}
    assert httpx.post(url + "/v1/chat/completions", json={**chat, **extras}).status_code == 200
