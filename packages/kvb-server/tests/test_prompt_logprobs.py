"""vLLM's ``prompt_logprobs`` on ``/v1/completions`` (per choice) and ``/v1/chat/completions`` (top level):
real engine (tiny Llama), the official ``openai`` client's ``extra_body`` and raw HTTP. The expected numbers
come from one plain forward of the model."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from kvb_cache import KVBoost
from kvb_server import ServerConfig, create_app
from kvb_server.schemas.generation_responses import ChatCompletionResponse, CompletionResponse

MODEL = "tiny-llama"


def _forward(engine: KVBoost, ids: list[int]) -> torch.Tensor:
    """``[n - 1, V]`` log-softmax of the positions that predict ``ids[1:]``."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _check(entries: list, ids: list[int], logp: torch.Tensor, top: int) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for position, (entry, token) in enumerate(zip(entries[1:], ids[1:], strict=True)):
        row = logp[position]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=2e-5)
        # vLLM's rank: 1 + the tokens more likely than the prompt's own (near-ties within 2e-5 either way).
        lower = int((row > row[token] + 2e-5).sum()) + 1
        assert lower <= own["rank"] <= int((row > row[token] - 2e-5).sum()) + 1
        best = torch.topk(row, top).indices.tolist() if top else []
        assert set(entry) <= {str(token), *map(str, best)} and len(entry) >= top
        for alt in best:
            if alt != token:
                assert entry[str(alt)]["rank"] == best.index(alt) + 1


@pytest.mark.parametrize("top", [0, 3])
def test_completions_prompt_logprobs_are_a_plain_forwards(
    tiny_url: str, tiny_engine: KVBoost, top: int
) -> None:
    client = openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="x", max_retries=0)
    prompts = ["Rome is in Italy", "Paris is in"]
    resp = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": top}
    )
    CompletionResponse.model_validate(resp.model_dump())
    for choice in resp.choices:
        ids = tiny_engine.tokenizer(prompts[choice.index // 2])["input_ids"]
        _check(choice.model_extra["prompt_logprobs"], ids, _forward(tiny_engine, ids), top)
    plain = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_chat_prompt_logprobs_sit_at_the_top_level(tiny_url: str, tiny_engine: KVBoost) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    body = httpx.post(
        f"{tiny_url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 2},
    ).json()
    ChatCompletionResponse.model_validate(body)
    ids = tiny_engine.chat_prompt(messages)
    _check(body["prompt_logprobs"], ids, _forward(tiny_engine, ids), 2)
    assert "prompt_logprobs" not in body["choices"][0]


def test_prompt_logprobs_beside_echo_keep_each_its_own_count(tiny_url: str) -> None:
    """One scoring pass serves both: echo's arrays keep ``logprobs`` alternatives, vLLM's ``prompt_logprobs``
    its own."""
    body = httpx.post(
        f"{tiny_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "a b c d",
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "prompt_logprobs": 4,
        },
    ).json()
    choice = body["choices"][0]
    assert all(top is None or len(top) <= 2 for top in choice["logprobs"]["top_logprobs"])
    assert all(entry is None or len(entry) >= 4 for entry in choice["prompt_logprobs"])


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt_logprobs": 1, "stream": True},
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": -2},
        {"prompt_logprobs": 1.5},
    ],
)
def test_bad_prompt_logprobs_are_a_400_naming_them(tiny_url: str, extra: dict) -> None:
    for route, body in (
        ("completions", {"prompt": "a b"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ):
        resp = httpx.post(f"{tiny_url}/v1/{route}", json={"model": MODEL, "max_tokens": 1, **body, **extra})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "prompt_logprobs"


def test_every_token_with_no_logprobs_cap(tiny_engine: KVBoost) -> None:
    from conftest import serve

    with serve(create_app(tiny_engine, ServerConfig(model_names=(MODEL,), max_logprobs=-1))) as url:
        body = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "a b c", "max_tokens": 1, "prompt_logprobs": -1},
        ).json()
    vocab = tiny_engine.model.config.vocab_size
    assert all(entry is None or len(entry) == vocab for entry in body["choices"][0]["prompt_logprobs"])
