"""The engine worker's counters as one snapshot, what ``/v1/stats["queue"]`` and ``/metrics`` report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStats:
    """Queue and engine-loop counters (``/v1/stats["queue"]``).

    Attributes:
        waiting: requests not running yet: submitted but not handed to the engine, plus those the engine
            holds waiting (as of its last step). What ``max_queue_size`` bounds.
        running: requests the engine is decoding (as of its last step).
        in_flight: requests handed to the engine and not finished.
        steps: ``engine.step()`` calls; ``step_errors`` of them raised.
        largest_step: most requests that received output from one step.
        added / finished / aborted / rejected / failed: requests handed to the engine / completed / dropped
            (client gone, deadline, failed step) / refused by ``add_request`` / ended alone by the engine
            (their token could not be chosen or emitted, e.g. a sampled row with non-finite logits; the
            other requests of the step went on).
        calls: engine calls run between steps (warm, stats).
        busy_s: seconds spent inside ``step()`` for requests.
        idle_steps / idle_s: steps (and seconds) of the engine's idle work, run while no request was in
            flight.
    """

    waiting: int
    running: int
    in_flight: int
    max_queue_size: int
    steps: int
    step_errors: int
    largest_step: int
    added: int
    finished: int
    aborted: int
    rejected: int
    calls: int
    busy_s: float
    idle_steps: int = 0
    idle_s: float = 0.0
    failed: int = 0
