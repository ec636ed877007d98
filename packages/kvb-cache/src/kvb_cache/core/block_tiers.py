"""Disk and Redis tiers under the block pool: full blocks go down as records, hits come back up.

Each full block is one record (a :class:`~kvb_cache.store.ChunkEntry` of ``block_size`` tokens keyed by
its prefix hash), written behind on the tiers' background writer as soon as the block is registered, so
another process sharing Redis (or a restart reading the disk) sees it without waiting for an eviction;
an evicted block therefore already lives below. Lookups fetch a chain in one batched call per tier.
A record failing validation is dropped from its tier, counted and treated as a miss (recomputed).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvb_cache.config import EngineConfig
from kvb_cache.core.kv_storage import LayerShape
from kvb_cache.errors import ConfigError
from kvb_cache.hashing import ChunkHash, content_hash, prefix_hash, root_hash
from kvb_cache.records import RecordError, checked_kv, decode_record, encode_record
from kvb_cache.store import ChunkEntry, LayerKV
from kvb_cache.tiers.base import RecordTier, TierStats
from kvb_cache.tiers.disk import DiskTier
from kvb_cache.tiers.remote import RedisTier
from kvb_cache.tiers.tiered import LowerTier, close_tiers, drop_unread, gather_records
from kvb_cache.tiers.writer import BackgroundWriter

logger = logging.getLogger(__name__)

#: A key hit again within this many seconds is not bumped again (one bump per block per interval).
TOUCH_INTERVAL_S = 1.0
#: Keys whose last bump is remembered (the oldest are forgotten; a forgotten key is bumped again).
_TOUCHED_KEYS = 65536
#: A block a tier failed to take is written again after TOUCH_INTERVAL_S, then 4x longer after each failed
#: retry, at most _RETRY_GROWTH ** _RETRY_STEPS (1024) times longer.
_RETRY_GROWTH = 4
_RETRY_STEPS = 5
#: Threads that run the engine loop's tier lookups (:meth:`BlockTiers.fetch_async`): a lookup stalled on
#: one request's records (a Redis timeout) does not hold up the next request's disk probe.
LOAD_THREADS = 4


def size_records(
    lower: Sequence[LowerTier], shapes: Sequence[LayerShape], block_size: int, *, fingerprint: str
) -> None:
    """Bound each tier by the exact size of one block's record in its format (a block of zeros, encoded).

    A disk budget that cannot hold one record is a ConfigError: such a tier stored nothing, in silence, and
    refused the records other processes had written into the shared folder as larger than its budget. A
    Redis tier reads at most twice that (plus 64 KiB) of each value (:attr:`RedisTier.max_record_bytes`).
    """
    kv = tuple(
        (
            torch.zeros(1, s.kv_heads, block_size, s.key_dim, dtype=s.dtype),
            torch.zeros(1, s.kv_heads, block_size, s.value_dim, dtype=s.dtype),
        )
        for s in shapes
    )
    root = root_hash(fingerprint)
    ids = (0,) * block_size
    # start: a block deep in a long context (the record writes its position in digits: a block at 0 measured
    # 8 bytes less, and a budget within those bytes passed the check and then took no later block)
    entry = ChunkEntry(
        key=prefix_hash(root, ids),
        parent=root,
        content=content_hash(root, ids),
        token_ids=ids,
        kv=kv,
        start=10**12,
    )
    for level in lower:
        tier = level.tier
        if not isinstance(tier, (DiskTier, RedisTier)):
            continue
        size = len(encode_record(entry, level.format))
        if isinstance(tier, RedisTier):
            tier.max_record_bytes = 2 * size + (64 << 10)
        elif size > tier.max_bytes:
            raise ConfigError(
                f"disk_cache_bytes={tier.max_bytes} cannot hold one KV record of this model ({size} "
                f"bytes for a block of {block_size} tokens); raise disk_cache_bytes (--disk-cache-bytes) well "
                "above it (the default is 16 GiB), or leave the disk tier off"
            )


@dataclass(slots=True)
class _Missed:
    """A block some tiers failed to take: which, when it is next due to be written (monotonic seconds),
    how many retries failed."""

    tiers: frozenset[RecordTier]
    due: float
    tries: int


class BlockTiers:
    """The lower tiers of an engine, in lookup order (fastest first).

    ``shapes`` and ``block_size`` describe the pool's blocks: a record whose KV does not have exactly that
    layout (layers, heads, tokens, channels, dtype; finite values: :func:`~kvb_cache.records.checked_kv`) is
    dropped as invalid rather than written into the pool, where it would fail deep inside torch or, with
    fewer layers, leave stale KV in the others. None skips the check (records then only pass
    :func:`~kvb_cache.records.decode_record`'s own validation).
    """

    def __init__(
        self,
        lower: Sequence[LowerTier],
        writer: BackgroundWriter,
        *,
        shapes: Sequence[LayerShape] | None = None,
        block_size: int | None = None,
    ) -> None:
        self.lower = tuple(lower)
        self.writer = writer
        self.shapes = tuple(shapes) if shapes is not None else None
        self.block_size = block_size
        self._warned: set[tuple[str, str]] = set()  # (tier, exception type) already logged
        self._touched: OrderedDict[ChunkHash, float] = OrderedDict()  # key -> when it was last bumped
        self._loader: ThreadPoolExecutor | None = None  # made on the first fetch_async
        #: Blocks some tier failed to take (a full write queue, a paused, refusing or unreachable tier): a
        #: RAM hit on one writes it again (:meth:`unwritten`). Shared by the engine and writer threads.
        self._unwritten: OrderedDict[ChunkHash, _Missed] = OrderedDict()
        self._unwritten_lock = threading.Lock()
        #: Bumped when the tiers are cleared or closed: a lookup begun before (on a loader thread, it may end
        #: after) neither writes what it read into the faster tiers nor has its records promoted.
        self.generation = 0

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        fingerprint: str,
        shapes: Sequence[LayerShape] | None = None,
    ) -> BlockTiers | None:
        """The tiers ``config.tiers`` asks for, or None when it asks for none."""
        from kvb_cache.tiers.factory import lower_tiers

        tiers = config.tiers
        if tiers is None or not tiers.enabled:
            return None
        lower = lower_tiers(config, fingerprint=fingerprint)
        if shapes is not None:
            try:
                size_records(lower, shapes, config.block_size, fingerprint=fingerprint)
            except ConfigError:
                close_tiers(lower)
                raise
        return cls(
            lower,
            BackgroundWriter(tiers.max_pending_writes),
            shapes=shapes,
            block_size=config.block_size,
        )

    def fetch(self, keys: Sequence[ChunkHash], *, generation: int | None = None) -> list[LayerKV]:
        """Dense KV of the longest leading run of ``keys`` that some tier holds (valid records only).

        ``generation``: the :attr:`generation` the lookup began in (None: the current one).

        The first key is looked up alone first: a prompt the tiers never saw (most new prompts) costs one
        probe per tier, not one per block (a 250-block prompt made 250 failed opens on the disk tier, 11x
        the admission without a tier), since the run ends at the first miss anyway.
        """
        found: dict[ChunkHash, tuple[int, bytes]] = {}
        for probe in (keys[:1], keys):
            gather_records(self.lower, probe, found)
            if not keys or keys[0] not in found:
                return []
        run: list[LayerKV] = []
        for i, key in enumerate(keys):
            hit = found.get(key)
            kv = self._load(key, *hit, generation=generation) if hit is not None else None
            if kv is None:
                if hit is not None:  # invalid: the rest of the chain is recomputed and stored afresh
                    drop_unread(found, keys[i + 1 :], self.lower, self.writer)
                break
            run.append(kv)
        return run

    def fetch_async(self, keys: Sequence[ChunkHash]) -> Future[list[LayerKV]]:
        """:meth:`fetch` on a loader thread: the engine loop keeps stepping its running requests while a
        waiting request's records are read (and decoded), as vLLM's asynchronous KV-connector loads do.

        Before, the lookup ran inside the step, so every open stream paused for it: a stalled Redis held
        all of them for up to the remote timeout (2 s), and even a healthy round trip of a long prefix was
        paid by every running request. A lookup that fails answers an empty run (recomputed). Its result
        belongs to the current :attr:`generation` (compare before using it)."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kvb-tier-load")
        return self._loader.submit(self._fetch_or_nothing, tuple(keys), self.generation)

    def _fetch_or_nothing(self, keys: Sequence[ChunkHash], generation: int) -> list[LayerKV]:
        try:
            return self.fetch(keys, generation=generation)
        except Exception as exc:  # a tier's own failures are counted inside it; anything else: recompute
            kind = ("lookup", type(exc).__name__)
            if kind not in self._warned:
                self._warned.add(kind)
                logger.warning("a tier lookup failed (%s: %s); its blocks are recomputed", kind[1], exc)
            return []

    def _stop_loads(self) -> None:
        """Stop the loader threads (lookups not started are cancelled; one in flight ends on its own, and
        being of an older :attr:`generation`, writes nothing)."""
        self.generation += 1
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)

    def write_behind(self, entry: ChunkEntry) -> None:
        """Queue ``entry`` for every tier; a full queue drops it (counted)."""
        tiers = self.lower
        if tiers and not self.writer.submit(lambda: self._store(entry, tiers)):
            for lower in tiers:
                lower.tier.count("dropped")
            self._mark(entry.key, {lower.tier for lower in tiers})

    def unwritten(self, keys: Sequence[ChunkHash]) -> list[int]:
        """Indexes of ``keys`` (blocks just hit in RAM) that some tier failed to take and that are due to be
        written again; the caller writes them behind (its copy of the KV: a failure marks them again).

        Before, a block whose write was dropped (the queue full under a burst, the disk paused while full,
        Redis down for a moment) was never written later: a RAM hit only bumped records the tiers held. The
        prompt's head then stayed missing below, and every later block of the chain, written fine, was
        unreachable to other processes and after a restart (a lookup stops at the first missing block).

        A block is due :data:`TOUCH_INTERVAL_S` after its first failure, then 4x longer after each failed
        retry (up to ~17 minutes: a Redis refusing writes under ``noeviction`` never pauses, and each retry
        copies and encodes the block again); not while every tier lacking it is paused (it would be skipped
        again), nor while the write queue is half full (the retry would take a slot new blocks need).
        """
        if not self._unwritten or self.writer.pending * 2 >= self.writer.capacity:
            return []
        now = time.monotonic()
        due = []
        with self._unwritten_lock:
            for i, key in enumerate(keys):
                missed = self._unwritten.get(key)
                if missed is None or now < missed.due or all(tier.paused() for tier in missed.tiers):
                    continue
                missed.due = math.inf  # in flight: its store marks it again (tries kept) or drops it
                due.append(i)
        return due

    def _mark(self, key: ChunkHash, missing: set[RecordTier]) -> None:
        """Record which tiers lack ``key`` after a store (none: forget it)."""
        with self._unwritten_lock:
            if not missing:
                self._unwritten.pop(key, None)
                return
            before = self._unwritten.get(key)
            tries = before.tries + 1 if before is not None else 0
            delay = TOUCH_INTERVAL_S * _RETRY_GROWTH ** min(tries, _RETRY_STEPS)
            self._unwritten[key] = _Missed(frozenset(missing), time.monotonic() + delay, tries)
            self._unwritten.move_to_end(key)
            while len(self._unwritten) > _TOUCHED_KEYS:
                self._unwritten.popitem(last=False)

    def touch(self, keys: Sequence[ChunkHash], *, force: bool = False) -> None:
        """Queue a recency bump of ``keys`` (a prefix's blocks, in chain order, just hit in RAM) in every
        tier, each key at most once per :data:`TOUCH_INTERVAL_S` (``force``: every key, now). Without it a
        RAM hit never reached the tiers, so the most reused prefix (a shared system prompt) kept its first
        write's age and was the first record evicted, and every record after it in a chain became
        unreachable (a lookup stops at the first missing block). The bump goes from the chain's end to its
        start, so a chain's first block is its most recent and eviction takes chains from their ends (as
        vLLM's free queue does). A finished request bumps its whole chain (``force``): its blocks were
        written head first, so the head was the oldest record of the chain and evicted first."""
        if not self.lower or not keys or self.writer.pending * 2 >= self.writer.capacity:
            return  # a hint: never take the queue slots that record writes need (they would be dropped)
        now = time.monotonic()
        recent = self._touched
        due = [
            k for k in reversed(keys) if force or now - recent.get(k, -TOUCH_INTERVAL_S) >= TOUCH_INTERVAL_S
        ]
        lower = self.lower
        if not due or not self.writer.submit(lambda: [tier.tier.touch(due) for tier in lower]):
            return
        for key in due:
            recent[key] = now
            recent.move_to_end(key)
        while len(recent) > _TOUCHED_KEYS:
            recent.popitem(last=False)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued writes reached their tiers; False when ``timeout_s`` passed first."""
        return self.writer.flush(timeout_s)

    def clear(self) -> int:
        """Drop every record of this engine's namespace (its model fingerprint) from every tier, after the
        queued writes landed; returns how many records were dropped. Lookups in flight are of an older
        :attr:`generation` from now on: what they read (records of the old weights, after a weight change)
        is neither written back nor promoted."""
        self.generation += 1
        self.flush()
        with self._unwritten_lock:
            self._unwritten.clear()
        return sum(lower.tier.clear() or 0 for lower in self.lower)

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain the write-behind queue (bounded by ``timeout_s``), then close the tiers.

        Returns False when writes were still queued at the deadline (they may be lost at exit)."""
        self._stop_loads()
        drained = self.writer.close(timeout_s)
        close_tiers(self.lower)
        return drained

    def retire(self) -> None:
        """The owner was dropped without :meth:`close`: the writer thread ends once its queue is drained
        and then closes the tiers (never blocks)."""
        self._stop_loads()
        lower = list(self.lower)
        self.writer.retire(lambda: close_tiers(lower))

    def stats(self) -> list[TierStats]:
        return [lower.tier.stats() for lower in self.lower]

    def _load(
        self, key: ChunkHash, level: int, record: bytes, *, generation: int | None = None
    ) -> LayerKV | None:
        """The dense KV of a valid record for ``key``; None (dropped, counted ``corrupt``) otherwise."""
        lower = self.lower[level]
        try:
            entry = decode_record(record, lower.format)
            if entry.key != key:
                raise RecordError("record stored under another key")
            kv = self._dense(entry)
        except RecordError as exc:
            logger.warning("dropping invalid %s record %s: %s", lower.tier.name, key.hex()[:16], exc)
            lower.tier.count("corrupt")
            self.writer.submit(lambda: lower.tier.delete(key))
            return None
        if level:
            # A slower tier had it: fill the faster ones in the background.
            faster = self.lower[:level]
            born = self.generation if generation is None else generation
            self.writer.submit(lambda: self.generation == born and self._store(entry, faster))
        return kv

    def _dense(self, entry: ChunkEntry) -> LayerKV:
        """``entry``'s dense KV, checked against the pool's block layout (RecordError when it differs)."""
        return checked_kv(entry, self.shapes, tokens=self.block_size)

    def _store(self, entry: ChunkEntry, tiers: Sequence[LowerTier]) -> None:
        """Write ``entry`` to each of ``tiers`` lacking it (on the writer thread).

        A record that cannot be encoded (KV the codec refuses, e.g. NaN from an overflowing model) or
        written is counted as the tier's ``errors`` and logged once per tier and kind of failure: failing
        quietly on every block, the tier stayed empty while its stats read ``stores=0 errors=0``.
        """
        missing: set[RecordTier] = set()
        for lower in tiers:
            try:
                if lower.tier.contains(entry.key):
                    continue
                if lower.tier.paused():  # skipped without encoding (a big model's record is megabytes)
                    lower.tier.count("dropped")
                    missing.add(lower.tier)
                    continue
                record = encode_record(entry, lower.format)
            except Exception as exc:  # KV the codec refuses: writing it again would fail the same way
                self._store_failed(lower, exc)
                continue
            try:
                if not lower.tier.put(entry.key, record):
                    missing.add(lower.tier)  # paused, unreachable or full: written again on a RAM hit
            except Exception as exc:
                missing.add(lower.tier)
                self._store_failed(lower, exc)
        self._mark(entry.key, missing)

    def _store_failed(self, lower: LowerTier, exc: Exception) -> None:
        lower.tier.count("errors")
        kind = (lower.tier.name, type(exc).__name__)
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(
                "%s tier: a record could not be stored (%s: %s); counted in its errors, "
                "further failures of this kind are not logged",
                lower.tier.name,
                type(exc).__name__,
                exc,
            )
