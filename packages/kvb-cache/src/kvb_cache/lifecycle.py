"""Engine lifecycle: flush and close the tiers (explicitly, as a context manager, or at interpreter exit),
and reset the cache (the admin operation).

Tier writes are queued behind requests on a daemon thread, so an interpreter that exits without waiting
loses whatever is still queued. Each engine with tiers therefore registers an ``atexit`` hook that closes
it with a bound (``TierConfig.exit_flush_timeout_s``): a normal exit keeps every record written before
the deadline; ``kill -9`` (or a crash of the interpreter) keeps only the records already written behind.
The hook holds its engine weakly, so it never keeps an engine alive; an engine collected before exit
unregisters it (its queued writes still drain on the daemon thread, without anyone waiting for them, and
the thread then ends and closes the tiers).
"""

from __future__ import annotations

import atexit
import logging
import numbers
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvb_cache.core.block_tiers import BlockTiers
from kvb_cache.errors import CacheBusyError, InvalidRequestError
from kvb_cache.serialized import serialized
from kvb_cache.tiers import TieredStore

if TYPE_CHECKING:
    from kvb_cache.config import EngineConfig
    from kvb_cache.core.engine_core import EngineCore
    from kvb_cache.core.kv_manager import KVCacheManager
    from kvb_cache.store import ChunkStore

logger = logging.getLogger(__name__)

_Engine = TypeVar("_Engine", bound="EngineLifecycle")

#: Bound of the exit flush when no :class:`~kvb_cache.tiers.TierConfig` says otherwise (a ``TieredStore``
#: passed in as ``store=``).
DEFAULT_EXIT_FLUSH_TIMEOUT_S = 10.0


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object, for callbacks the engine
    hands to the parts it owns: a part holding the engine strongly makes a reference cycle, and then
    ``del engine`` leaves its block pool allocated until the cyclic garbage collector runs."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError("the engine this callback belongs to was garbage-collected")
        return bound(*args, **kwargs)

    return call


def retire_all(parts: list[BlockTiers | TieredStore]) -> None:
    """Let each part's writer thread end after what is queued, then close its tiers (never blocks: the
    garbage collector runs it when the engine is collected)."""
    for part in parts:
        part.retire()


class ExitFlush:
    """The ``atexit`` hook of one engine: closes it (bounded) if it is still alive at exit."""

    def __init__(self, engine: EngineLifecycle, timeout_s: float) -> None:
        self._engine = weakref.ref(engine)
        self.timeout_s = timeout_s

    def __call__(self) -> None:
        engine = self._engine()
        if engine is not None:
            engine.close(timeout_s=self.timeout_s)


class EngineLifecycle:
    """Mixed into :class:`~kvb_cache.engine.KVBoost`: ``flush``, ``close``, context manager, ``reset_cache``."""

    config: EngineConfig
    core: EngineCore
    kv: KVCacheManager
    tiers: BlockTiers | None
    store: ChunkStore | TieredStore
    _engine_lock: threading.RLock
    _closed: bool = False
    _exit_hook: ExitFlush | None = None

    def _register_exit_flush(self) -> None:
        """Close this engine at interpreter exit (bounded) when it has tier writes to lose."""
        if self.tiers is None and not isinstance(self.store, TieredStore):
            return
        tiers = self.config.tiers
        timeout = tiers.exit_flush_timeout_s if tiers is not None else DEFAULT_EXIT_FLUSH_TIMEOUT_S
        hook = self._exit_hook = ExitFlush(self, timeout)
        atexit.register(hook)
        # Do not accumulate dead hooks when engines come and go in one process (tests, notebooks).
        weakref.finalize(self, atexit.unregister, hook).atexit = False
        # An engine dropped without close(): its writer threads end once their queues are drained, and
        # then close their tiers (a disk tier's budget, a Redis connection pool). Without this, each
        # dropped engine left a thread blocked on its empty queue for the life of the process.
        parts = [p for p in (self.tiers, self.store) if isinstance(p, (BlockTiers, TieredStore))]
        weakref.finalize(self, retire_all, parts).atexit = False

    def flush(self, *, timeout_s: float | None = None) -> bool:
        """Wait until queued tier writes reached disk/Redis; False when ``timeout_s`` passed first."""
        timeout_s = _timeout(timeout_s)
        drained = True
        if self.tiers is not None:
            drained = self.tiers.flush(timeout_s)
        if isinstance(self.store, TieredStore):
            drained = self.store.flush(timeout_s) and drained
        return drained

    def close(self, *, timeout_s: float | None = None) -> bool:
        """Drain queued tier writes (at most ``timeout_s``; None: until done) and close the tiers.

        Idempotent. The engine keeps serving afterwards from RAM alone: nothing is read from or written to
        the closed tiers. Returns False when writes were still queued at the deadline (lost at exit); True
        when the queue was drained, which is not "all stored": what a tier refused or skipped while paused is
        in its ``errors`` / ``dropped`` counters.
        """
        # Checked before anything is switched: a bad value failed after the engine was marked closed, its
        # tiers detached and the exit hook removed, so queued writes were never drained nor the tiers closed.
        timeout_s = _timeout(timeout_s)
        # The switch under the engine's lock (a step of another thread reads kv.tiers); the drain outside it.
        with self._engine_lock:
            if self._closed:
                return True
            self._closed = True
            if self._exit_hook is not None:
                atexit.unregister(self._exit_hook)
                self._exit_hook = None
            self.kv.tiers = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        drained = True
        if self.tiers is not None:
            drained = self.tiers.close(left())
        if isinstance(self.store, TieredStore):
            drained = self.store.close(left()) and drained
        if not drained:
            logger.warning("tier writes were still queued after %.1fs; the rest is not stored", timeout_s)
        return drained

    def __enter__(self: _Engine) -> _Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @serialized
    def reset_cache(self, *, lower_tiers: bool = False) -> dict[str, int]:
        """Forget every cached prefix: the pool's index, the stitching store and, with ``lower_tiers``, the
        disk/Redis records of this engine's namespace (its model fingerprint: every salt, and every other
        process sharing that Redis namespace or disk folder, loses them too).

        Like vLLM's ``reset_prefix_cache``, it needs an idle engine: blocks held by running requests would
        be indexed again as they finish, so it refuses rather than half-reset.

        Returns:
            ``{"blocks_dropped", "chunks_dropped", "lower_tier_records_dropped"}`` counts.

        Raises:
            CacheBusyError: requests are running or waiting (nothing was dropped).
            InvalidRequestError: ``lower_tiers`` is not a bool.
        """
        if not isinstance(lower_tiers, bool):
            # NOTE: a truthy string ("no", "false") would otherwise wipe every process's disk/Redis records.
            raise InvalidRequestError(
                f"lower_tiers must be True or False, got {lower_tiers!r}", param="lower_tiers"
            )
        if self.core.has_unfinished():
            running, waiting = self.core.running, len(self.core.scheduler.waiting)
            raise CacheBusyError(
                f"cannot reset the cache while requests hold blocks ({running} running, {waiting} waiting); "
                "retry when the engine is idle, or abort them first",
                running=running,
                waiting=waiting,
            )
        self.core.clear_idle()
        blocks = self.kv.clear()
        chunks = len(self.store)
        records = 0
        if lower_tiers:
            if self.tiers is not None:
                records += self.tiers.clear()
            if isinstance(self.store, TieredStore):
                records += self.store.clear_tiers()
        self.store.clear()
        return {"blocks_dropped": blocks, "chunks_dropped": chunks, "lower_tier_records_dropped": records}


def _timeout(timeout_s: object) -> float | None:
    """``timeout_s`` of :meth:`EngineLifecycle.flush` / ``close``: None or a number >= 0 (an infinite one is
    None: threading's waits overflow on it)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or timeout_s != timeout_s:
        raise InvalidRequestError(
            f"timeout_s must be a number of seconds >= 0 or None (no limit), got {timeout_s!r}",
            param="timeout_s",
        )
    if timeout_s < 0:
        raise InvalidRequestError(
            f"timeout_s must be >= 0 (None: no limit), got {timeout_s!r}", param="timeout_s"
        )
    return None if timeout_s > threading.TIMEOUT_MAX else float(timeout_s)
