"""vLLM's speculative-decoding counters on ``GET /metrics``, from the worker's snapshot of the drafter's
statistics (a composed engine's ``speculative_stats()``; nothing is exported for an engine without one,
as vLLM exports them only with speculative decoding configured).

``vllm:spec_decode_num_drafts`` counts verification rounds, ``..._num_draft_tokens`` the tokens drafted in
them, ``..._num_accepted_tokens`` those the target accepted, and ``..._num_accepted_tokens_per_pos`` (label
``position``) how many rounds accepted the drafted token at each position, so a dashboard built on vLLM's
names reads the acceptance rate and the per-position acceptance here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvb_server.engine_loop_metrics import VLLM_LABELS, vllm_label_values


class SpeculativeCollector(Collector):
    """The drafter's counters as of the engine's last step (never read from the engine at scrape time)."""

    def __init__(self, speculative_stats: Callable[[], dict[str, Any] | None], *, model_name: str) -> None:
        self._stats = speculative_stats
        self._model_name = model_name

    def describe(self) -> Iterator[Metric]:
        return iter(())  # whether there is a drafter is known only once the engine thread has run

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        labels = vllm_label_values(self._model_name)
        for name, doc, key in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "rounds"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "drafted_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "accepted_tokens"),
        ):
            metric = CounterMetricFamily(name, doc, labels=list(VLLM_LABELS))
            metric.add_metric(labels, float(stats.get(key, 0)))
            yield metric
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*VLLM_LABELS, "position"],
        )
        # accepted_histogram[i]: rounds that accepted exactly i tokens, so position p was accepted in every
        # round that accepted more than p.
        histogram = list(stats.get("accepted_histogram") or ())
        for position in range(max(len(histogram) - 1, 0)):
            per_pos.add_metric([*labels, str(position)], float(sum(histogram[position + 1 :])))
        yield per_pos
