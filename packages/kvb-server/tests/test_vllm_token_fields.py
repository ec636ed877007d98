"""vLLM's ``return_tokens_as_token_ids`` and ``add_special_tokens`` on the real engine (tiny Llama): both were
refused as unknown fields ("Unrecognized request argument"), although vLLM serves them and RL trainers and
harnesses send them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from conftest import build_tiny_engine, build_tokenizer, serve
from tokenizers import processors

from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def bos_url() -> Iterator[str]:
    """The tiny Llama behind a tokenizer that adds a BOS to every encoded text (as Llama's do)."""
    tokenizer = build_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    engine = build_tiny_engine(tokenizer=tokenizer)
    with serve(create_app(engine, ServerConfig(model_names=(MODEL,), max_tokens=48))) as url:
        yield url


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": MODEL, **body}, timeout=60)


def test_tokens_as_token_ids_on_completions_name_the_same_tokens(tiny_url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    plain = post(tiny_url, "/v1/completions", body).json()["choices"][0]
    as_ids = post(tiny_url, "/v1/completions", {**body, "return_tokens_as_token_ids": True}).json()
    choice = as_ids["choices"][0]
    assert choice["text"] == plain["text"]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    detok = httpx.post(f"{tiny_url}/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert detok == plain["text"]
    # The second request hits the first's cached prefix: equal within fp32 noise, not bit for bit.
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert choice["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]  # still the text's offsets
    for top, plain_top in zip(choice["logprobs"]["top_logprobs"], plain["logprobs"]["top_logprobs"]):
        assert all(k.startswith("token_id:") for k in top)
        # Three alternatives, the greedy token first; by text two of them could share a key (lone byte tokens
        # all read U+FFFD), by id never.
        assert len(top) == 3 and len(plain_top) <= 3
        assert max(top.values()) == pytest.approx(max(plain_top.values()), abs=1e-5)
    # Echoed prompt tokens (with their scores) are labelled too, streamed as not.
    echo = {**body, "echo": True, "return_tokens_as_token_ids": True}
    echoed = post(tiny_url, "/v1/completions", echo).json()["choices"][0]["logprobs"]["tokens"]
    prompt_ids = httpx.post(f"{tiny_url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    assert echoed == [f"token_id:{t}" for t in prompt_ids] + choice["logprobs"]["tokens"]
    streamed: list[str] = []
    with httpx.stream(
        "POST", f"{tiny_url}/v1/completions", json={"model": MODEL, **echo, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                streamed += lp["tokens"] if lp else []
    assert streamed == echoed


def test_tokens_as_token_ids_on_chat_carry_the_labels_bytes(tiny_url: str) -> None:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    plain = post(tiny_url, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    labelled = post(tiny_url, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True}).json()
    content = labelled["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx([e["logprob"] for e in plain], abs=1e-5)
    for entry in content:
        assert entry["token"].startswith("token_id:")
        assert entry["bytes"] == list(entry["token"].encode())  # vLLM's: the label's bytes
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])


def test_add_special_tokens_false_encodes_the_text_alone(bos_url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with_bos = post(bos_url, "/v1/completions", body).json()
    without = post(bos_url, "/v1/completions", {**body, "add_special_tokens": False}).json()
    assert without["usage"]["prompt_tokens"] == with_bos["usage"]["prompt_tokens"] - 1
    count = httpx.post(
        f"{bos_url}/tokenize", json={"model": MODEL, "prompt": PROMPT, "add_special_tokens": False}
    ).json()["count"]
    assert without["usage"]["prompt_tokens"] == count
    # The same ids sent as a token-id prompt give the same reply.
    ids = httpx.post(
        f"{bos_url}/tokenize", json={"model": MODEL, "prompt": PROMPT, "add_special_tokens": False}
    ).json()["tokens"]
    assert (
        post(bos_url, "/v1/completions", {**body, "prompt": ids}).json()["choices"][0]["text"]
        == (without["choices"][0]["text"])
    )


def test_add_special_tokens_on_chat_false_is_the_default_true_is_refused(tiny_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(tiny_url, "/v1/chat/completions", {**body, "add_special_tokens": False}).status_code == 200
    refused = post(tiny_url, "/v1/chat/completions", {**body, "add_special_tokens": True})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "add_special_tokens"
    # vLLM's completions-only fields on chat name the route that takes them.
    for name, value in (("echo", True), ("best_of", 2)):
        err = post(tiny_url, "/v1/chat/completions", {**body, name: value}).json()["error"]
        assert err["param"] == name and "/v1/completions" in err["message"]
