"""Write-behind: one daemon thread draining a bounded queue, so requests never wait on disk or network."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class BackgroundWriter:
    """Runs submitted jobs in order on a single daemon thread.

    :meth:`submit` never blocks: when ``max_pending`` jobs are already queued the new one is dropped and
    counted (a dropped store only costs a future miss). The thread starts on the first submit, so building
    a writer has no side effect.
    """

    def __init__(self, max_pending: int = 256, *, name: str = "kvb-tier-writer") -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending!r}")
        self.name = name
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped = 0
        self.failed = 0
        self._closed = False
        #: Set by :meth:`retire`: the thread ends once the queue is empty, after running this job.
        self._final: Job | None = None
        self._retiring = False

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        """Most jobs queued at once (``max_pending``)."""
        return self._queue.maxsize

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and counted) when the queue is full, or when the writer was closed or
        retired: a job submitted then (a lookup that ended after its engine's ``close()``) started a new
        thread, which wrote into the closed tiers and then waited forever on its queue."""
        # Checked and started under the lock close() takes: checked outside it, a submit from a loader thread
        # racing close() started a writer after close() returned (a review's repro). The put is outside it:
        # a job queued behind close()'s stop marker is simply never run.
        with self._start_lock:
            if self._closed or self._retiring:
                self.dropped += 1
                return False
            self._start_locked()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until every job queued so far has run (tests, shutdown, benchmarks).

        Returns False when ``timeout_s`` passed first (the jobs keep running in the background).
        """
        if self._thread is None:
            return True
        if timeout_s is None:
            self._queue.join()
            return True
        # Jobs run in order: once a marker queued behind them has run, so has every one of them.
        deadline = time.monotonic() + timeout_s
        done = threading.Event()
        try:
            self._queue.put(done.set, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float | None = None) -> bool:
        """Run what is queued, then stop the thread (idempotent).

        Returns False when ``timeout_s`` passed first: the daemon thread is left to finish (or to die with
        the interpreter).
        """
        with self._start_lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return False
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def retire(self, final: Job | None = None) -> None:
        """Let the thread end once every queued job has run, then run ``final`` on it; never blocks (the
        owner is being garbage-collected). Nothing happens after :meth:`close` (the owner closed what it had).
        """
        # NOTE: runs from a garbage-collector finalizer, which may fire inside this very thread's submit()
        # while it holds the lock: never block on it (that deadlocked the thread). Not taken, its holder is a
        # submit() that starts the thread (the marker below ends it) or close(), which closes the tiers.
        locked = self._start_lock.acquire(blocking=False)
        try:
            if self._closed or self._retiring:
                return
            self._final, self._retiring = final, True
            if locked:
                self._start_locked()  # final() may do I/O (Redis): on the thread, never in the collector
        finally:
            if locked:
                self._start_lock.release()
        # A full queue takes no marker: the loop checks _retiring after each job and ends once it is empty.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def _start_locked(self) -> None:
        """Start the thread if it is not running (the caller holds ``_start_lock``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    break
                job()
            except Exception:  # a failed background store must never kill the writer
                self.failed += 1
                logger.exception("background tier write failed")
            finally:
                self._queue.task_done()
            if self._retiring and self._queue.empty():
                break
        if self._retiring and self._final is not None:
            try:
                self._final()
            except Exception:
                logger.exception("closing the tiers of a collected engine failed")
