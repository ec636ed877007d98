"""The iterator :meth:`~kvb_cache.engine.KVBoost.stream` returns: one request's events, aborted when closed."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator

from kvb_cache.core.outputs import RequestId
from kvb_cache.errors import KVBoostError, RequestInterruptedError
from kvb_cache.results import StreamEvent


class RequestStream(Iterator[StreamEvent]):
    """What :meth:`~kvb_cache.engine.KVBoost.stream` returns: the request's :class:`StreamEvent` s, in order.

    ``close()`` (also at the end of a ``with`` block, or when the stream is dropped) aborts the request
    unless it finished. A plain generator cannot do that before its first ``next()``: Python never runs
    the ``finally`` of a generator that has not started, so a stream opened and closed unread kept its
    request running, decoded by the next loop and holding pool blocks (``reset_cache`` refused meanwhile).
    """

    def __init__(
        self, request_id: RequestId, events: Generator[StreamEvent, None, None], unfollow: Callable[[], None]
    ) -> None:
        """``events``: the request's events as the engine's loops deliver them (closing it stops following
        the request and aborts it unless it finished); ``unfollow``: the same for a stream never started."""
        self.request_id = request_id
        self._events = events
        self._unfollow: Callable[[], None] | None = unfollow
        self._started = False
        self._broken: BaseException | None = None  # what escaped it before that (the request is aborted)

    def __next__(self) -> StreamEvent:
        if self._broken is not None:
            # Iterating again after an interrupt (a notebook cell run twice) ended at once, as if the reply
            # were whole: an audit, 2026-12-01.
            raise RequestInterruptedError(
                f"request {self.request_id} was aborted when {type(self._broken).__name__} escaped its stream "
                "before the last token; the reply is incomplete: send it again"
            )
        if self._unfollow is None:
            raise StopIteration
        self._started = True
        try:
            event = next(self._events)
        except (StopIteration, KVBoostError):  # its end, or its own outcome (aborted, non-finite logits...)
            raise
        except BaseException as exc:  # an interrupt (or a callback's error) cut it: it was aborted
            self._broken = exc
            raise
        return event

    def close(self) -> None:
        """Stop following the request; an unfinished one is aborted."""
        unfollow, self._unfollow = self._unfollow, None
        if unfollow is None:
            return
        if self._started:
            self._events.close()  # runs its finally (which knows whether the request finished)
        else:
            unfollow()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
