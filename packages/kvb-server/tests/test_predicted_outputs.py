"""OpenAI's predicted outputs (``prediction``) on the chat route, through the openai client: the reply is the
one without a prediction; ``usage.completion_tokens_details`` counts the prediction's drafted tokens."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import build_tiny_engine, serve

from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve(create_app(build_tiny_engine(), ServerConfig(model_names=(MODEL,), max_tokens=64))) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _chat(client: openai.OpenAI, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}, **extra
    )


def test_a_prediction_leaves_the_reply_alone_and_is_counted(client: openai.OpenAI) -> None:
    plain = _chat(client)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # reported only for a request with a prediction
    for prediction in (
        {"type": "content", "content": text},
        {
            "type": "content",
            "content": [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}],
        },
    ):
        right = _chat(client, prediction=prediction)
        assert right.choices[0].message.content == text
        details = right.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    for empty in ("", []):  # sent, but nothing to draft: reported as 0 / 0
        details = _chat(
            client, prediction={"type": "content", "content": empty}
        ).usage.completion_tokens_details
        assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
    wrong = _chat(client, prediction={"type": "content", "content": "zebra " * 20})
    assert wrong.choices[0].message.content == text
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens == 0
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": text},
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize(
    "prediction",
    [
        {"type": "file", "content": "x"},
        {"type": "content"},
        {"type": "content", "content": [{"type": "image"}]},
        "x",
    ],
)
def test_a_malformed_prediction_is_a_400_naming_it(url: str, prediction) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "prediction": prediction}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith("prediction"), resp.text
