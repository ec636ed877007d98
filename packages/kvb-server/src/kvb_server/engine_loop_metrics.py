"""The engine-loop metrics of ``GET /metrics``, read at scrape time from the worker's last snapshot.

Queue and running-request gauges, engine and idle steps, KV usage, prefix-cache queries and hits,
preemptions and block states: each under this server's ``kvboost*`` name and, where vLLM exports the same
quantity, under vLLM's ``vllm:*`` name with its ``model_name`` and ``engine`` labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvb_cache.core.outputs import PagedStats

if TYPE_CHECKING:
    from kvb_server.worker_stats import WorkerStats

#: vLLM's labels on every ``vllm:*`` metric (v1: ``PrometheusStatLogger``): the first served model name and
#: the engine's index under data parallelism; one engine here, so always index 0.
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"


def vllm_label_values(model_name: str) -> list[str]:
    """The values of :data:`VLLM_LABELS` for this server's one engine."""
    return [model_name, ENGINE_INDEX]


class EngineLoopCollector(Collector):
    """Engine-loop gauges and counters, read at scrape time from the worker's last snapshot.

    Never from the engine itself: it is not thread-safe, and a scrape must not wait for a step.
    """

    def __init__(
        self,
        worker_stats: Callable[[], WorkerStats],
        paged_stats: Callable[[], PagedStats | None],
        *,
        model_name: str,
    ) -> None:
        self._worker_stats = worker_stats
        self._paged_stats = paged_stats
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None, None)
        yield from self._vllm_families(None, None)

    def collect(self) -> Iterator[Metric]:
        worker, paged = self._worker_stats(), self._paged_stats()
        yield from self._families(worker, paged)
        yield from self._vllm_families(worker, paged)

    def _vllm_families(self, worker: WorkerStats | None, paged: PagedStats | None) -> Iterator[Metric]:
        """The same readings under vLLM's names and labels (no sample until known)."""
        labels = vllm_label_values(self._model_name)

        def family(
            kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str, value: float | None
        ) -> Metric:
            metric = kind(name, doc, labels=list(VLLM_LABELS))
            if value is not None:
                metric.add_metric(labels, value)
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(
            gauge,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            None if worker is None else worker.running,
        )
        yield family(
            gauge,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            None if worker is None else worker.waiting,
        )
        yield family(
            gauge,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            None if paged is None else paged.kv_cache_usage,
        )
        # NOTE: the engine counts these in tokens, as vLLM does: each admission queries the prompt's tokens
        # and hits the ones mapped from cached blocks (a preempted request that is readmitted counts again).
        yield family(
            counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            None if paged is None else paged.prefix_cache_queries,
        )
        yield family(
            counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            None if paged is None else paged.prefix_cache_hits,
        )
        yield family(
            counter,
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            None if paged is None else paged.preemptions,
        )

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
        yield counter(
            "kvboost_idle_steps",
            "Engine steps of idle work (stitched prompts computed exactly while no request was in flight)",
            None if worker is None else worker.idle_steps,
        )
        yield counter(
            "kvboost_idle_seconds",
            "Seconds the engine thread spent on idle work",
            None if worker is None else worker.idle_s,
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
        yield gauge(
            "kvboost:num_requests_loading",
            "Waiting requests whose cached prefix is being read from the disk/Redis tiers",
            None if paged is None else paged.loading,
        )
        yield counter(
            "kvboost:tier_loads",
            "Disk/Redis lookups started for waiting requests (off the engine loop)",
            None if paged is None else paged.tier_loads,
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
