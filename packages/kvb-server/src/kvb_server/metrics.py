"""Prometheus metrics, in a registry owned by one server (no process-global collectors)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvb_cache.results import GenerationResult

#: Seconds; TTFT on CPU spans milliseconds (cache hit) to seconds (long cold prompt).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The counters and histograms ``GET /metrics`` exposes."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvboost_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "kvboost_time_to_first_token_seconds",
            "Arrival to first generated token, per choice",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvboost_request_latency_seconds",
            "Arrival to response complete, per generation request",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvboost_prompt_tokens", "Prompt tokens processed", registry=self.registry
        )
        self.cached_prompt_tokens = Counter(
            "kvboost_cached_prompt_tokens",
            "Prompt tokens whose KV came from the cache",
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "kvboost_completion_tokens", "Tokens generated", registry=self.registry
        )
        self.chunk_hits = Counter(
            "kvboost_cache_chunks",
            "Prompt chunks by how they were served (exact, partial, stitched, miss)",
            ["kind"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "kvboost_queue_depth", "Requests waiting for the engine", registry=self.registry
        )
        self.queue_depth.set_function(queue_depth)

    def observe_result(self, result: GenerationResult, *, queue_s: float) -> None:
        """Record one finished choice: TTFT (queueing included), tokens and per-chunk hit kinds."""
        self.ttft.observe(queue_s + result.ttft_ms / 1e3)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_prompt_tokens.inc(result.cached_tokens)
        self.completion_tokens.inc(result.completion_tokens)
        for chunk in result.chunks:
            self.chunk_hits.labels(kind=chunk.kind.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
