"""32 concurrent clients against one server: every greedy output equals the sequential one."""

from __future__ import annotations

import asyncio

import httpx
import openai

from kvb_cache import KVBoost

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
