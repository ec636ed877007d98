"""Prometheus metrics, in a registry owned by one server (no process-global collectors).

Per-request metrics keep their ``kvboost_*`` names. Engine-loop metrics that vLLM also exports use vLLM's
names under ``kvboost:`` (``kvboost:num_requests_running``, ``kvboost:kv_cache_usage_perc``, ...), so
dashboards built for vLLM need only the prefix changed; the rest are ``kvboost_*``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvb_cache.core.outputs import PagedStats
from kvb_cache.results import GenerationResult

if TYPE_CHECKING:
    from kvb_server.worker import WorkerStats

#: Seconds; TTFT on CPU spans milliseconds (cache hit) to seconds (long cold prompt).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EngineLoopCollector(Collector):
    """Engine-loop gauges and counters, read at scrape time from the worker's last snapshot.

    Never from the engine itself: it is not thread-safe, and a scrape must not wait for a step.
    """

    def __init__(
        self, worker_stats: Callable[[], WorkerStats], paged_stats: Callable[[], PagedStats | None]
    ) -> None:
        self._worker_stats = worker_stats
        self._paged_stats = paged_stats

    def describe(self) -> Iterator[Metric]:
        return self._families(None, None)

    def collect(self) -> Iterator[Metric]:
        return self._families(self._worker_stats(), self._paged_stats())

    @staticmethod
    def _families(worker: WorkerStats | None, paged: PagedStats | None) -> Iterator[Metric]:
        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge(
            "kvboost:num_requests_running",
            "Requests the engine is decoding (as of its last step)",
            None if worker is None else worker.running,
        )
        yield gauge(
            "kvboost:num_requests_waiting",
            "Requests not running yet: submitted to the engine thread or waiting inside the engine",
            None if worker is None else worker.waiting,
        )
        yield counter(
            "kvboost_engine_steps",
            "Engine steps run (one iteration over every running request)",
            None if worker is None else worker.steps,
        )
        yield gauge(
            "kvboost:kv_cache_usage_perc",
            "Fraction of KV blocks owned by running requests (1 = all)",
            None if paged is None else paged.kv_cache_usage,
        )
        yield counter(
            "kvboost:prefix_cache_queries",
            "Prompt tokens looked up in the block pool's prefix cache",
            None if paged is None else paged.prefix_cache_queries,
        )
        yield counter(
            "kvboost:prefix_cache_hits",
            "Prompt tokens served from cached KV blocks",
            None if paged is None else paged.prefix_cache_hits,
        )
        yield counter(
            "kvboost:num_preemptions",
            "Requests sent back to waiting because the pool ran out of blocks",
            None if paged is None else paged.preemptions,
        )
        blocks = GaugeMetricFamily(
            "kvboost_kv_blocks",
            "KV blocks by state: used (running requests), cached (reusable, evictable), free",
            labels=["state"],
        )
        if paged is not None:
            for state, value in (
                ("used", paged.blocks_used),
                ("cached", paged.blocks_cached),
                ("free", paged.blocks_free),
            ):
                blocks.add_metric([state], value)
        yield blocks


class ServerMetrics:
    """The counters and histograms ``GET /metrics`` exposes.

    Args:
        worker_stats: the engine worker's counters (queue depth, running requests, steps).
        paged_stats: the engine's block-pool counters as of its last step (None before the first).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self, worker_stats: Callable[[], WorkerStats], paged_stats: Callable[[], PagedStats | None]
    ) -> None:
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
            "kvboost_queue_depth",
            "Requests not running yet (what --max-queue-size bounds)",
            registry=self.registry,
        )
        self.queue_depth.set_function(lambda: worker_stats().waiting)
        self.registry.register(EngineLoopCollector(worker_stats, paged_stats))

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
