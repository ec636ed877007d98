"""Prometheus metrics, in a registry owned by one server (no process-global collectors).

Two sets of names:

- ``vllm:*``: where vLLM exports the same quantity, under vLLM's exact name, type, unit and
  ``model_name`` and ``engine`` labels (the first ``--served-model-name``; engine ``"0"``), so dashboards and alerts built for vLLM work
  unchanged: requests running / waiting, KV usage, prefix-cache queries and hits (in tokens), preemptions,
  prompt and generation tokens, finished requests by reason, and the request-level histograms with vLLM's
  buckets (time to first token, end-to-end latency, tokens per request, inter-token latency, and the
  queue / prefill / decode / inference phases).
- ``kvboost_*`` and ``kvboost:*``: this server's own names (per-route HTTP counts and latency, cache chunk
  kinds, block states, engine steps), kept as before; the ``kvboost:*`` engine-loop ones mirror the
  ``vllm:*`` ones without the label.

Per-request metrics are observed here as each choice finishes; the engine-loop ones are read at scrape
time by :class:`~kvb_server.engine_loop_metrics.EngineLoopCollector`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvb_cache.core.outputs import PagedStats
from kvb_cache.results import GenerationResult
from kvb_server.engine_loop_metrics import VLLM_LABELS, EngineLoopCollector, vllm_label_values
from kvb_server.speculative_metrics import SpeculativeCollector

if TYPE_CHECKING:
    from kvb_server.worker_stats import WorkerStats

#: vLLM's buckets (``vllm/v1/metrics/loggers.py``), so quantiles compare across the two servers.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: vLLM's ``finished_reason`` values this engine produces from finished choices; ``abort`` (client gone,
#: deadline, shutdown, failed step) is read from the worker's count.
FINISHED_REASONS = ("stop", "length")
#: vLLM's ``time_per_output_token`` / ``inter_token_latency`` buckets.
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, up to ``max_model_len``)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


#: Seconds; TTFT on CPU spans milliseconds (cache hit) to seconds (long cold prompt).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """The counters and histograms ``GET /metrics`` exposes.

    Args:
        worker_stats: the engine worker's counters (queue depth, running requests, steps).
        paged_stats: the engine's block-pool counters as of its last step (None before the first).
        model_name: the ``model_name`` label of the ``vllm:*`` metrics (vLLM: the first served name).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        worker_stats: Callable[[], WorkerStats],
        paged_stats: Callable[[], PagedStats | None],
        *,
        model_name: str,
        max_model_len: int | None = None,
        speculative_stats: Callable[[], dict[str, Any] | None] | None = None,
        cache_config: Mapping[str, Any] | None = None,
    ) -> None:
        # As vLLM does: no ``*_created`` series, which doubled the series count (one per counter and
        # histogram) and which vLLM's dashboards do not read. prometheus_client's switch is process-wide.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._worker_stats = worker_stats
        self._aborted_seen = (0, 0)
        self._vllm = _VllmRequestMetrics(
            self.registry, model_name, lambda: _aborted_requests(worker_stats()), max_model_len=max_model_len
        )
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
        self.registry.register(EngineLoopCollector(worker_stats, paged_stats, model_name=model_name))
        if speculative_stats is not None:
            self.registry.register(SpeculativeCollector(speculative_stats, model_name=model_name))
        if cache_config is not None:
            info = cache_config_labels(cache_config)
            # vLLM's info gauge (value 1, the settings as labels): dashboards read the pool's dtype and size.
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                list(info),
                registry=self.registry,
            ).labels(**info).set(1)

    def observe_result(
        self, result: GenerationResult, *, queue_s: float, token_intervals: Sequence[float] | None = None
    ) -> None:
        """Record one finished choice: TTFT and latency (queueing included), tokens and per-chunk hit kinds.

        ``token_intervals``: seconds between consecutive generated tokens, as a stream saw them (one per
        token after the first); None, or the wrong count, observes each interval as the choice's mean.
        """
        self._vllm.observe(result, queue_s=queue_s, token_intervals=token_intervals)
        self.ttft.observe(queue_s + result.ttft_ms / 1e3)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_prompt_tokens.inc(result.cached_tokens)
        self.completion_tokens.inc(result.completion_tokens)
        for chunk in result.chunks:
            self.chunk_hits.labels(kind=chunk.kind.value).inc()

    def observe_prompt_only(self, result: GenerationResult) -> None:
        """Record a choice that generated nothing (echo with ``max_tokens: 0``): its prompt tokens (scored
        when logprobs were asked) and its finish, but no latency histograms, which time a first token it
        never had. Such requests moved no counter before."""
        self._vllm.prompt_tokens.inc(result.prompt_tokens)
        self._vllm.success.count(result.finish_reason)
        self._vllm.request_prompt_tokens.observe(result.prompt_tokens)
        self._vllm.request_generation_tokens.observe(0)
        self.prompt_tokens.inc(result.prompt_tokens)

    def render(self) -> bytes:
        self._count_aborted_tokens()
        return generate_latest(self.registry)

    def _count_aborted_tokens(self) -> None:
        """Add the tokens of requests aborted since the last scrape (the worker counts them on the engine
        thread; no result reaches :meth:`observe_result` for them) to the token counters, as vLLM counts
        every prefilled and generated token (a client hanging up mid-stream left them out)."""
        stats = self._worker_stats()
        prompt = stats.aborted_prompt_tokens - self._aborted_seen[0]
        generated = stats.aborted_generation_tokens - self._aborted_seen[1]
        self._aborted_seen = (stats.aborted_prompt_tokens, stats.aborted_generation_tokens)
        for counter, n in (
            (self.prompt_tokens, prompt),
            (self._vllm.prompt_tokens, prompt),
            (self.completion_tokens, generated),
            (self._vllm.generation_tokens, generated),
        ):
            if n > 0:
                counter.inc(n)


def cache_config_labels(cache_stats: Mapping[str, Any]) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels from an engine's ``cache_stats()``: vLLM's names for the settings
    this engine has (block size, KV dtype, pool blocks, prefix caching), and ``engine``."""
    paged = cache_stats.get("paged") or {}
    labels = {
        "block_size": cache_stats.get("block_size", paged.get("block_size")),
        "cache_dtype": cache_stats.get("kv_cache_dtype"),
        "num_gpu_blocks": paged.get("blocks_total"),
        "enable_prefix_caching": cache_stats.get("prefix_caching"),
    }
    return {**{k: str(v) for k, v in labels.items() if v is not None}, "engine": "0"}


class _VllmRequestMetrics:
    """Per-request ``vllm:*`` metrics, one series per ``model_name`` (created at zero, as vLLM does)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        aborted: Callable[[], int],
        *,
        max_model_len: int | None,
    ) -> None:
        label = list(VLLM_LABELS)
        values = vllm_label_values(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, label, buckets=buckets, registry=registry).labels(*values)

        token_buckets = one_two_five_buckets(max_model_len or 2**20)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        # vLLM renamed time_per_output_token to inter_token_latency (0.11) and exports both.
        self.inter_token = [
            histogram(name, doc, VLLM_TPOT_BUCKETS)
            for name, doc in (
                ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
            )
        ]
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_E2E_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            VLLM_E2E_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            VLLM_E2E_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            VLLM_E2E_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", label, registry=registry
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", label, registry=registry
        ).labels(*values)
        self.success = _FinishedRequests(model_name, aborted)
        registry.register(self.success)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            label,
            buckets=VLLM_TTFT_BUCKETS,
            registry=registry,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            label,
            buckets=VLLM_E2E_BUCKETS,
            registry=registry,
        ).labels(*values)

    def observe(
        self, result: GenerationResult, *, queue_s: float, token_intervals: Sequence[float] | None = None
    ) -> None:
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(result.completion_tokens)
        if getattr(result, "grammar_error", None) is None:
            # A choice whose grammar failed is answered with an error (400, or an error event), not as a
            # success: its tokens count (the work was done), its finish does not (it was counted "stop").
            self.success.count(result.finish_reason)
        self.ttft.observe(queue_s + result.ttft_ms / 1e3)
        self.e2e.observe(queue_s + result.total_ms / 1e3)
        self.request_prompt_tokens.observe(result.prompt_tokens)
        self.request_generation_tokens.observe(result.completion_tokens)
        # NOTE: vLLM's phases: WAITING = arrival to first scheduling, PREFILL = first scheduling to first
        # token, DECODE = first to last token, RUNNING (inference) = first scheduling to last token. The
        # engine's clock starts when the worker hands it the request, so WAITING is the server's queue
        # (queue_s) plus the engine's own (queued_ms: a full batch or pool, a stitched prompt's repair);
        # ttft_ms and total_ms include the latter, so it is taken out of prefill and inference (clamped to
        # [0, ttft_ms], so no phase is negative and queue + inference = e2e).
        queued_ms = min(max(result.queued_ms, 0.0), result.ttft_ms)
        self.queue_time.observe(max(queue_s, 0.0) + queued_ms / 1e3)
        self.inference_time.observe(max(result.total_ms - queued_ms, 0.0) / 1e3)
        self.prefill_time.observe(max(result.ttft_ms - queued_ms, 0.0) / 1e3)
        decode_s = max(result.total_ms - result.ttft_ms, 0.0) / 1e3
        self.decode_time.observe(decode_s)
        # A streamed choice's intervals are timed as its tokens left the engine; a non-streamed result
        # carries no per-token times, so each of its intervals is observed as their mean (count and sum
        # exact, only the spread within the request lost).
        count = result.completion_tokens - 1
        if token_intervals is None or len(token_intervals) != count:
            token_intervals = [decode_s / count] * count if count > 0 else []
        for histogram in self.inter_token:
            for interval in token_intervals:
                histogram.observe(interval)


def _aborted_requests(stats: WorkerStats) -> int:
    """Requests aborted in the engine, as vLLM's ``abort`` series counts them: a ``/v1/warm`` text is cache
    management, not a request (an abandoned warm moved the abort-rate panel with no request behind it)."""
    return stats.aborted - stats.warm_aborted


class _FinishedRequests(Collector):
    """``vllm:request_success_total{finished_reason}``: choices that finished (``stop`` / ``length``, counted
    here as they finish) and requests aborted in the engine (``abort``, the worker's count, read at scrape
    time), as vLLM counts them.

    A collector rather than a ``Counter``: the aborts are counted on the engine thread, by the worker, and
    a metric family cannot be split between a ``Counter`` and a collector.
    """

    def __init__(self, model_name: str, aborted: Callable[[], int]) -> None:
        self._labels = vllm_label_values(model_name)
        self._aborted = aborted
        self._counts = dict.fromkeys(FINISHED_REASONS, 0)
        self._lock = threading.Lock()

    def count(self, finish_reason: str | None) -> None:
        if finish_reason in self._counts:
            with self._lock:
                self._counts[finish_reason] += 1

    def describe(self) -> Iterator[Metric]:
        yield self._family()  # without samples: the worker may not be running yet

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        with self._lock:
            counts = dict(self._counts)
        for reason, value in counts.items():
            family.add_metric([*self._labels, reason], value)
        family.add_metric([*self._labels, "abort"], self._aborted())
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*VLLM_LABELS, "finished_reason"],
        )
