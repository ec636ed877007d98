"""The official openai client against a real ``python -m kvb_server`` process on the embedded SmolLM2.

The acceptance test of the server: greedy chat through the server equals plain Hugging Face greedy
decoding, streaming equals non-streaming, and OpenAI's parameters behave as documented.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from conftest import server_process

MODEL = "smollm2-135m"
SYSTEM = "You are a concise assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    flags = ("--model", MODEL, "--max-tokens", "64", "--chunk-size", "32", "--log-level", "warning")
    with server_process("kvb_server", *flags) as url:
        yield url


@pytest.fixture()
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=300)


def hf_greedy_text(smollm2, ids: list[int], new_tokens: int) -> str:
    model, tokenizer = smollm2
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[
        0, len(ids) :
    ].tolist()
    eos = tokenizer.eos_token_id
    if eos in out:
        out = out[: out.index(eos)]
    return tokenizer.decode(out)


def test_chat_greedy_equals_hugging_face(client: openai.OpenAI, smollm2) -> None:
    _, tokenizer = smollm2
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert resp.choices[0].message.content == hf_greedy_text(smollm2, ids, 24)
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.prompt_tokens == len(ids)


def test_streaming_equals_non_streaming_on_both_endpoints(client: openai.OpenAI) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 20,
        "temperature": 0,
    }
    full = client.chat.completions.create(**chat).choices[0]
    chunks = list(client.chat.completions.create(**chat, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    comp = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0}
    text = client.completions.create(**comp).choices[0].text
    streamed = [c.choices[0].text for c in client.completions.create(**comp, stream=True)]
    assert "".join(streamed) == text and len(streamed) > 3


def test_stop_n_logprobs_and_finish_reasons(client: openai.OpenAI) -> None:
    prompt = "Count: one, two, three, four, five,"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0]
    assert free.finish_reason == "length"
    stop = free.text.strip().split(",")[0][-3:]
    cut = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    many = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.9, seed=3, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.9, seed=3, n=3)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # seeded: reproducible
    lp = (
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        .choices[0]
        .logprobs.content
    )
    assert len(lp) >= 1 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    # Greedy: the chosen token is the most likely one.
    assert all(t.logprob >= max(a.logprob for a in t.top_logprobs) - 1e-5 for t in lp)


def test_repeated_system_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    system = SYSTEM + " " + "Facts: Paris is in France. Berlin is in Germany. Rome is in Italy. " * 4
    usage = [
        client.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        ).usage
        for q in ("Where is Paris?", "Where is Rome?")
    ]
    assert usage[0].prompt_tokens > 64
    assert usage[1].prompt_tokens_details.cached_tokens >= 64


def test_async_concurrent_greedy_equals_sequential(server_url: str, client: openai.OpenAI) -> None:
    questions = ["Where is Paris?", "What is 2+2?", "Name a fruit.", "Say hello."]

    def messages(q: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]

    sequential = [
        client.chat.completions.create(model=MODEL, messages=messages(q), max_tokens=12, temperature=0)
        .choices[0]
        .message.content
        for q in questions
    ]

    async def concurrent() -> list[str]:
        api = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=300)
        resps = await asyncio.gather(
            *(
                api.chat.completions.create(model=MODEL, messages=messages(q), max_tokens=12, temperature=0)
                for q in questions * 2
            )
        )
        await api.close()
        return [r.choices[0].message.content for r in resps]

    assert asyncio.run(concurrent()) == sequential * 2


def test_stats_and_metrics_on_cpu(server_url: str) -> None:
    stats = httpx.get(server_url + "/v1/stats")
    assert stats.status_code == 200
    assert stats.json()["device"]["cuda_available"] == torch.cuda.is_available()
    metrics = httpx.get(server_url + "/metrics").text
    assert 'kvboost_requests_total{route="/v1/chat/completions",status="200"}' in metrics
