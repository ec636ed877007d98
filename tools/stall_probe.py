"""A running chat stream's inter-token gaps around another request's arrival (the stall benchmarks).

A chat request decodes; after its ``tokens_before``-th token ``arrive()`` adds the request under test. The
time ``arrive()`` itself takes counts as a gap of the running stream (it runs on the engine's thread, as a
server's worker would run it). Used by ``bench_stitch_stall.py`` and ``bench_tier_stall.py``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

from kvb_cache import KVBoost, SamplingParams

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def gaps_around_arrival(
    engine: KVBoost,
    arrive: Callable[[], str],
    *,
    tokens_before: int = 8,
    until_finished: bool = False,
    prepare: Callable[[], None] | None = None,
) -> dict[str, object]:
    """Run the stream and the arrival through ``engine.step()``; returns ``max_gap`` (the running stream's
    largest gap after the arrival, seconds), ``median_gap_before``, ``ttft`` (the arrival's first output) and
    ``result`` (its :class:`~kvb_cache.GenerationResult` when ``until_finished``, else None).

    ``prepare`` runs right before the arrival, outside the measured gaps (what the benchmark does to the
    world, e.g. stalling Redis, is not the engine's time)."""
    running = engine.add_request(
        engine.chat_prompt(CHAT), SamplingParams(max_new_tokens=400, ignore_eos=True)
    )
    stamps: list[float] = []
    arrival, arrived_at, ttft, result = None, 0.0, None, None
    while True:
        outputs = engine.step()
        now = time.perf_counter()
        finished = False
        for out in outputs:
            if out.request_id == running:
                stamps.append(now)
            elif out.request_id == arrival:
                ttft = now - arrived_at if ttft is None else ttft
                if out.finished:
                    result, finished = out.result, True
        if len(stamps) == tokens_before and arrival is None:
            if prepare is not None:
                prepare()
                stamps[-1] = time.perf_counter()
            arrived_at = time.perf_counter()
            arrival = arrive()
            stamps.append(time.perf_counter())  # arrive()'s own time counts against the running stream
        if ttft is not None and (finished or not until_finished):
            break
    engine.abort(running)
    # stamps[tokens_before - 1]: the last token before the arrival; the next stamp: arrive() returned.
    after = [b - a for a, b in itertools.pairwise(stamps[tokens_before - 1 :])]
    before = [b - a for a, b in itertools.pairwise(stamps[:tokens_before])]
    return {
        "max_gap": max(after),
        "median_gap_before": statistics.median(before),
        "ttft": ttft,
        "result": result,
    }
