"""The actual peak the memory model predicts: live CPU tensor bytes while a call runs."""

from __future__ import annotations

from collections.abc import Callable


def tensor_peak(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated while ``fn()`` runs (torch.profiler memory events), on top of
    what was live before: deterministic, unlike RSS, and the quantity :func:`kvb_planner.estimate_memory`
    predicts (the benchmarks under tools/ and the tests compare against it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
