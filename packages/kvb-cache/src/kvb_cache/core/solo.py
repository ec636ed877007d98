"""Solo requests: those that need a private ``transformers`` cache (per-request ``kv_cache_bits``, a seeded or
penalised speculative request), each an iterator of :class:`~kvb_cache.results.StreamEvent` advanced by one
event per engine step beside the batched forward.

Each holds its own cache and runs its own forwards, so at most ``limit`` (the engine's ``max_num_seqs``) run
at once; the rest wait, unprepared, and start oldest first as one ends. Before that bound a burst of them
(seeded sampled requests beside a drafter, live-quantized ones) all ran at once, every step one forward each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from kvb_cache.core.outputs import RequestId, RequestOutput
from kvb_cache.errors import RequestInterruptedError
from kvb_cache.results import StreamEvent

logger = logging.getLogger(__name__)

#: Prepares a solo request and gives its events (run when it may start).
SoloStart = Callable[[], Iterator[StreamEvent]]


class SoloRequests:
    """The running solo requests (``running``: their events) and those waiting for a place (``waiting``: how
    to start each), both oldest first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running: dict[RequestId, Iterator[StreamEvent]] = {}
        self.waiting: dict[RequestId, SoloStart] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.running or request_id in self.waiting

    def __bool__(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, request_id: RequestId, start: SoloStart) -> None:
        """``start()`` prepares the request (its cached prefix copied into its own cache) and gives its events.
        Started now while fewer than ``limit`` run and none waits (its errors raise here), else by a later
        :meth:`start_waiting` (its errors are then its output)."""
        if len(self.running) < self.limit and not self.waiting:
            self.running[request_id] = start()
        else:
            self.waiting[request_id] = start

    def start_waiting(self, outputs: list[RequestOutput]) -> None:
        """Start waiting requests, oldest first, while fewer than ``limit`` run; a start's failure is that
        request's output (appended to ``outputs``)."""
        while self.waiting and len(self.running) < self.limit:
            request_id = next(iter(self.waiting))
            start = self.waiting.pop(request_id)
            try:
                self.running[request_id] = start()
            except Exception as exc:
                logger.error("solo request %s failed to start: %r", request_id, exc, exc_info=exc)
                outputs.append(RequestOutput(request_id=request_id, delta_text="", error=exc))
            except BaseException:  # an interrupt: it waits again, first, for the next step to start it
                self.waiting = {request_id: start, **self.waiting}
                raise

    def advance(self, outputs: list[RequestOutput]) -> None:
        """One event of every running request, appended to ``outputs``; one that ends leaves."""
        for request_id in list(self.running):
            outputs.append(self._advance(request_id))

    def _advance(self, request_id: RequestId) -> RequestOutput:
        events = self.running[request_id]
        try:
            event = next(events)
        except StopIteration:  # ended without its result: an exception stopped the generator part-way
            del self.running[request_id]
            return RequestOutput(request_id=request_id, delta_text="", error=RequestInterruptedError())
        except Exception as exc:  # a solo request's failure ends it alone
            del self.running[request_id]
            logger.error("solo request %s failed: %r", request_id, exc, exc_info=exc)
            return RequestOutput(request_id=request_id, delta_text="", error=exc)
        if event.result is not None:
            del self.running[request_id]
        return RequestOutput(
            request_id=request_id,
            delta_text=event.delta_text,
            token_ids=event.token_ids,
            logprobs=event.logprobs,
            result=event.result,
        )

    def abort(self, request_id: RequestId) -> bool:
        """End ``request_id`` now (False if it is not a solo request): a waiting one was never prepared; a
        running one's generator is closed, which stores what is valid and frees its cache."""
        if self.waiting.pop(request_id, None) is not None:
            return True
        events = self.running.pop(request_id, None)
        if events is None:
            return False
        close = getattr(events, "close", None)
        if close is not None:
            close()
        return True
