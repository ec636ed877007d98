"""RAM -> disk -> Redis behind the store surface the engine already uses."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvb_cache.codecs import KVCodec
from kvb_cache.hashing import ChunkHash, content_hash
from kvb_cache.records import RecordError, RecordFormat, checked_kv, decode_record, encode_record
from kvb_cache.store import ChunkEntry, ChunkStore, StoreStats
from kvb_cache.tiers.base import RecordTier, TierStats
from kvb_cache.tiers.transcode import with_codec
from kvb_cache.tiers.writer import BackgroundWriter

if TYPE_CHECKING:
    from kvb_cache.core.kv_storage import LayerShape

logger = logging.getLogger(__name__)

# A key every lower tier just missed is not asked for again within this window: the chain walk right
# after a prefetch would otherwise repeat the round trip for the first uncached chunk.
_NEGATIVE_TTL_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LowerTier:
    """A record tier and the record format (fingerprint + codec) it stores."""

    tier: RecordTier
    format: RecordFormat


def gather_records(
    lower: Sequence[LowerTier], keys: Sequence[ChunkHash], found: dict[ChunkHash, tuple[int, bytes]]
) -> None:
    """Fetch the records of ``keys`` into ``found`` (key -> (tier level, record)), fastest tier first:
    one batched ``get_many`` per tier for the keys no faster tier (nor an earlier call) had."""
    for level, tier in enumerate(lower):
        missing = [k for k in keys if k not in found]
        if not missing:
            return
        for key, record in zip(missing, tier.tier.get_many(missing)):
            if record is not None:
                found[key] = (level, record)


def drop_unread(
    found: dict[ChunkHash, tuple[int, bytes]],
    after: Sequence[ChunkHash],
    lower: Sequence[LowerTier],
    writer: BackgroundWriter,
) -> None:
    """Records fetched for the keys ``after`` an invalid record of a chain: drop them unread.

    ``found``: key -> (tier level, record) as fetched. The chain is recomputed from the invalid record on,
    and its write-behind skips keys a tier already holds: a bad record further down was never read nor
    replaced, so a chain of N bad records took N requests to heal (one block per request). Their deletion is
    queued before the recompute's writes (one FIFO writer), which then store fresh records. They count as
    misses, not hits (the hit rate said 0.9 while nothing was served).
    """
    for key in after:
        hit = found.get(key)
        if hit is None:
            continue
        tier = lower[hit[0]].tier
        tier.count("hits", -1)
        tier.count("misses", 1)
        writer.submit(lambda tier=tier, key=key: tier.delete(key))


def close_tiers(lower: Sequence[LowerTier]) -> None:
    """Close each lower tier (its files' budget, its Redis connections)."""
    for tier in lower:
        tier.tier.close()


class TieredStore:
    """The engine's chunk store with lower tiers under the RAM :class:`ChunkStore`.

    - Lookups: ``get`` serves from RAM, else from the first lower tier holding a valid record, which is
      then promoted into RAM (and written behind into the faster lower tiers that lacked it).
      :meth:`prefetch` fetches a whole chain in one batched call per tier (one ``MGET`` for Redis).
    - Stores: ``put`` inserts into RAM (encoded with the RAM codec) and queues a write into every lower
      tier on the background writer; a RAM eviction queues a demotion for tiers missing the record. A
      full queue drops the write (counted), never blocking a request.
    - ``children``, ``by_content`` and the radix tail match are RAM-only: lower tiers are key -> record.
    - A record failing validation is dropped from its tier, counted (``corrupt``), and treated as a miss
      (recomputed), never served or raised: the checks of :func:`~kvb_cache.records.decode_record` and,
      when ``shapes`` is known, its KV layout (:func:`~kvb_cache.records.checked_kv`: layer count, KV
      heads, head dims, dtype, the chunk's token count, finite values).

    Args:
        ram: the in-memory store (its ``on_evict`` hook must call :meth:`demote`; :func:`build_store`
            wires it).
        root: the model fingerprint's root hash (parent of every first chunk).
        codec: the codec RAM entries are held in.
        lower: tiers in lookup order (fastest first).
        writer: the write-behind queue.
        shapes: the model's per-layer KV shapes (:func:`~kvb_cache.core.kv_storage.probe_layer_shapes`)
            every promoted record is checked against. None (no model known yet) skips that check;
            :class:`~kvb_cache.engine.KVBoost` fills it in with its model's shapes when given such a store.
    """

    def __init__(
        self,
        ram: ChunkStore,
        *,
        root: ChunkHash,
        codec: KVCodec,
        lower: Sequence[LowerTier],
        writer: BackgroundWriter,
        shapes: Sequence[LayerShape] | None = None,
    ) -> None:
        self.ram = ram
        self.root = root
        self.codec = codec
        self.lower = tuple(lower)
        self.writer = writer
        self.shapes = tuple(shapes) if shapes is not None else None
        self._negative: dict[ChunkHash, float] = {}
        self._neg_lock = threading.Lock()

    # ----------------------------------------------------------------- store surface used by the engine
    def __len__(self) -> int:
        return len(self.ram)

    def __contains__(self, key: ChunkHash) -> bool:
        """RAM membership: write-back must re-put a chunk that only a lower tier holds, to chain in RAM."""
        return key in self.ram

    @property
    def max_bytes(self) -> int:
        return self.ram.max_bytes

    def get(self, key: ChunkHash) -> ChunkEntry | None:
        entry = self.ram.get(key)
        if entry is None and self.lower and not self._recently_missed(key):
            self.prefetch([key])
            entry = self.ram.get(key)
        return entry

    def peek(self, key: ChunkHash) -> ChunkEntry | None:
        return self.ram.peek(key)

    def children(self, parent: ChunkHash) -> list[ChunkEntry]:
        return self.ram.children(parent)

    def by_content(self, content: ChunkHash) -> list[ChunkEntry]:
        return self.ram.by_content(content)

    def touch(self, entry: ChunkEntry) -> None:
        self.ram.touch(entry)

    def put(self, entry: ChunkEntry, *, root: ChunkHash) -> bool:
        """Insert into RAM and write behind to the lower tiers.

        Chunks of a salted chain (``root`` is not the fingerprint root) stay in RAM: records verify their
        content hash against the fingerprint root, which a salted chain's content hash is not rooted in.
        """
        held = with_codec(entry, self.codec)
        with self._neg_lock:
            self._negative.pop(entry.key, None)
        stored = self.ram.put(held, root=root)
        if stored and self.lower and root == self.root:
            self._write_behind(held, self.lower)
        return stored

    def clear(self) -> None:
        """Empty RAM only: lower tiers may be shared; use :meth:`clear_tiers` to drop their records."""
        self.ram.clear()

    def stats(self) -> StoreStats:
        return self.ram.stats()

    # ----------------------------------------------------------------- tiering
    def prefetch(self, keys: Sequence[ChunkHash]) -> int:
        """Promote the longest run of ``keys`` (a chain, in order) that RAM lacks but lower tiers hold.

        Returns how many chunks were promoted. Each tier is asked once for every key still missing.
        """
        start = 0
        while start < len(keys) and keys[start] in self.ram:
            start += 1
        wanted = [k for k in keys[start:] if not self._recently_missed(k)]
        if not wanted or not self.lower:
            return 0
        found: dict[ChunkHash, tuple[int, bytes]] = {}
        gather_records(self.lower, wanted, found)
        promoted = 0
        chain = keys[start:]
        for i, key in enumerate(chain):
            hit = found.get(key)
            if hit is None:
                self._remember_miss(key)
                break
            entry = self._load(key, *hit)
            if entry is None:
                # Invalid record (its deletion is queued): do not read it again before it is gone.
                self._remember_miss(key)
                drop_unread(found, chain[i + 1 :], self.lower, self.writer)
                break
            if not self.ram.put(entry, root=self.root):
                break
            promoted += 1
        return promoted

    def demote(self, entry: ChunkEntry) -> None:
        """RAM eviction hook: queue ``entry`` for lower tiers that do not hold it yet (never blocks).

        Salted chunks (content hash not rooted in the fingerprint, see :meth:`put`) are not demoted."""
        if self.lower and entry.content == content_hash(self.root, entry.token_ids):
            self.writer.submit(lambda: self._store_where_missing(entry, self.lower))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued write-behind and demotions reached their tiers; False when ``timeout_s``
        passed first."""
        return self.writer.flush(timeout_s)

    def clear_tiers(self) -> int:
        """Empty RAM and drop this fingerprint's records from every lower tier; returns how many records
        the lower tiers dropped."""
        self.flush()
        self.ram.clear()
        return sum(lower.tier.clear() or 0 for lower in self.lower)

    def tier_stats(self) -> list[TierStats]:
        ram = self.ram.stats()
        first = TierStats(
            name="ram", entries=ram.entries, bytes=ram.bytes, stores=ram.inserts, evictions=ram.evictions
        )
        return [first, *(lower.tier.stats() for lower in self.lower)]

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain the write-behind queue (bounded by ``timeout_s``), then close the tiers; False when writes
        were still queued at the deadline."""
        drained = self.writer.close(timeout_s)
        close_tiers(self.lower)
        return drained

    def retire(self) -> None:
        """The owner was dropped without :meth:`close`: the writer thread ends once its queue is drained
        and then closes the tiers (never blocks)."""
        lower = list(self.lower)
        self.writer.retire(lambda: close_tiers(lower))

    # ----------------------------------------------------------------- internals
    def _load(self, key: ChunkHash, level: int, record: bytes) -> ChunkEntry | None:
        lower = self.lower[level]
        try:
            entry = decode_record(record, lower.format)
            if entry.key != key:
                raise RecordError("record stored under another key")
            if self.shapes is not None:
                checked_kv(entry, self.shapes)
        except RecordError as exc:
            logger.warning("dropping invalid %s record %s: %s", lower.tier.name, key.hex()[:16], exc)
            lower.tier.count("corrupt")
            self.writer.submit(lambda: lower.tier.delete(key))
            return None
        held = with_codec(entry, self.codec)
        if level:
            # A slower tier had it: fill the faster ones in the background.
            self._write_behind(held, self.lower[:level])
        return held

    def _write_behind(self, entry: ChunkEntry, tiers: Sequence[LowerTier]) -> None:
        if not self.writer.submit(lambda: self._store_where_missing(entry, tiers, check=False)):
            for lower in tiers:
                lower.tier.count("dropped")

    @staticmethod
    def _store_where_missing(entry: ChunkEntry, tiers: Sequence[LowerTier], *, check: bool = True) -> None:
        for lower in tiers:
            if check and lower.tier.contains(entry.key):
                continue
            lower.tier.put(entry.key, encode_record(entry, lower.format))

    def _recently_missed(self, key: ChunkHash) -> bool:
        with self._neg_lock:
            deadline = self._negative.get(key)
            if deadline is None:
                return False
            if deadline < time.monotonic():
                del self._negative[key]
                return False
            return True

    def _remember_miss(self, key: ChunkHash) -> None:
        now = time.monotonic()
        with self._neg_lock:
            if len(self._negative) > 1024:
                self._negative = {k: d for k, d in self._negative.items() if d >= now}
            self._negative[key] = now + _NEGATIVE_TTL_S
