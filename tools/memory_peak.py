"""Shared by the memory benchmarks under tools/: peak live CPU tensor bytes of a call."""

from __future__ import annotations

from collections.abc import Callable


def tensor_peak(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated while ``fn()`` runs (torch.profiler memory events), on top
    of what was live before: the quantity kvb-planner's memory model predicts."""
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
