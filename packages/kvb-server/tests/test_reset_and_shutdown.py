"""The cache reset route (auth, engine thread, busy engine) and the engine's close() on shutdown."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import build_tiny_engine, serve
from fakes import FakeEngine
from test_app_errors import assert_openai_error, wait_until
from test_app_ops import metric

from kvb_cache.tiers import TierConfig
from kvb_server import ServerConfig, create_app
from kvb_server.config import TenantKey
from kvb_server.errors import ShuttingDownError
from kvb_server.worker import EngineWorker

MODEL = "fake-model"


@pytest.mark.parametrize("path", ["/v1/cache/reset", "/reset_prefix_cache"])
def test_reset_runs_on_the_engine_thread(path: str) -> None:
    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,)))) as url:
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        wait_until(lambda: not fake.has_unfinished())
        resp = httpx.post(url + path)  # no body: RAM only, as vLLM's route
        assert resp.status_code == 200, resp.text
        assert resp.json() == {
            "object": "cache.reset",
            "lower_tiers": False,
            "blocks_dropped": 2,
            "lower_tiers_cleared": False,
        }
        assert httpx.post(url + path, json={"lower_tiers": True}).json()["lower_tiers_cleared"] is True
        assert_openai_error(httpx.post(url + path, json={"lower_tiers": "yes"}), 400, param="lower_tiers")
        assert_openai_error(httpx.post(url + path, json={"all": True}), 400, param="all")
    assert fake.resets == [False, True]
    assert fake.reset_threads == ["kvb-engine", "kvb-engine"]


def test_reset_needs_the_operator_key() -> None:
    fake = FakeEngine()
    config = ServerConfig(
        model_names=(MODEL,), api_key="operator", tenant_keys=(TenantKey(key="key-a", salt="a"),)
    )
    with serve(create_app(fake, config)) as url:
        for path in ("/v1/cache/reset", "/reset_prefix_cache"):
            assert_openai_error(httpx.post(url + path), 401, code="invalid_api_key")
            wrong = httpx.post(url + path, headers={"Authorization": "Bearer nope"})
            assert_openai_error(wrong, 401, code="invalid_api_key")
            tenant = httpx.post(url + path, headers={"Authorization": "Bearer key-a"})
            assert_openai_error(tenant, 403, code="permission_denied")
            resets = len(fake.resets)
            ok = httpx.post(url + path, headers={"Authorization": "Bearer operator"})
            assert ok.status_code == 200 and len(fake.resets) == resets + 1
    assert fake.resets == [False, False]  # only the operator's calls reached the engine


def test_reset_while_requests_run_is_409() -> None:
    fake = FakeEngine(token_delay_s=0.02)
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), max_tokens=150))) as url:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 100}
                running = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.to_thread(wait_until, lambda: bool(fake.step_log))
                return await c.post("/v1/cache/reset"), await running

        busy, done = asyncio.run(scenario())
    err = assert_openai_error(busy, 409, code="cache_busy")
    assert "1 running" in err["message"]
    assert done.status_code == 200 and fake.resets == []


def test_shutdown_closes_the_engine_on_its_thread() -> None:
    fake = FakeEngine()
    config = ServerConfig(model_names=(MODEL,), shutdown_timeout_s=5.0)
    with serve(create_app(fake, config)) as url:
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code == 200
        assert fake.closed == []
    assert fake.closed == ["kvb-engine"]
    assert 0 < fake.close_timeouts[0] <= 5.0  # the engine bounds its flush by what is left


def test_shutdown_can_leave_the_engine_open() -> None:
    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), close_engine=False))):
        pass
    assert fake.closed == []


def test_a_slow_close_does_not_hold_shutdown_past_its_timeout() -> None:
    fake = FakeEngine()
    fake.close_delay_s = 3.0
    started = time.monotonic()
    with serve(create_app(fake, ServerConfig(model_names=(MODEL,), shutdown_timeout_s=0.3))):
        started = time.monotonic()
    assert time.monotonic() - started < 2.5
    wait_until(lambda: fake.closed == ["kvb-engine"], timeout=10)  # it still finishes in the background


def test_a_stopped_worker_refuses_new_work() -> None:
    async def scenario() -> None:
        fake = FakeEngine()
        worker = EngineWorker(fake, ServerConfig(model_names=(MODEL,)))
        worker.start()
        await worker.stop(close_engine=True, timeout_s=5)
        with pytest.raises(ShuttingDownError) as err:
            await worker.call(lambda: 1, timeout_s=1)
        assert err.value.status_code == 503
        assert fake.closed == ["kvb-engine"]

    asyncio.run(scenario())


PROMPT = "You are a helpful assistant. Answer briefly and precisely, one sentence at a time. " * 3


def cached_tokens(url: str) -> int:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_reset_and_shutdown_flush_on_the_real_engine(tmp_path) -> None:
    """Reset drops the pool's prefixes; shutdown drains the disk writes, so a new engine starts warm."""
    config = ServerConfig(model_names=("tiny-llama",), max_tokens=4)
    first = build_tiny_engine(tiers=TierConfig(disk_cache_dir=tmp_path))
    with serve(create_app(first, config)) as url:
        assert cached_tokens(url) == 0
        assert cached_tokens(url) > 0
        dropped = httpx.post(url + "/v1/cache/reset").json()
        assert dropped["blocks_dropped"] > 0 and dropped["lower_tier_records_dropped"] == 0
        assert cached_tokens(url) > 0  # RAM forgot it; the disk tier still had it
        wiped = httpx.post(url + "/v1/cache/reset", json={"lower_tiers": True}).json()
        assert wiped["lower_tier_records_dropped"] > 0
        assert cached_tokens(url) == 0
        assert cached_tokens(url) > 0
    assert first._closed  # the server closed it on shutdown, draining queued writes
    second = build_tiny_engine(tiers=TierConfig(disk_cache_dir=tmp_path))
    with serve(create_app(second, config)) as url:
        assert cached_tokens(url) > 0  # from the disk records the first server flushed
        # ... read off the engine loop (docs/tiers.md), and counted where operators look
        assert httpx.get(url + "/v1/stats").json()["paged"]["tier_loads"] >= 1
        text = httpx.get(url + "/metrics").text
        assert metric(text, "kvboost:tier_loads_total") >= 1
        assert metric(text, "kvboost:num_requests_loading") == 0


def _completion_text(response: httpx.Response) -> str:
    """The text of a completion, non-streamed or streamed (SSE deltas joined)."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.json()["choices"][0]["text"]
    parts = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            parts.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
    return "".join(parts)


def test_warm_between_steps_does_not_lose_requests_in_flight() -> None:
    """/v1/warm runs the engine loop itself: requests in flight advance (and may finish) inside it, and must
    still be answered (they used to fail with 'the engine lost track of requests in flight')."""
    config = ServerConfig(model_names=("tiny-llama",), max_tokens=64)
    engine = build_tiny_engine()

    async def scenario(url: str) -> list:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {
                "model": "tiny-llama",
                "prompt": PROMPT,
                "max_tokens": 64,
                "temperature": 0,
            }

            async def warm_later(i: int) -> httpx.Response:
                await asyncio.sleep(0.02 * (i + 1))  # land between the generations' steps
                return await client.post("/v1/warm", json={"text": f"Document {i}. {PROMPT}"})

            gens = [client.post("/v1/completions", json={**body, "stream": i % 2 == 1}) for i in range(4)]
            responses = await asyncio.gather(*gens, *(warm_later(i) for i in range(6)))
            bad = [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200]
            if bad:
                return bad
            texts = [_completion_text(r) for r in responses[:4]]
            return [len(set(texts)) == 1 and bool(texts[0])]

    with serve(create_app(engine, config)) as url:
        for _ in range(3):
            assert asyncio.run(scenario(url)) == [True]
