"""The engine's idle work as the worker runs it: when it is due, one step of it, and letting it go.

An engine may have work of its own to do while no request is in flight (``KVBoost.has_idle_work``: stitched
prompts computed exactly, ``StitchConfig.idle_copies``); a plain :class:`~kvb_server.engine.ServingEngine`
has none. The worker's thread runs it one step at a time, only after :data:`IDLE_GRACE_S` without a request
in flight, so a submission takes over at the next step.
"""

from __future__ import annotations

import logging
import time

from kvb_server.engine import ServingEngine

logger = logging.getLogger(__name__)

#: The engine's idle work starts only after this long with no request in flight. A client sending its next
#: request as soon as a reply ends (one chat user, an agent loop) would otherwise find an idle step in
#: progress: in tools/bench_rag_server.py (1 user, back-to-back requests, SmolLM2 on one CPU thread) that
#: cost +330 ms of TTFT p50 (2.67 s vs 2.35 s) and bought nothing, since each step was taken out at once.
IDLE_GRACE_S = 0.5


class IdleWork:
    """The engine's idle work and its counters; every method runs on the engine thread.

    Attributes:
        steps / seconds: steps (and seconds) of idle work run.
        errors: idle steps that raised (the work is then cleared; the worker keeps serving).
    """

    def __init__(self, engine: ServingEngine) -> None:
        self._engine = engine
        self.steps = 0
        self.seconds = 0.0
        self.errors = 0
        #: When a request was last in flight (the idle work waits IDLE_GRACE_S after it).
        self._last_busy = time.monotonic()

    def busy(self) -> None:
        """A step for requests just ran: the grace period starts again."""
        self._last_busy = time.monotonic()

    def due(self) -> float:
        """Seconds until the engine's idle work may run (<= 0: now); infinite when it has none."""
        # Optional for engines: KVBoost has idle work (StitchConfig.idle_copies); a plain ServingEngine not.
        has = getattr(self._engine, "has_idle_work", None)
        if has is None or not has():
            return float("inf")
        return self._last_busy + IDLE_GRACE_S - time.monotonic()

    def step(self) -> None:
        """One step of the engine's idle work (no request of ours is in flight, so no output is ours)."""
        started = time.monotonic()
        try:
            self._engine.step()
        except Exception as exc:  # the idle work is the engine's own: log it, keep serving
            self.errors += 1
            logger.error("engine idle step failed: %r", exc)
            self.clear()
        finally:
            self.seconds += time.monotonic() - started
            self.steps += 1

    def clear(self) -> None:
        """Drop the idle work (the prompt part-way holds blocks too; what it stored stays cached)."""
        clear = getattr(self._engine, "clear_idle_work", None)
        if clear is not None:
            clear()
