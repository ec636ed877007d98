"""llguidance's grammar compilation, run on threads with a large stack.

llguidance compiles a grammar recursively in native code, on the calling thread's stack. A request thread's
stack is 8 MiB at most (a worker thread's may be less), and a schema or grammar nested a few thousand
levels deep overflowed it: a segfault that took the whole server down with one request (an audit,
2026-11-30). :mod:`.nesting` refuses the usual ways of nesting that deep by name, but a measure cannot
follow every spelling (``$anchor`` and ``$id`` references, a schema embedded in a Lark grammar), so the
compilation itself also runs here, where the stack is :data:`STACK_BYTES` (reserved address space,
touched only as deep as a compilation goes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

#: The compiling threads' stack: room for tens of thousands of nested levels (~4 KiB each measured).
STACK_BYTES = 256 << 20
#: Compilations run at once (more queue): two, so one slow grammar does not hold every other request.
WORKERS = 2

T = TypeVar("T")
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_unavailable = False  # the large stacks could not be had: compile on the caller's thread, as before

logger = logging.getLogger(__name__)


def _executor() -> ThreadPoolExecutor | None:
    global _pool, _unavailable
    with _lock:
        if _pool is None and not _unavailable:
            # threading.stack_size applies to threads started while it is set, and ThreadPoolExecutor
            # starts its threads on submit: both are started here, each held at a barrier until the other
            # exists (one task alone would be served by the first thread and leave the second unstarted).
            try:
                previous = threading.stack_size(STACK_BYTES)
            except (ValueError, RuntimeError) as exc:  # a platform that does not size thread stacks
                logger.warning("grammar compilation stays on the request's thread (no large stack: %s)", exc)
                _unavailable = True
                return None
            pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kvb-grammar")
            try:
                barrier = threading.Barrier(WORKERS, timeout=30)
                for started in [pool.submit(barrier.wait) for _ in range(WORKERS)]:
                    started.result()
                _pool = pool
            except (RuntimeError, MemoryError, threading.BrokenBarrierError) as exc:
                # An address-space limit (ulimit -v) can refuse such stacks: nothing is gained by failing.
                logger.warning("grammar compilation stays on the request's thread (no large stack: %s)", exc)
                _unavailable = True
                pool.shutdown(wait=False)
            finally:
                threading.stack_size(previous)
    return _pool


def on_big_stack(fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)`` on a compiling thread; its result, or its exception re-raised here."""
    pool = _executor()
    if pool is None:
        return fn(*args, **kwargs)
    return pool.submit(fn, *args, **kwargs).result()
