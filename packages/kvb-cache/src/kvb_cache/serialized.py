"""One engine, several threads: the calls that touch its loop run one at a time, under the engine's lock.

Without it, ``generate`` called from four threads (``loop.run_in_executor``, a web framework's worker
pool) interleaved ``step`` calls on one scheduler: outputs that matched no prompt, an ``AssertionError``
from the block manager or an ``IndexError``. The lock is an ``RLock`` held for one engine operation at a
time (a step, an ``add_request``, an abort, a cache reset, ...), never across a whole ``generate``: each
library loop takes it per step, so requests of several threads share the batched steps as they would
share them in one thread, and each thread's loop picks its own outputs from its mailbox. A server drives
the engine from one thread, so it never waits on it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def new_engine_lock() -> threading.RLock:
    return threading.RLock()


def serialized(method: _F) -> _F:
    """``method`` run holding its engine's ``_engine_lock`` (re-entrant: engine methods call each other)."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._engine_lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]
