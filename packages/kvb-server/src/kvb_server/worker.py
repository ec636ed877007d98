"""The single engine worker: a bounded queue drained in short windows into batched engine calls.

The engine is not thread-safe, so exactly one thread ever calls it. An asyncio task (the dispatcher)
collects waiting jobs for up to ``batch_window_ms``, picks the next unit with
:func:`kvb_server.batching.next_unit` and runs it on that thread; results flow back through each job's
:class:`~kvb_server.jobs.Inbox`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvb_server.batching import is_batchable, next_unit
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import QueueFullError, RequestTimeoutError
from kvb_server.jobs import CallJob, GenerationJob, Job, JobUpdate

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStats:
    """Queue and batching counters (``/v1/stats``)."""

    waiting: int
    running: int
    max_queue_size: int
    engine_calls: int
    batched_calls: int
    jobs_started: int
    jobs_dropped: int
    largest_batch: int
    busy_s: float


class EngineWorker:
    """Owns the queue and the engine thread. Start it inside the running event loop."""

    def __init__(self, engine: ServingEngine, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._waiting = 0
        self._running = 0
        self._engine_calls = 0
        self._batched_calls = 0
        self._jobs_started = 0
        self._jobs_dropped = 0
        self._largest_batch = 0
        self._busy_s = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("EngineWorker.start() called twice")
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvb-engine")
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="kvb-dispatcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._executor is not None:
            # Running generations notice the cancellation flags below; do not block shutdown on them.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- submission ------------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Jobs waiting for the engine (not counting the ones running)."""
        return self._waiting

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of ``jobs`` or none (an ``n > 1`` request is never half-queued).

        Raises:
            QueueFullError: fewer than ``len(jobs)`` free places in the queue.
        """
        if self._queue is None:
            raise RuntimeError("EngineWorker.start() must run before submit()")
        if self._waiting + len(jobs) > self._config.max_queue_size:
            raise QueueFullError(self._config.max_queue_size)
        for job in jobs:
            self._queue.put_nowait(job)
        self._waiting += len(jobs)

    def stats(self) -> WorkerStats:
        return WorkerStats(
            waiting=self._waiting,
            running=self._running,
            max_queue_size=self._config.max_queue_size,
            engine_calls=self._engine_calls,
            batched_calls=self._batched_calls,
            jobs_started=self._jobs_started,
            jobs_dropped=self._jobs_dropped,
            largest_batch=self._largest_batch,
            busy_s=round(self._busy_s, 6),
        )

    # -- dispatch --------------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        pending: list[Job] = []
        while True:
            if not pending:
                pending.append(await self._queue.get())
            await self._collect_window(pending)
            pending = self._drop_expired(pending)
            if not pending:
                continue
            unit, pending = next_unit(
                pending,
                max_batch_size=self._config.max_batch_size,
                prefix_tokens=self._config.group_prefix_tokens,
            )
            self._waiting -= len(unit)
            self._running = len(unit)
            started = time.monotonic()
            try:
                await loop.run_in_executor(self._executor, self._run_unit, unit)
            except Exception:  # the unit reports its own errors; this is a bug in the worker itself
                logger.exception("engine worker failed on a unit of %d jobs", len(unit))
            finally:
                self._busy_s += time.monotonic() - started
                self._running = 0

    async def _collect_window(self, pending: list[Job]) -> None:
        """Move queued jobs into ``pending``; wait up to the batch window when a batch could still grow."""
        assert self._queue is not None
        while not self._queue.empty():
            pending.append(self._queue.get_nowait())
        if not is_batchable(pending[0]) or self._config.batch_window_ms <= 0:
            return
        deadline = time.monotonic() + self._config.batch_window_ms / 1e3
        while sum(map(is_batchable, pending)) < self._config.max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                pending.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                return

    def _drop_expired(self, pending: list[Job]) -> list[Job]:
        alive = [j for j in pending if not j.expired()]
        dropped = len(pending) - len(alive)
        if dropped:
            self._waiting -= dropped
            self._jobs_dropped += dropped
            for job in pending:
                if job.expired() and isinstance(job, CallJob) and not job.future.done():
                    job.future.get_loop().call_soon_threadsafe(
                        _set_exception, job.future, RequestTimeoutError(self._config.request_timeout_s)
                    )
        return alive

    # -- on the engine thread ---------------------------------------------------------------------------
    def _run_unit(self, unit: list[Job]) -> None:
        self._engine_calls += 1
        self._jobs_started += len(unit)
        self._largest_batch = max(self._largest_batch, len(unit))
        head = unit[0]
        if isinstance(head, CallJob):
            self._run_call(head)
        elif len(unit) == 1:
            self._run_stream(head)
        else:
            self._batched_calls += 1
            self._run_batch([j for j in unit if isinstance(j, GenerationJob)])

    def _run_call(self, job: CallJob) -> None:
        loop = job.future.get_loop()
        try:
            value = job.fn()
        except BaseException as exc:  # delivered to the awaiting handler, which maps it to a response
            loop.call_soon_threadsafe(_set_exception, job.future, exc)
        else:
            loop.call_soon_threadsafe(_set_result, job.future, value)

    def _run_stream(self, job: GenerationJob) -> None:
        """Serve one job through ``engine.stream`` so it can be stopped between tokens."""
        queue_s = time.monotonic() - job.enqueued_at
        _call_probe(job, "start")
        events = self._engine.stream(job.prompt, **job.engine_kwargs())
        try:
            for event in events:
                if job.expired():
                    logger.info("job %d stopped: client gone or past its deadline", job.id)
                    return
                if event.result is not None:
                    _call_probe(job, "finish")
                if job.stream or event.result is not None:
                    update = JobUpdate(
                        choice=job.choice,
                        event=event if job.stream else None,
                        result=None if job.stream else event.result,
                        queue_s=queue_s,
                    )
                    job.inbox.put_threadsafe(update)
        except Exception as exc:
            job.inbox.put_threadsafe(JobUpdate(choice=job.choice, error=exc, queue_s=queue_s))
        finally:
            # Closing the generator is how the engine learns to stop and free its state.
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def _run_batch(self, jobs: list[GenerationJob]) -> None:
        queue_s = [time.monotonic() - j.enqueued_at for j in jobs]
        try:
            # Batched jobs have default settings (see batching.is_batchable): sampling is all they carry.
            results = self._engine.generate_batch(
                [j.prompt for j in jobs], sampling=[j.sampling.engine_kwargs() for j in jobs]
            )
        except Exception:
            # One bad request must not fail its batch mates: serve each alone so only it gets the error.
            logger.warning(
                "batched call of %d jobs failed; serving them one at a time", len(jobs), exc_info=True
            )
            for job in jobs:
                if not job.expired():
                    self._run_stream(job)
            return
        for job, result, waited in zip(jobs, results, queue_s):
            job.inbox.put_threadsafe(JobUpdate(choice=job.choice, result=result, queue_s=waited))


def _call_probe(job: GenerationJob, method: str) -> None:
    """Measurement must never fail a request: a probe error is logged and ignored."""
    if job.probe is None:
        return
    try:
        getattr(job.probe, method)()
    except Exception:
        logger.warning("run probe %s failed for job %d", method, job.id, exc_info=True)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
