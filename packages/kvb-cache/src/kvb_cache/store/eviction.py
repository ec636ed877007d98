"""Which chunk to evict. Only leaves are candidates, so a cached chain never loses a middle link."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvb_cache.store.entry import ChunkEntry


class EvictionPolicy(Protocol):
    def victim(self, leaves: Iterable[ChunkEntry]) -> ChunkEntry:
        """Pick the leaf to evict next (``leaves`` is never empty)."""
        ...

    def on_insert(self, entries: Iterable[ChunkEntry]) -> None:
        """Called after each insertion with every stored entry (for aging)."""
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

    def victim(self, leaves: Iterable[ChunkEntry]) -> ChunkEntry:
        return min(leaves, key=lambda e: (e.hits.bit_length(), e.last_used))

    def on_insert(self, entries: Iterable[ChunkEntry]) -> None:
        self._inserts += 1
        if self._inserts % self.aging_interval == 0:
            for entry in entries:
                entry.hits //= 2
