"""Byte-budgeted, thread-safe in-memory chunk store keyed by prefix hash."""

from __future__ import annotations

import heapq
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvb_cache.hashing import ChunkHash
from kvb_cache.store.entry import ChunkEntry
from kvb_cache.store.eviction import EvictionPolicy, FrequencyRecencyPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    entries: int
    bytes: int
    max_bytes: int
    inserts: int
    evictions: int
    rejected: int


class ChunkStore:
    """Chunks by prefix hash, with a parent -> children index and a content-hash index.

    Invariants (kept under one lock): every stored chunk's parent is the root or a stored chunk; total
    bytes never exceed ``max_bytes``; only leaves (chunks without stored children) are evicted, so no chain
    is ever left with a gap.

    A full store evicts on every insert, so the leaves are kept in a heap keyed by the policy's rank, with
    lazy invalidation (an entry whose rank changed is pushed again; stale rows are skipped when popped):
    an eviction is O(log entries), where listing every leaf made each insert into a full store of 6,144
    chunks cost ~10 ms.
    """

    def __init__(
        self,
        max_bytes: int,
        policy: EvictionPolicy | None = None,
        *,
        on_evict: Callable[[ChunkEntry], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.policy = policy or FrequencyRecencyPolicy()
        # Called under the store lock with each evicted entry (tiering queues a demotion): must not block.
        self.on_evict = on_evict
        self._entries: dict[ChunkHash, ChunkEntry] = {}
        self._children: dict[ChunkHash, set[ChunkHash]] = defaultdict(set)
        self._by_content: dict[ChunkHash, set[ChunkHash]] = defaultdict(set)
        # Partial tails by parent: a complete chunk replaces those it extends (checked without listing the
        # parent's complete children, one per distinct prompt after a shared system prompt).
        self._partials: dict[ChunkHash, set[ChunkHash]] = defaultdict(set)
        self._leaves: set[ChunkHash] = set()
        # (rank, key) rows; a row is live when its key is a stored leaf and the rank is still current.
        self._heap: list[tuple[tuple[int, ...], ChunkHash]] = []
        self._bytes = 0
        self._clock = 0
        self._inserts = 0
        self._evictions = 0
        self._rejected = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ChunkHash) -> bool:
        return key in self._entries

    def get(self, key: ChunkHash) -> ChunkEntry | None:
        """The entry for ``key`` (counted as a use), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._touch(entry)
            return entry

    def peek(self, key: ChunkHash) -> ChunkEntry | None:
        """Like :meth:`get` without counting a use."""
        return self._entries.get(key)

    def prefetch(self, keys: Sequence[ChunkHash]) -> int:
        """Hook for tiered stores (batched fetch of a chain from lower tiers); RAM alone has nothing to do."""
        return 0

    def children(self, parent: ChunkHash) -> list[ChunkEntry]:
        """Stored chunks that directly follow ``parent``."""
        with self._lock:
            return [self._entries[k] for k in self._children.get(parent, ())]

    def by_content(self, content: ChunkHash) -> list[ChunkEntry]:
        """Stored chunks with these tokens, after any history."""
        with self._lock:
            return [self._entries[k] for k in self._by_content.get(content, ())]

    def touch(self, entry: ChunkEntry) -> None:
        with self._lock:
            if entry.key in self._entries:
                self._touch(entry)

    def put(self, entry: ChunkEntry, *, root: ChunkHash) -> bool:
        """Insert ``entry`` unless present; evict leaves to make room. Returns whether it is now stored.

        Refused when its parent is neither ``root`` nor stored (the chain was evicted meanwhile), or when
        it alone exceeds the budget.
        """
        with self._lock:
            if entry.key in self._entries:
                return True
            parent = self._entries.get(entry.parent)
            if entry.parent != root and (parent is None or not parent.complete):
                self._rejected += 1
                return False
            if entry.nbytes > self.max_bytes:
                self._rejected += 1
                return False
            if entry.complete:
                # A complete chunk subsumes partial tails of its own prefix stored under the same parent.
                for key in list(self._partials.get(entry.parent, ())):
                    sibling = self._entries[key]
                    if entry.token_ids[: sibling.num_tokens] == sibling.token_ids:
                        self._remove(sibling)
            protected = {entry.parent}
            while self._bytes + entry.nbytes > self.max_bytes:
                if not self._evict_one(protected):
                    self._rejected += 1
                    return False
            self._entries[entry.key] = entry
            self._children[entry.parent].add(entry.key)
            self._by_content[entry.content].add(entry.key)
            if not entry.complete:
                self._partials[entry.parent].add(entry.key)
            self._leaves.discard(entry.parent)
            self._bytes += entry.nbytes
            self._inserts += 1
            self._clock += 1
            entry.last_used = self._clock
            self._leaves.add(entry.key)
            if self.policy.on_insert(self._entries.values()):
                self._rebuild_heap()
            else:
                self._push(entry)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._children.clear()
            self._by_content.clear()
            self._partials.clear()
            self._leaves.clear()
            self._heap.clear()
            self._bytes = 0

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                entries=len(self._entries),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                inserts=self._inserts,
                evictions=self._evictions,
                rejected=self._rejected,
            )

    def _touch(self, entry: ChunkEntry) -> None:
        self._clock += 1
        entry.hits += 1
        entry.last_used = self._clock
        if entry.key in self._leaves:
            self._push(entry)

    def _push(self, entry: ChunkEntry) -> None:
        heapq.heappush(self._heap, (self.policy.priority(entry), entry.key))
        # Touches leave stale rows behind: compact before they outnumber the live ones.
        if len(self._heap) > 4 * len(self._leaves) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(self.policy.priority(self._entries[k]), k) for k in self._leaves]
        heapq.heapify(self._heap)

    def _pop_victim(self, protected: set[ChunkHash]) -> ChunkEntry | None:
        """The lowest-ranked live leaf outside ``protected`` (popped), or None when there is none."""
        skipped = []
        victim = None
        while self._heap:
            rank, key = heapq.heappop(self._heap)
            if key not in self._leaves or rank != self.policy.priority(self._entries[key]):
                continue  # stale: evicted, no longer a leaf, or pushed again with its new rank
            if key in protected:
                skipped.append((rank, key))
                continue
            victim = self._entries[key]
            break
        for row in skipped:
            heapq.heappush(self._heap, row)
        return victim

    def _evict_one(self, protected: set[ChunkHash]) -> bool:
        victim = self._pop_victim(protected)
        if victim is None:
            return False
        self._remove(victim)
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict(victim)
        return True

    def _remove(self, entry: ChunkEntry) -> None:
        assert not self._children.get(entry.key), "only leaves are removed"
        del self._entries[entry.key]
        self._children.pop(entry.key, None)
        self._leaves.discard(entry.key)
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(entry.key)
            if not siblings:
                del self._children[entry.parent]
                parent = self._entries.get(entry.parent)
                if parent is not None:  # the parent is a leaf again: an eviction candidate
                    self._leaves.add(parent.key)
                    self._push(parent)
        partials = self._partials.get(entry.parent)
        if partials is not None:
            partials.discard(entry.key)
            if not partials:
                del self._partials[entry.parent]
        same = self._by_content.get(entry.content)
        if same is not None:
            same.discard(entry.key)
            if not same:
                del self._by_content[entry.content]
        self._bytes -= entry.nbytes
