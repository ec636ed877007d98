"""The official ``openai`` client against a real uvicorn server on a tiny random Llama (real KVBoost engine).

Every expected output comes from calling the engine directly with the same settings, so these tests check
the HTTP layer end to end: parameters in, text, finish reasons, usage and logprobs out.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import build_tiny_engine, serve

from kvb_cache import KVBoost
from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
SYSTEM = "You are a helpful assistant. Answer briefly and precisely, one sentence at a time."


def reference(engine: KVBoost, prompt, **kw):
    kw.setdefault("temperature", 0.0)
    return engine.generate(prompt, **kw)


@pytest.fixture()
def client(tiny_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 512  # the tiny Llama's context


def test_completion_greedy_matches_engine(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    resp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0)
    ref = reference(tiny_engine, "The quick brown fox", max_new_tokens=10)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == ref.output_text
    assert resp.choices[0].finish_reason == ref.finish_reason == "length"
    assert resp.usage.completion_tokens == 10
    assert resp.usage.prompt_tokens == ref.prompt_tokens
    assert resp.usage.total_tokens == ref.prompt_tokens + 10


def test_chat_greedy_matches_engine_via_chat_template(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is Paris?"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=9, temperature=0
    )
    ref = reference(tiny_engine, tiny_engine.chat_prompt(messages), max_new_tokens=9)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.output_text
    assert resp.choices[0].finish_reason == ref.finish_reason
    assert resp.usage.prompt_tokens == len(tiny_engine.chat_prompt(messages))


def test_developer_role_is_rendered_as_system(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    dev = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    sysm = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    a = client.chat.completions.create(model=MODEL, messages=dev, max_tokens=6, temperature=0)
    assert a.usage.prompt_tokens == len(tiny_engine.chat_prompt(sysm))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_deltas_concatenate_to_the_non_streamed_text(client: openai.OpenAI, endpoint: str) -> None:
    if endpoint == "chat":
        kw = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about Rome."}],
            "max_tokens": 14,
            "temperature": 0,
        }
        full = client.chat.completions.create(**kw)
        chunks = list(
            client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        expected = full.choices[0].message.content
    else:
        kw = {"model": MODEL, "prompt": "Berlin is the capital of", "max_tokens": 14, "temperature": 0}
        full = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        expected = full.choices[0].text
    assert text == expected
    assert len([c for c in chunks if c.choices]) > 3  # token by token, not one blob
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_ends_generation_and_is_not_included(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    prompt = "The quick brown fox"
    free = reference(tiny_engine, prompt, max_new_tokens=12).output_text
    assert "dd" in free  # this seed's greedy continuation repeats 'd'
    expected = free[: free.index("dd")]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=["zzz", "dd"]
    )
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop="dd", stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_reason_names_the_stop_string_as_vllm_does(client: openai.OpenAI) -> None:
    """The stop string is not in the text; vLLM's ``stop_reason`` says which one ended the choice."""
    prompt = "The quick brown fox"
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=["zzz", "dd"]
    )
    assert resp.choices[0].model_extra["stop_reason"] == "dd"
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop="dd", stream=True
        )
    )
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks][-2:] == [None, "dd"]
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].model_extra["stop_reason"] is None


def test_n_choices_each_get_their_own_seed(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    prompt = "Paris is the capital of"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for i, choice in enumerate(resp.choices):
        ref = tiny_engine.generate(prompt, max_new_tokens=8, temperature=1.0, seed=11 + i)
        assert choice.text == ref.output_text
    assert resp.usage.completion_tokens == sum(
        tiny_engine.generate(prompt, max_new_tokens=8, temperature=1.0, seed=11 + i).completion_tokens
        for i in range(3)
    )
    assert resp.usage.prompt_tokens == tiny_engine.generate(prompt, max_new_tokens=1).prompt_tokens


def test_completion_logprobs(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="Rome is in", max_tokens=5, temperature=0, logprobs=2
    )
    ref = reference(tiny_engine, "Rome is in", max_new_tokens=5, logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp.tokens == [e.token for e in ref.logprobs]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs] == [len({text for _, text, _ in e.top}) for e in ref.logprobs]
    assert all(v <= 0 for v in lp.token_logprobs)


def test_chat_logprobs(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    ref = reference(tiny_engine, tiny_engine.chat_prompt(messages), max_new_tokens=4, logprobs=3)
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == [e.token for e in ref.logprobs]
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in content)
    # A token's bytes are its own (a part of a character has its byte, not U+FFFD's: test_token_bytes.py).
    assert all(bytes(c.bytes).decode("utf-8", errors="replace") == c.token for c in content)


def test_logprobs_up_to_the_servers_cap(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    """--max-logprobs (vLLM's, 20 by default) caps both routes: completions took OpenAI's 5, so a vLLM
    client's logprobs=10 was a 400 here."""
    resp = client.completions.create(
        model=MODEL, prompt="Rome is in", max_tokens=2, temperature=0, logprobs=20
    )
    ref = reference(tiny_engine, "Rome is in", max_new_tokens=2, logprobs=20)
    assert all(len(e.top) == 20 for e in ref.logprobs)
    got = resp.choices[0].logprobs.top_logprobs
    assert [len(t) for t in got] == [len({text for _, text, _ in e.top}) for e in ref.logprobs]
    too_many = [
        ("logprobs", lambda: client.completions.create(model=MODEL, prompt="a", max_tokens=1, logprobs=21)),
        (
            "top_logprobs",
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=21
            ),
        ),
    ]
    for param, call in too_many:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.param == param and "at most 20 (this server's --max-logprobs)" in err.value.message


@pytest.mark.parametrize(("cap", "asked", "allowed"), [(2, 3, False), (-1, 1000, True)])
def test_max_logprobs_sets_the_cap(tiny_engine: KVBoost, cap: int, asked: int, allowed: bool) -> None:
    """-1 is the whole vocabulary (the tiny Llama has fewer than 1000 tokens: all of them come back)."""
    with serve(create_app(tiny_engine, ServerConfig(model_names=(MODEL,), max_logprobs=cap))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "a"}]

        def ask():
            return client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=asked
            )

        if not allowed:
            with pytest.raises(openai.BadRequestError, match=f"at most {cap}"):
                ask()
            return
        vocab = tiny_engine.model.get_input_embeddings().num_embeddings
        assert vocab < asked
        assert len(ask().choices[0].logprobs.content[0].top_logprobs) == vocab


def test_repeated_prefix_reports_cached_tokens(client: openai.OpenAI) -> None:
    doc = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
    first = client.completions.create(model=MODEL, prompt=doc + " Question one?", max_tokens=2, temperature=0)
    second = client.completions.create(
        model=MODEL, prompt=doc + " Question two?", max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens > 40
    cached = second.usage.prompt_tokens_details.cached_tokens
    # At least every full 16-token chunk of the shared document is served from cache.
    assert cached >= 32
    assert cached < second.usage.prompt_tokens


def test_async_client_concurrent_requests(tiny_url: str, tiny_engine: KVBoost) -> None:
    prompts = ["Paris is", "Berlin is", "Rome is", "The quick brown"]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)
        resps = await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts)
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return [r.choices[0].text for r in resps] + [streamed]

    got = asyncio.run(run())
    expected = [reference(tiny_engine, p, max_new_tokens=6).output_text for p in prompts]
    expected.append(
        reference(
            tiny_engine, tiny_engine.chat_prompt([{"role": "user", "content": "Hi"}]), max_new_tokens=5
        ).output_text
    )
    assert got == expected


def test_max_model_len_is_the_served_length() -> None:
    """``--max-model-len 96`` (vLLM's flag, an EngineArgs field) under a 512-token model: /v1/models
    reports 96, a request past it is a 400 context_length_exceeded (OpenAI's wording, with 96)."""
    engine = build_tiny_engine(max_model_len=96)
    with serve(create_app(engine, ServerConfig(model_names=(MODEL,), max_tokens=1000))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 96
        messages = [{"role": "user", "content": "Where is Paris?"}]
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
        )
        assert resp.choices[0].finish_reason == "length" and resp.usage.total_tokens == 96
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200)
        assert (
            err.value.code == "context_length_exceeded"
            and "maximum context length is 96" in err.value.message
        )


def test_a_pool_smaller_than_the_context_is_the_served_length() -> None:
    """A KV pool of 8 x 16 tokens under a 512-token model: /v1/models reported 512, and a request without
    max_tokens (sized to the reported context) was answered 400 naming a max_tokens the client never sent."""
    engine = build_tiny_engine(num_blocks=8, block_size=16)
    assert engine.context_length == 128
    with serve(create_app(engine, ServerConfig(model_names=(MODEL,), max_tokens=1000))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve(MODEL).model_extra["max_model_len"] == 128
        messages = [{"role": "user", "content": "Where is Paris?"}]
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True}
        )
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.total_tokens == 128
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200)
        assert err.value.code == "context_length_exceeded" and "128" in err.value.message


def test_every_response_carries_a_request_id(tiny_url: str) -> None:
    """As OpenAI's: the SDKs expose it (``_request_id`` here, ``withResponse().request_id`` in Node), which
    was None. A client's own X-Request-Id (a gateway's) comes back; a malformed one is replaced."""
    import httpx

    client = openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)
    made = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert made._request_id is not None and made._request_id.startswith("req-")
    again = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert again._request_id != made._request_id
    echoed = httpx.get(f"{tiny_url}/v1/models", headers={"X-Request-Id": "gw-42:abc"})
    assert echoed.headers["x-request-id"] == "gw-42:abc"
    bad = httpx.get(f"{tiny_url}/v1/models", headers={"X-Request-Id": "a b\tc"})
    assert bad.headers["x-request-id"].startswith("req-")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{tiny_url}/v1/completions", json=body) as streamed:
        assert streamed.headers["x-request-id"].startswith("req-")
    error = httpx.post(f"{tiny_url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert error.status_code == 404 and error.headers["x-request-id"].startswith("req-")
