"""32 concurrent clients against one server: every greedy output equals the sequential one."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from conftest import serve
from fakes import CharTokenizer, FakeEngine

from kvb_cache import KVBoost
from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
SYSTEM = "You are a helpful assistant. Answer briefly and precisely, one sentence at a time."
QUESTIONS = ["Where is Paris?", "Where is Rome?", "What is a fox?", "Who is lazy?"]


def conversation(client_id: int, turn: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{QUESTIONS[client_id % 4]} (client {client_id}, turn {turn})"},
    ]


def test_32_concurrent_clients_get_their_own_greedy_outputs(tiny_url: str, tiny_engine: KVBoost) -> None:
    clients, turns = 32, 2

    async def one_client(cid: int, api: openai.AsyncOpenAI) -> list[str]:
        out = []
        for turn in range(turns):
            if (cid + turn) % 3 == 0:  # a mix of streamed and non-streamed requests
                stream = await api.chat.completions.create(
                    model=MODEL, messages=conversation(cid, turn), max_tokens=5, temperature=0, stream=True
                )
                out.append("".join([c.choices[0].delta.content or "" async for c in stream]))
            else:
                resp = await api.chat.completions.create(
                    model=MODEL, messages=conversation(cid, turn), max_tokens=5, temperature=0
                )
                out.append(resp.choices[0].message.content)
        return out

    async def run() -> list[list[str]]:
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=120)
        api = openai.AsyncOpenAI(base_url=f"{tiny_url}/v1", api_key="x", http_client=http, max_retries=0)
        try:
            return await asyncio.gather(*(one_client(c, api) for c in range(clients)))
        finally:
            await api.close()

    before = httpx.get(f"{tiny_url}/v1/stats").json()["queue"]
    got = asyncio.run(run())
    expected = [
        [
            tiny_engine.generate(
                tiny_engine.chat_prompt(conversation(c, t)), max_new_tokens=5, temperature=0
            ).output_text
            for t in range(turns)
        ]
        for c in range(clients)
    ]
    assert got == expected
    after = httpx.get(f"{tiny_url}/v1/stats").json()["queue"]
    # Requests were really served together, not one by one: steps decoded several of them at once.
    assert after["steps"] > before["steps"]
    assert after["largest_step"] > 1
    assert after["in_flight"] == 0 and after["finished"] - before["finished"] == clients * turns


class StallsOnLongText(CharTokenizer):
    """Holds a long text's encoding until ``release`` is set (a few MiB of prompt take seconds)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        if len(text) > 100_000:
            self.entered.set()
            self.release.wait(30)
        return super().__call__(text, add_special_tokens)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x" * 200_000, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200_000}], "max_tokens": 1}),
        ("/tokenize", {"prompt": "x" * 200_000}),
    ],
)
def test_tokenizing_a_huge_prompt_leaves_the_event_loop_serving(path: str, body: dict) -> None:
    """A large body is tokenized off the event loop: while it is, /health (and every stream) is served.
    It was tokenized on the loop, so two 4 MiB prompts froze the SmolLM2 server for 5 s."""
    fake = FakeEngine()
    fake.tokenizer = tokenizer = StallsOnLongText()
    with serve(create_app(fake, ServerConfig(model_names=("fake-model",)))) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                big = asyncio.create_task(c.post(path, json=body))
                await asyncio.to_thread(tokenizer.entered.wait, 10)
                assert tokenizer.entered.is_set()
                health = await asyncio.wait_for(c.get("/health"), 10)  # before: stuck behind the tokenizer
                tokenizer.release.set()
                return health, await big

        try:
            health, big = asyncio.run(scenario())
        finally:
            tokenizer.release.set()
    assert health.status_code == 200
    assert big.status_code in (200, 400)  # tokenized (then served, or too long for the fake's context)
