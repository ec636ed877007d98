"""Which chunk to evict. Only leaves are candidates, so a cached chain never loses a middle link."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvb_cache.store.entry import ChunkEntry


class EvictionPolicy(Protocol):
    """Ranks leaves for eviction: the store evicts the leaf with the lowest :meth:`priority` first.

    The store keeps leaves in a heap keyed by this rank (an eviction costs O(log leaves), not a scan), so a
    rank may change only when the store counts a use of the entry (its ``hits`` / ``last_used``) or when
    :meth:`on_insert` returns True.
    """

    def priority(self, entry: ChunkEntry) -> tuple[int, ...]:
        """The entry's rank; lower is evicted first."""
        ...

    def on_insert(self, entries: Iterable[ChunkEntry]) -> bool:
        """Called after each insertion with every stored entry (for aging).

        Returns True when it changed stored entries' ranks, so the store re-ranks them.
        """
        ...


class FrequencyRecencyPolicy:
    """Evict the least frequently used leaf, least recently used among equals.

    Frequency counts hits in log2 buckets, so a shared system prompt hit hundreds of times outranks a flood of
    one-off prompts (0 hits) without needing unbounded counters. Every ``aging_interval`` insertions all hit
    counts are halved, so yesterday's hot chunk cannot stay resident forever.
    """

    def __init__(self, aging_interval: int = 4096) -> None:
        self.aging_interval = aging_interval
        self._inserts = 0

    def priority(self, entry: ChunkEntry) -> tuple[int, ...]:
        return (entry.hits.bit_length(), entry.last_used)

    def on_insert(self, entries: Iterable[ChunkEntry]) -> bool:
        self._inserts += 1
        if self._inserts % self.aging_interval:
            return False
        for entry in entries:
            entry.hits //= 2
        return True
