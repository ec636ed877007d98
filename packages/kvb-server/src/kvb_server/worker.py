"""The single engine thread: an iteration-level loop over ``add_request`` / ``step`` / ``abort``.

The engine is not thread-safe, so exactly one thread ever calls it. Request handlers on the event loop
:meth:`EngineWorker.submit` jobs; the thread repeatedly

1. hands newly submitted jobs to the engine (``add_request``; an error there fails only that job) and runs
   :class:`~kvb_server.jobs.CallJob` s (``warm``, ``cache_stats``) in arrival order,
2. aborts the requests whose client went away or whose deadline passed (a timed-out one is answered 504),
3. runs one ``engine.step()`` while any of its requests is unfinished and routes each output to its job's
   :class:`~kvb_server.jobs.Inbox` (streamed jobs: every output; others: only the result),
4. once no request has been in flight for :data:`~kvb_server.idle_work.IDLE_GRACE_S`, runs the engine's idle
   work one step at a time (stitched prompts computed exactly, ``StitchConfig.idle_copies``; a submission
   takes over at the next step),
5. sleeps on a condition variable when it has nothing to do, until the next submission wakes it.

So streamed and non-streamed requests share every step, a new request joins at the next step, and a
disconnect is acted on within one step. A failing ``step()`` fails the requests in flight (each is aborted
in the engine) and the loop goes on serving new ones.

The requests in flight and the routing of their outputs are :class:`~kvb_server.in_flight.InFlight`'s; the
idle work is :class:`~kvb_server.idle_work.IdleWork`'s. This module owns the queue, the thread and its loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from kvb_cache.core.outputs import PagedStats
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.engine_errors import is_out_of_memory
from kvb_server.errors import (
    EngineDeadError,
    QueueFullError,
    RequestTimeoutError,
    SharedStepOutOfMemoryError,
    ShuttingDownError,
)
from kvb_server.idle_work import IdleWork
from kvb_server.in_flight import InFlight
from kvb_server.jobs import CallJob, Job, JobIds, JobUpdate
from kvb_server.worker_stats import WorkerStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The idle thread re-checks for shutdown this often; submissions wake it at once.
IDLE_WAIT_S = 1.0
#: How long :meth:`EngineWorker.stop` waits by default for the thread to finish its step (and close).
STOP_JOIN_S = 10.0


class EngineWorker:
    """Owns the submission queue and the engine thread. Start it inside the running event loop."""

    def __init__(self, engine: ServingEngine, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config
        self._ids = JobIds()
        self._cond = threading.Condition()
        # Jobs stay here until the engine thread has handed them over and refreshed its counts, so the
        # queue-full check never misses a job in transit.
        self._pending: deque[Job] = deque()
        self._stopping = False
        #: Why the engine thread stopped on its own (a bug in the loop): every later request is refused.
        self._dead: BaseException | None = None
        self._close_on_exit = False
        self._stop_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._in_flight = InFlight(engine, config)
        self._idle = IdleWork(engine)
        self._paged: PagedStats | None = None
        self._speculative: dict[str, Any] | None = None
        # A composed engine's drafter counters (kvboost's speculative_stats), snapshot after every step.
        source = getattr(engine, "speculative_stats", None)
        self._speculative_source: Callable[[], dict[str, Any] | None] | None = (
            source if callable(source) else None
        )
        self._engine_waiting = 0
        self._steps = self._step_errors = self._calls = 0
        self._busy_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineWorker.start() called twice")
        self._thread = threading.Thread(target=self._run, name="kvb-engine", daemon=True)
        self._thread.start()

    async def stop(self, *, close_engine: bool = False, timeout_s: float = STOP_JOIN_S) -> None:
        """Stop taking work, abort what is in flight and end the thread.

        Args:
            close_engine: then call ``engine.close()`` on the engine thread (flushes queued disk/Redis
                writes and closes the tiers); an error there is logged, never raised.
            timeout_s: how long to wait for the thread to finish its current step (and the close); past
                it the thread is left behind (a daemon) with a warning.
        """
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._close_on_exit = close_engine
            self._stop_deadline = time.monotonic() + timeout_s
            self._cond.notify()
        await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout_s)
        if thread.is_alive():
            logger.warning(
                "engine thread did not finish its step%s within %.0f s; leaving it",
                " and engine.close()" if close_engine else "",
                timeout_s,
            )
        self._thread = None

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine thread on its own (None while it runs, or after a clean stop)."""
        return self._dead

    # -- submission (event loop) -----------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Requests not running yet: submitted but not handed to the engine, plus waiting inside it."""
        return len(self._pending) + self._engine_waiting

    def _must_wait(self) -> int:
        """Requests not running yet that will wait for a running slot: :attr:`depth` less the free slots
        (as of the last step), which requests still on their way to the engine thread take first. Counted
        as queued, a burst the server had room for was partly refused (6 requests to an idle server with
        2 slots and a queue of 4: two 503s)."""
        paged = self._paged
        room = max(0, paged.max_num_seqs - paged.running) if paged is not None else 0
        return max(0, self.depth - room)

    def submit(self, jobs: list[Job], *, bounded: bool = True) -> None:
        """Queue all of ``jobs`` or none (an ``n > 1`` request is never half-queued).

        Args:
            bounded: count against ``max_queue_size`` (stats calls are not bounded).

        Raises:
            QueueFullError: fewer than ``len(jobs)`` free places among the requests not running yet (free
                running slots first take requests on their way: :meth:`_must_wait`).
        """
        if self._thread is None and not self._stopping:
            raise RuntimeError("EngineWorker.start() must run before submit()")
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._stopping:
                raise ShuttingDownError()
            if bounded and self._must_wait() + len(jobs) > self._config.max_queue_size:
                raise QueueFullError(self._config.max_queue_size)
            self._pending.extend(jobs)
            self._cond.notify()

    async def call(self, fn: Callable[[], T], *, timeout_s: float, bounded: bool = True) -> T:
        """Run ``fn`` on the engine thread between steps and return its value (or raise its error).

        Raises:
            QueueFullError: ``bounded`` and the queue is full.
            RequestTimeoutError: no answer within ``timeout_s`` (the call is skipped if it has not started).
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        job = CallJob(id=self._ids.next(), fn=fn, future=future, deadline=time.monotonic() + timeout_s)
        self.submit([job], bounded=bounded)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            job.cancelled.set()
            raise RequestTimeoutError(timeout_s) from None
        except asyncio.CancelledError:  # the caller gave up (its client went away): skip it if not started
            job.cancelled.set()
            raise

    def stats(self) -> WorkerStats:
        paged = self._paged
        return WorkerStats(
            waiting=self.depth,
            running=paged.running if paged is not None else 0,
            in_flight=len(self._in_flight),
            max_queue_size=self._config.max_queue_size,
            steps=self._steps,
            step_errors=self._step_errors + self._idle.errors,
            largest_step=self._in_flight.largest_step,
            added=self._in_flight.added,
            finished=self._in_flight.finished,
            aborted=self._in_flight.aborted,
            rejected=self._in_flight.rejected,
            failed=self._in_flight.failed,
            calls=self._calls,
            busy_s=round(self._busy_s, 6),
            idle_steps=self._idle.steps,
            idle_s=round(self._idle.seconds, 6),
            aborted_prompt_tokens=self._in_flight.aborted_prompt_tokens,
            aborted_generation_tokens=self._in_flight.aborted_generation_tokens,
            warm_aborted=self._in_flight.warm_aborted,
        )

    def paged_stats(self) -> PagedStats | None:
        """The engine's block-pool counters as of its last step or call (None before the thread started)."""
        return self._paged

    def speculative_stats(self) -> dict[str, Any] | None:
        """The drafter's counters as of the engine's last step (a composed engine's ``speculative_stats()``);
        None for an engine without a drafter, or before the thread started."""
        return self._speculative

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._refresh()
            while True:
                batch = self._next_batch()
                if batch is None:
                    break
                if batch:
                    self._hand_over(batch)
                if self._in_flight.abort_expired():
                    # The counts (queue depth, running, KV usage) must drop now: with nothing left in
                    # flight no step follows to refresh them, and a stale waiting count would keep
                    # refusing new requests as queue_full.
                    self._refresh()
                if self._in_flight:
                    self._step()
                elif self._idle.due() <= 0:
                    self._idle_step()
        except Exception as exc:  # a bug in the loop itself: nothing else would ever answer the jobs
            logger.exception("engine loop crashed; the server answers 503 engine_dead from now on")
            with self._cond:
                # Set before answering anyone: a submission racing with the crash is refused, not left
                # in a queue nobody reads until its --request-timeout.
                self._dead = exc
            self._fail_in_flight(RuntimeError("the server's engine loop crashed; see the server log"))
        finally:
            self._abort_all()
            self._refuse_pending(
                EngineDeadError(self._dead) if self._dead is not None else ShuttingDownError()
            )
            if self._close_on_exit:
                self._close_engine()

    def _next_batch(self) -> list[Job] | None:
        """The jobs submitted so far (left in ``_pending`` until handed over); blocks while idle.

        Returns None when the worker is stopping.
        """
        with self._cond:
            while not self._pending and not self._in_flight and not self._stopping:
                due = self._idle.due()
                if due <= 0:
                    return []
                self._cond.wait(min(due, IDLE_WAIT_S))
            return None if self._stopping else list(self._pending)

    def _hand_over(self, batch: list[Job]) -> None:
        answers: list[Callable[[], None]] = []
        for job in batch:
            if isinstance(job, CallJob):
                answers.append(self._run_call(job))
            else:
                self._in_flight.add(job)
        self._refresh()
        with self._cond:
            for _ in batch:
                self._pending.popleft()
        # Calls are answered only now, so a handler reading the queue depth (stats) no longer sees its job.
        for answer in answers:
            answer()

    def _run_call(self, job: CallJob) -> Callable[[], None]:
        """Run ``job`` now; returns what delivers its value or error to the awaiting handler."""
        if job.expired():
            if job.cancelled.is_set():
                return lambda: None
            return functools.partial(
                _resolve, job.future, error=RequestTimeoutError(self._config.request_timeout_s)
            )
        self._calls += 1
        try:
            value = job.fn()
        except BaseException as exc:  # delivered to the awaiting handler, which maps it to a response
            return functools.partial(_resolve, job.future, error=exc)
        finally:
            self._route_stepped_past()
        return functools.partial(_resolve, job.future, value=value)

    def _route_stepped_past(self) -> None:
        """Route outputs an engine call produced for our requests by stepping the engine itself.

        ``KVBoost.warm`` runs the engine loop until its own request is done; every request in flight advances
        in those steps too, and their outputs (possibly final ones) must reach their handlers.
        """
        take = getattr(self._engine, "take_unfollowed_outputs", None)
        if take is None:
            return
        for output in take():
            self._in_flight.route(output)

    def _step(self) -> None:
        if not self._engine.has_unfinished():
            # The engine holds none of the requests we handed it: nothing would ever answer them.
            self._fail_in_flight(RuntimeError("the engine lost track of requests in flight"))
            return
        started = time.monotonic()
        try:
            outputs = self._engine.step()
        except Exception as exc:
            self._step_errors += 1
            sharing = len(self._in_flight)
            logger.error("engine step failed with %d requests in flight: %r", sharing, exc)
            if sharing > 1 and is_out_of_memory(exc):
                # Not 413 for each: a small request that shared the step is not too large (retryable 503).
                self._fail_in_flight(SharedStepOutOfMemoryError(exc, sharing=sharing))
            else:
                self._fail_in_flight(exc)
            return
        finally:
            self._busy_s += time.monotonic() - started
            self._steps += 1
            self._idle.busy()
        self._in_flight.route_step(outputs)
        self._refresh()

    def _idle_step(self) -> None:
        self._idle.step()
        self._route_stepped_past()
        self._refresh()

    def _fail_in_flight(self, error: BaseException) -> None:
        self._in_flight.fail_all(error)
        self._refresh()

    def _abort_all(self) -> None:
        """On shutdown: free what is in flight, so an engine shared with another server starts clean."""
        self._in_flight.abort_all()
        self._idle.clear()  # the prompt part-way holds blocks too; what it stored stays cached

    def _refuse_pending(self, error: Exception) -> None:
        """When the thread ends: answer the jobs never handed to the engine with ``error``, so no handler
        waits for its timeout."""
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            if isinstance(job, CallJob):
                _resolve(job.future, error=error)
            else:
                job.inbox.put_threadsafe(JobUpdate(choice=job.choice, error=error))

    def _close_engine(self) -> None:
        started = time.monotonic()
        try:
            # What is left of stop()'s timeout after the last step: the engine bounds its own flush by it.
            drained = self._engine.close(timeout_s=max(0.0, self._stop_deadline - started))
        except Exception:
            logger.exception("engine.close() failed on shutdown; queued tier writes may be lost")
            return
        if drained is False:
            logger.warning("engine.close() timed out: some queued tier writes were not stored")
        else:
            # Drained, not necessarily stored: what a tier refused or skipped is in its errors/dropped counters.
            logger.info("engine closed (tier write queue drained) in %.2f s", time.monotonic() - started)

    def _refresh(self) -> None:
        try:
            paged = self._engine.paged_stats()
        except Exception:
            logger.warning("engine.paged_stats() failed", exc_info=True)
            return
        self._paged = paged
        self._engine_waiting = paged.waiting
        if self._speculative_source is not None:
            try:
                self._speculative = self._speculative_source()
            except Exception:
                logger.warning("engine.speculative_stats() failed", exc_info=True)


def _resolve(future: asyncio.Future[Any], *, value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` from the engine thread (a no-op when its handler gave up or the loop closed)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    loop = future.get_loop()
    if not loop.is_closed():
        loop.call_soon_threadsafe(settle)
