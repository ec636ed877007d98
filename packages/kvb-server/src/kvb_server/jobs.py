"""Units of work for the engine worker, and the updates it sends back to the waiting request."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NewType

from kvb_cache.results import GenerationResult, StreamEvent
from kvb_cache.sampling import SamplingParams
from kvb_server.gate import EngineSettings, RunProbe

JobId = NewType("JobId", int)

#: How often a waiting handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.2

#: ``Request.is_disconnected`` of the handler's HTTP request.
IsDisconnected = Callable[[], Awaitable[bool]]


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready; its jobs were cancelled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobUpdate:
    """One message from the worker thread to a request handler.

    Exactly one of ``event``, ``result`` and ``error`` is set. Streaming jobs get an event for every engine
    output of theirs (the last one carries the result); other jobs get only the result, or the error that
    ended them.
    """

    choice: int
    event: StreamEvent | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    #: Seconds from the request's arrival to the engine accepting it (``add_request``).
    queue_s: float = 0.0
    #: ``time.perf_counter()`` when the worker routed it, right after the step that produced it.
    at: float = field(default_factory=time.perf_counter)


class Inbox:
    """The asyncio queue a request handler reads its :class:`JobUpdate` s from, fed from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[JobUpdate] = asyncio.Queue()
        self._on_unread: Callable[[JobUpdate], None] | None = None

    def put_threadsafe(self, update: JobUpdate) -> None:
        # The loop may already be closed when a job finishes after server shutdown: nobody is waiting then.
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, update)

    def _deliver(self, update: JobUpdate) -> None:
        if self._on_unread is not None:
            self._on_unread(update)
        else:
            self._queue.put_nowait(update)

    async def get(self, timeout: float) -> JobUpdate:
        """Next update; raises ``asyncio.TimeoutError`` after ``timeout`` seconds (the builtin ``TimeoutError``
        from Python 3.11 on, a class of its own on 3.10)."""
        return await asyncio.wait_for(self._queue.get(), max(timeout, 0.0))

    def abandon(self, on_unread: Callable[[JobUpdate], None]) -> None:
        """The handler stops reading (its client left): the updates queued now, and those delivered later,
        go to ``on_unread`` on the event loop instead (so a choice the engine finishes is still counted)."""
        self._on_unread = on_unread
        while not self._queue.empty():
            on_unread(self._queue.get_nowait())


@dataclass(eq=False, slots=True, kw_only=True)
class GenerationJob:
    """One choice of one request: a prompt, its sampling settings and where to report.

    An ``n > 1`` request is ``n`` jobs, each its own engine request.
    """

    id: JobId
    prompt: list[int]
    sampling: SamplingParams
    stream: bool
    choice: int
    inbox: Inbox
    #: ``time.monotonic()`` after which the job is abandoned (504).
    deadline: float
    enqueued_at: float = field(default_factory=time.monotonic)
    #: Set by the handler when the client went away or timed out; the worker aborts the job.
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: Per-request engine overrides chosen by the admission gate (e.g. the planner's prefill slices).
    settings: EngineSettings = field(default_factory=EngineSettings)
    #: Called around the engine run when the job runs alone (the planner's peak-memory calibration).
    probe: RunProbe | None = None
    #: Roots the request's prefix-cache hash chain (see :mod:`kvb_server.tenancy`); None: unsalted.
    cache_salt: str | None = None
    #: A ``/v1/warm`` text: computed and cached exactly, nothing generated (``engine.add_warm_request``).
    warm: bool = False
    #: vLLM's request priority (lower first; the engine's ``--scheduling-policy priority``); 0: none.
    priority: int = 0

    def expired(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline

    def timed_out(self) -> bool:
        """Past its deadline while nobody cancelled it: the client is owed a 504."""
        return not self.cancelled.is_set() and time.monotonic() > self.deadline


@dataclass(eq=False, slots=True, kw_only=True)
class CallJob:
    """Run ``fn`` on the engine thread between steps (``warm``, ``cache_stats``): engine calls never overlap."""

    id: JobId
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    deadline: float
    enqueued_at: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def expired(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline


Job = GenerationJob | CallJob


class JobIds:
    """Hands out increasing job ids (thread-safe: ``itertools.count`` is atomic under the GIL)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def next(self) -> JobId:
        return JobId(next(self._counter))
