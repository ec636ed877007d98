"""vLLM's sampling extras (``top_k``, ``repetition_penalty``, ``ignore_eos``) through the SDK's
``extra_body``, against the real engine on the tiny Llama: each equals the engine called directly."""

from __future__ import annotations

import httpx
import openai
import pytest

from kvb_cache import KVBoost

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture()
def client(tiny_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)


def _text(
    client: openai.OpenAI, max_tokens: int, temperature: float, seed: int | None = None, **extra
) -> str:
    """The completion of PROMPT through the server, with ``extra`` as vLLM extras (``extra_body``)."""
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        extra_body=extra,
    )
    return resp.choices[0].text


def test_top_k_one_samples_the_argmax(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    greedy = tiny_engine.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    for seed in (1, 2, 3):
        resp = _text(client, 12, 1.5, seed=seed, top_k=1, ignore_eos=True)
        assert resp == greedy.output_text


def test_min_p_one_samples_the_argmax_and_min_p_equals_the_engine(
    client: openai.OpenAI, tiny_engine: KVBoost
) -> None:
    greedy = tiny_engine.generate(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    resp = _text(client, 12, 1.5, seed=3, min_p=1.0, ignore_eos=True)
    assert resp == greedy.output_text
    resp = _text(client, 12, 1.2, seed=5, min_p=0.2, ignore_eos=True)
    ref = tiny_engine.generate(PROMPT, max_new_tokens=12, temperature=1.2, seed=5, min_p=0.2, ignore_eos=True)
    assert resp == ref.output_text


def test_repetition_penalty_and_top_k_equal_the_engine(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    settings = {"top_k": 5, "repetition_penalty": 1.3}
    resp = _text(client, 10, 0.8, seed=7, **settings, ignore_eos=True)
    ref = tiny_engine.generate(
        PROMPT, max_new_tokens=10, temperature=0.8, seed=7, ignore_eos=True, **settings
    )
    assert resp == ref.output_text
    plain = tiny_engine.generate(PROMPT, max_new_tokens=10, temperature=0.0, ignore_eos=True)
    penalized = _text(client, 10, 0, repetition_penalty=3.0, ignore_eos=True)
    ref_penalized = tiny_engine.generate(
        PROMPT, max_new_tokens=10, temperature=0.0, repetition_penalty=3.0, ignore_eos=True
    )
    assert penalized == ref_penalized.output_text
    assert ref_penalized.output_ids != plain.output_ids  # the penalty changed something here


def test_ignore_eos_generates_max_tokens(client: openai.OpenAI, tiny_engine: KVBoost) -> None:
    """With end-of-sequence all but forced (logit_bias +100) a reply stops at once, unless ignore_eos."""
    messages = [{"role": "user", "content": "Hi"}]
    bias = {str(tiny_engine.tokenizer.eos_token_id): 100}
    stopped = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, logit_bias=bias
    )
    assert (
        stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    )  # the EOS itself
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "extra",
    [
        {"top_k": -2},
        {"top_k": 1.5},
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"repetition_penalty": 0},
        {"repetition_penalty": -1.0},
        {"ignore_eos": "yes"},
    ],
)
def test_bad_extras_are_400s_naming_the_parameter(tiny_url: str, extra: dict) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    resp = httpx.post(f"{tiny_url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == next(iter(extra)), resp.text
