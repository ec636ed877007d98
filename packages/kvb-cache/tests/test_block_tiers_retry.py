"""Blocks a lower tier failed to take are written again on RAM hits: when, how often, and to which tiers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_tiers_disk import FINGERPRINT, chain

from kvb_cache.codecs import DenseCodec
from kvb_cache.core import block_tiers
from kvb_cache.core.block_tiers import BlockTiers
from kvb_cache.hashing import ChunkHash
from kvb_cache.records import RecordFormat
from kvb_cache.tiers import BackgroundWriter, LowerTier
from kvb_cache.tiers.base import RecordTier, TierStats


class FakeTier(RecordTier):
    """Refuses every store (as a full Redis under ``noeviction`` does: refused, never paused) unless told."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.held: set[ChunkHash] = set()
        self.refuse = True
        self.is_paused = False
        self.puts = 0

    def get(self, key: ChunkHash) -> bytes | None:
        return None

    def put(self, key: ChunkHash, record: bytes) -> bool:
        self.puts += 1
        if self.refuse:
            return False
        self.held.add(key)
        return True

    def contains(self, key: ChunkHash) -> bool:
        return key in self.held

    def delete(self, key: ChunkHash) -> None:
        self.held.discard(key)

    def clear(self) -> int:
        return 0

    def stats(self) -> TierStats:
        return TierStats(name=self.name, entries=len(self.held), bytes=0)

    def paused(self) -> bool:
        return self.is_paused


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(block_tiers, "time", clock)  # the retry schedule's clock only
    monkeypatch.setattr(block_tiers, "TOUCH_INTERVAL_S", 1.0)
    return clock


def tiers_over(*tiers: FakeTier, capacity: int = 16) -> BlockTiers:
    fmt = RecordFormat(fingerprint=FINGERPRINT, codec=DenseCodec())
    return BlockTiers([LowerTier(tier=t, format=fmt) for t in tiers], BackgroundWriter(capacity))


def due(bt: BlockTiers, keys: Sequence[ChunkHash]) -> list[int]:
    return bt.unwritten(keys)


def test_a_tier_refusing_every_store_is_retried_ever_more_rarely(clock):
    """A Redis refusing writes never pauses: each RAM hit a second apart copied, encoded and sent the block
    again, forever. Retries now back off 4x each time (1, 4, 16, 64 s, ...)."""
    tier = FakeTier("redis")
    bt = tiers_over(tier)
    entry = chain(1)[0]
    bt._store(entry, bt.lower)
    waits = []
    for _ in range(4):
        start = clock.now
        while not due(bt, [entry.key]):
            clock.now += 0.5
        waits.append(clock.now - start)
        bt._store(entry, bt.lower)  # the retry, refused again
    assert waits == [1.0, 4.0, 16.0, 64.0] and tier.puts == 5
    tier.refuse = False
    clock.now += 256
    assert due(bt, [entry.key]) == [0]
    bt._store(entry, bt.lower)
    clock.now += 10_000
    assert due(bt, [entry.key]) == [] and entry.key in tier.held  # stored: forgotten


def test_a_block_in_flight_is_not_handed_out_twice(clock):
    bt = tiers_over(FakeTier("disk"))
    entry = chain(1)[0]
    bt._store(entry, bt.lower)
    clock.now += 1
    assert due(bt, [entry.key]) == [0]
    assert due(bt, [entry.key]) == []  # its retry is queued; a second hit does not copy it again


def test_a_paused_tier_does_not_hold_back_a_healthy_one(clock):
    """Any paused tier stopped every retry: with Redis down, a block the disk had missed was never written
    to disk. A block is now due unless every tier lacking it is paused."""
    disk, redis = FakeTier("disk"), FakeTier("redis")
    bt = tiers_over(disk, redis)
    entry = chain(1)[0]
    bt._store(entry, bt.lower)  # both refused
    redis.is_paused = True
    disk.refuse = False
    clock.now += 1
    assert due(bt, [entry.key]) == [0]
    bt._store(entry, bt.lower)
    assert entry.key in disk.held and redis.puts == 1  # the paused tier was skipped, not sent the record
    clock.now += 100
    assert due(bt, [entry.key]) == []  # only the paused tier lacks it now
    redis.is_paused = False
    assert due(bt, [entry.key]) == [0]


def test_retries_wait_while_the_write_queue_is_half_full(clock, monkeypatch):
    """Re-writes into a full queue were copied and dropped again at every hit."""
    bt = tiers_over(FakeTier("disk"), capacity=4)
    entry = chain(1)[0]
    bt._store(entry, bt.lower)
    clock.now += 1
    queued = [2]  # half of the queue holds new blocks' writes
    monkeypatch.setattr(BackgroundWriter, "pending", property(lambda self: queued[0]))
    assert due(bt, [entry.key]) == []
    queued[0] = 1
    assert due(bt, [entry.key]) == [0]
