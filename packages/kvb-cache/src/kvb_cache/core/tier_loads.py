"""Waiting requests' disk/Redis lookups, run off the engine loop (vLLM v1's asynchronous KV loads).

A waiting request whose prefix runs past what the pool holds may find the rest in a lower tier. Reading
those records (a Redis round trip, a file per block, their decoding) used to happen inside the step that
admitted it, so every running stream paused for it: up to the remote timeout when Redis stalled. Now the
scheduler starts the lookup (:meth:`~kvb_cache.core.block_tiers.BlockTiers.fetch_async`) when the request
comes up for admission, leaves the request waiting while it runs (other requests are admitted and step
meanwhile), and admits it once the records are in memory; the blocks are then written into the pool on
the loop thread as before (:meth:`~kvb_cache.core.kv_manager.KVCacheManager.admit` with ``loaded``).

A request whose prefix the pool no longer holds as far as when its lookup began (evicted meanwhile) gets
a fresh lookup before it is admitted, rather than recomputing blocks a tier holds. A step that starts
lookups waits for them up to :data:`LOAD_GRACE_S`: one that answers within it (a local disk, a healthy
Redis) is admitted in that step, so an idle engine adds no step of latency; a slower one costs the
running requests that wait, not the whole lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvb_cache.hashing import ChunkHash
from kvb_cache.store import LayerKV

if TYPE_CHECKING:
    from kvb_cache.core.block_tiers import BlockTiers
    from kvb_cache.core.request import Request

#: How long a step waits for the lookups it started before admitting without them (seconds): a local disk
#: answers well within it, so the request is admitted in the step that started its lookup.
LOAD_GRACE_S = 0.005
#: How long a step with nothing to run waits for a lookup in flight before it returns (seconds): the
#: caller's loop steps again at once, so this only keeps an engine waiting on Redis from spinning. Short,
#: because the step holds the engine's lock: at 50 ms, other threads' add_request/abort waited up to ~90 ms.
IDLE_WAIT_S = 0.005


@dataclass(slots=True)
class TierLoad:
    """One waiting request's lookup: ``keys`` (prefix hashes past the pool's run when it started, in chain
    order), the future of the leading run of their KV that some tier held, and the tiers' ``generation``
    it began in (a clear or close since makes it stale)."""

    keys: tuple[ChunkHash, ...]
    future: Future[list[LayerKV]]
    generation: int

    @classmethod
    def start(cls, tiers: BlockTiers, keys: Sequence[ChunkHash]) -> TierLoad:
        """Begin reading ``keys`` on ``tiers``' loader threads."""
        return cls(tuple(keys), tiers.fetch_async(keys), tiers.generation)

    @property
    def done(self) -> bool:
        return self.future.done()

    @property
    def blocks(self) -> int:
        """Blocks of KV this load holds in host memory until its request is admitted: the records found
        once done, every key asked for while in flight (the scheduler's bound on loads)."""
        if not self.future.done():
            return len(self.keys)
        if self.future.cancelled() or self.future.exception() is not None:
            return 0
        return len(self.future.result())

    def records(self, generation: int) -> dict[ChunkHash, LayerKV]:
        """The loaded KV by key; empty (the blocks are recomputed) when the lookup failed or was cancelled,
        or the tiers' current ``generation`` is another (cleared since: the records may be of old weights)."""
        if generation != self.generation or self.future.cancelled() or self.future.exception() is not None:
            return {}
        return dict(zip(self.keys, self.future.result()))


def wait_first(loads: list[TierLoad], timeout_s: float) -> None:
    """Block until one of ``loads`` is done or ``timeout_s`` passed."""
    if loads:
        wait([load.future for load in loads], timeout=timeout_s, return_when=FIRST_COMPLETED)


def wait_all(loads: list[TierLoad], timeout_s: float) -> None:
    """Block until every one of ``loads`` is done or ``timeout_s`` passed."""
    if loads:
        wait([load.future for load in loads], timeout=timeout_s)


def in_flight(loads: Iterable[TierLoad | None]) -> list[TierLoad]:
    """The lookups among ``loads`` still running."""
    return [load for load in loads if load is not None and not load.done]


def drop_load(req: Request) -> None:
    """Forget ``req``'s lookup: one not started is cancelled (never read), one in flight has its result
    dropped when it ends."""
    if req.tier_load is not None:
        req.tier_load.future.cancel()
        req.tier_load = None


def loaded_records(tiers: BlockTiers | None, load: TierLoad | None) -> dict[ChunkHash, LayerKV] | None:
    """What admitting or planning a request whose lookup is ``load`` may promote from ``tiers``: None
    without tiers (nothing to promote), else the records ``load`` read (none without a lookup: the loop
    thread never reads a tier itself)."""
    if tiers is None:
        return None
    return {} if load is None else load.records(tiers.generation)
