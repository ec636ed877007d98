"""Operational routes: /health, /v1/stats (JSON-safe always), /v1/warm, /metrics."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine

import kvb_server
from kvb_cache import KVBoost
from kvb_server import ServerConfig, create_app


@pytest.fixture()
def fake_url() -> Iterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    with serve(create_app(fake, ServerConfig(model_names=("fake-model",)))) as url:
        yield fake, url


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return math.nan


def test_health(fake_url: tuple[FakeEngine, str]) -> None:
    _, url = fake_url
    assert httpx.get(url + "/health").json() == {"status": "ok", "model": "fake-model", "queue_depth": 0}


def test_version_is_vllms_route_without_a_key() -> None:
    with serve(create_app(FakeEngine(), ServerConfig(model_names=("fake-model",), api_key="k"))) as url:
        assert httpx.get(url + "/version").json() == {"version": kvb_server.__version__}


def test_stats_are_json_safe_even_with_nan_and_odd_keys(fake_url: tuple[FakeEngine, str]) -> None:
    _, url = fake_url
    resp = httpx.get(url + "/v1/stats")
    assert resp.status_code == 200
    body = resp.json()
    assert body["cache"] == {"entries": 1, "ratio": None, "kinds": {"1": "x"}}
    assert body["tiers"] == {"ram": {"bytes": 10}}
    assert body["queue"]["waiting"] == 0 and body["queue"]["max_queue_size"] == 256
    assert body["paged"]["block_size"] == 4 and body["paged"]["blocks_total"] == 256
    assert body["device"]["cuda_available"] in (True, False)
    assert set(body["throughput"]) >= {"completion_tokens", "tokens_per_s_recent"}


def test_stats_survive_a_failing_engine_source() -> None:
    class Broken(FakeEngine):
        def cache_stats(self):
            raise RuntimeError("tier backend unreachable")

    with serve(create_app(Broken(), ServerConfig(model_names=("fake-model",)))) as url:
        body = httpx.get(url + "/v1/stats").json()
    assert body["cache"] == {"error": "RuntimeError: tier backend unreachable"}


def test_warm_runs_on_the_engine(fake_url: tuple[FakeEngine, str]) -> None:
    fake, url = fake_url
    resp = httpx.post(url + "/v1/warm", json={"texts": ["system prompt A", "doc B"]})
    assert resp.status_code == 200
    assert fake.warmed == ["system prompt A", "doc B"]
    assert [r["tokens"] for r in resp.json()["results"]] == [15, 5]
    assert httpx.post(url + "/v1/warm", json={}).status_code == 400
    assert httpx.post(url + "/v1/warm", json={"text": 3}).status_code == 400


def test_warm_then_request_hits_the_cache(tiny_url: str) -> None:
    system = "Paris is the capital of France; Berlin is the capital of Germany; Rome is in Italy. " * 3
    warm = httpx.post(tiny_url + "/v1/warm", json={"text": system}).json()["results"][0]
    assert warm["tokens"] > 32 and warm["chunks"] >= 2
    resp = httpx.post(
        tiny_url + "/v1/completions",
        json={"model": "tiny-llama", "prompt": system + "Where?", "max_tokens": 2, "temperature": 0},
    ).json()
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_metrics_count_requests_tokens_and_hits(tiny_url: str, tiny_engine: KVBoost) -> None:
    before = httpx.get(tiny_url + "/metrics").text
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    for _ in range(2):
        r = httpx.post(
            tiny_url + "/v1/completions",
            json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200
    httpx.post(tiny_url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    after = httpx.get(tiny_url + "/metrics").text

    def delta(name: str) -> float:
        b = metric(before, name)
        return metric(after, name) - (0 if math.isnan(b) else b)

    assert delta('kvboost_requests_total{route="/v1/completions",status="200"}') == 2
    assert delta('kvboost_requests_total{route="/v1/completions",status="404"}') == 1
    assert delta("kvboost_completion_tokens_total") == 6
    assert delta("kvboost_time_to_first_token_seconds_count") == 2
    assert delta('kvboost_request_latency_seconds_count{route="/v1/completions"}') == 2
    assert delta('kvboost_cache_chunks_total{kind="exact"}') >= 1  # the second request reused the first's KV
    assert "kvboost_queue_depth 0.0" in after
