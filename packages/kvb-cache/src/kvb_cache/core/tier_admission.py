"""Which waiting requests' disk/Redis lookups run, and when (the scheduler's side of :mod:`tier_loads`).

The scheduler skips a waiting request until the records its prefix needs from a lower tier are in memory
(:mod:`kvb_cache.core.tier_loads`). This decides which lookups start each step, within the bounds admission
has (``max_num_seqs`` requests holding one, records for half the pool), in queue order so none starves and
the priority policy's ranks hold, and re-reads a prefix the pool evicted between lookup and admission.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvb_cache.core import tier_loads
from kvb_cache.core.request import Request
from kvb_cache.core.tier_loads import TierLoad, drop_load, in_flight, wait_all
from kvb_cache.hashing import ChunkHash

if TYPE_CHECKING:
    from kvb_cache.core.kv_manager import KVCacheManager
    from kvb_cache.core.scheduler import Scheduler


class TierAdmission:
    """The tier lookups of ``scheduler``'s waiting requests (read through its queue and settings)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        #: Lookups started (``paged_stats().tier_loads``).
        self.started = 0

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    def loading(self) -> list[TierLoad]:
        """The lookups still in flight for waiting requests."""
        return in_flight(r.tier_load for r in self.scheduler.waiting)

    def start_loads(self, order: list[Request], *, grace_s: float | None = None) -> set[int]:
        """Start the tier lookups of the requests in ``order`` whose prefix runs past the pool's blocks, wait
        ``grace_s`` (default :data:`~kvb_cache.core.tier_loads.LOAD_GRACE_S`) for them, and return the ids
        of the requests that must wait: a lookup still in flight, or one not started (admitted without it,
        a request would recompute blocks a tier holds).

        Bounded as admission is: at most ``max_num_seqs`` waiting requests with a lookup (in flight, or read
        and not admitted yet), holding records for at most half the pool's blocks (:attr:`TierLoad.blocks`).
        The oldest waiting request that needs a lookup goes first, and while it does not fit, no other
        lookup starts (before, a large request refused by the bound waited while later small ones kept
        taking it: bypassed 247 times in a review's repro); when nothing else is held it starts anyway, so a
        prompt longer than the bound still gets its records.
        """
        assert self.kv.tiers is not None
        held = [r.tier_load for r in self.scheduler.waiting if r.tier_load is not None]
        count, blocks = len(held), sum(load.blocks for load in held)
        max_blocks = self.kv.pool.num_blocks // 2
        wanted = [
            (r, k) for r in order if r.tier_load is None and (k := self.kv.tier_keys(r, r.lookup_limit))
        ]
        started: list[TierLoad] = []
        blocked: set[int] = set()
        if wanted:
            oldest = self._oldest_needing_load()
            if oldest is not None:
                wanted = [oldest, *(w for w in wanted if w[0] is not oldest[0])]
                if self.scheduler.priority and (
                    count >= self.scheduler.max_num_seqs or blocks + len(oldest[1]) > max_blocks
                ):
                    count, blocks = self._yield_loads(oldest[0])
            for i, (req, keys) in enumerate(wanted):
                fits = count < self.scheduler.max_num_seqs and blocks + len(keys) <= max_blocks
                if not fits and not (i == 0 and not count):
                    blocked.update(id(r) for r, _ in wanted[i:])  # in line behind the first that does not fit
                    break
                started.append(self.start_load(req, keys))
                count, blocks = count + 1, blocks + len(keys)
        wait_all(started, tier_loads.LOAD_GRACE_S if grace_s is None else grace_s)
        blocked.update(id(r) for r in order if r.tier_load is not None and not r.tier_load.done)
        return blocked

    def _yield_loads(self, first: Request) -> tuple[int, int]:
        """Under the priority policy, drop the lookups held by requests ranked below ``first`` (the best-ranked
        request that needs one and does not fit the bound), so it is read and admitted first: records a
        lower-ranked request had read let it in ahead of a higher-ranked arrival (an audit: with
        ``max_num_seqs=1``, LOW then HIGH; read again later). Returns the held count and blocks left."""
        for req in self.scheduler.waiting:
            if req.tier_load is not None and req.rank > first.rank:
                drop_load(req)
        held = [r.tier_load for r in self.scheduler.waiting if r.tier_load is not None]
        return len(held), sum(load.blocks for load in held)

    def _oldest_needing_load(self) -> tuple[Request, list[ChunkHash]] | None:
        """The first waiting request (in queue order: arrival, or rank under the priority policy) with no
        lookup whose prefix runs past the pool, and the keys it needs read."""
        for req in itertools.islice(self.scheduler.waiting, self.scheduler.admit_window):
            if req.tier_load is None and (keys := self.kv.tier_keys(req, req.lookup_limit)):
                return req, keys
        return None

    def start_load(self, req: Request, keys: Sequence[ChunkHash]) -> TierLoad:
        """Begin reading ``keys`` for ``req`` (counted in :attr:`started`): a waiting request's, or a stitched
        prompt's before it is planned (``KVBoost._queue_stitched``)."""
        assert self.kv.tiers is not None
        req.tier_load = TierLoad.start(self.kv.tiers, keys)
        self.started += 1
        return req.tier_load

    def reload(self, req: Request) -> bool:
        """Whether ``req`` must wait for a fresh tier lookup: the pool's run of its prefix now ends before the
        blocks its lookup read (evicted since it began: even this step, by an earlier admission), or it has
        none and now needs one. Its records could not attach there, so admitted now it would recompute what
        a tier holds; the new lookup is started here. Rare: pool pressure between lookup and admission."""
        assert self.kv.tiers is not None
        keys = self.kv.tier_keys(req, req.lookup_limit)
        load = req.tier_load
        if not keys or (load is not None and keys[0] in load.keys):
            return False
        drop_load(req)
        self.start_load(req, keys)
        return True
