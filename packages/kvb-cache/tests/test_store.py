"""The RAM chunk store: budget, eviction order, no orphaned chains."""

from __future__ import annotations

from itertools import pairwise

import torch

from kvb_cache.hashing import ChunkHash, content_hash, prefix_hash, root_hash
from kvb_cache.store import ChunkEntry, ChunkStore

ROOT = root_hash("test-model")
TOKENS = 4
ENTRY_BYTES = 2 * (1 * 2 * TOKENS * 8) * 4  # k + v, [1, 2 heads, 4 tokens, 8 dims] fp32, one layer


def chain(store: ChunkStore, tag: int, length: int, parent: ChunkHash = ROOT) -> list[ChunkEntry]:
    entries = []
    for i in range(length):
        ids = [tag * 100 + i * TOKENS + j for j in range(TOKENS)]
        key = prefix_hash(parent, ids)
        kv = ((torch.zeros(1, 2, TOKENS, 8), torch.zeros(1, 2, TOKENS, 8)),)
        entry = ChunkEntry(
            key=key,
            parent=parent,
            content=content_hash(ROOT, ids),
            token_ids=tuple(ids),
            kv=kv,
            start=i * TOKENS,
        )
        assert entry.nbytes == ENTRY_BYTES
        store.put(entry, root=ROOT)
        entries.append(entry)
        parent = key
    return entries


def reachable(store: ChunkStore, entry: ChunkEntry) -> bool:
    """Every ancestor of a stored entry is stored too."""
    while entry.parent != ROOT:
        parent = store.peek(entry.parent)
        if parent is None:
            return False
        entry = parent
    return True


def test_budget_is_never_exceeded():
    store = ChunkStore(max_bytes=10 * ENTRY_BYTES)
    for tag in range(8):
        chain(store, tag, 3)
        assert store.stats().bytes <= 10 * ENTRY_BYTES
    assert len(store) == 10
    assert store.stats().evictions == 14


def test_leaves_evicted_before_parents_no_orphans():
    store = ChunkStore(max_bytes=6 * ENTRY_BYTES)
    first = chain(store, 1, 4)
    chain(store, 2, 4)  # needs 2 evictions: the tail of chain 1 goes first, never its head
    assert [store.peek(e.key) is not None for e in first] == [True, True, False, False]
    for key in list(store._entries):
        assert reachable(store, store.peek(key))


def test_lru_among_equally_used_leaves():
    store = ChunkStore(max_bytes=3 * ENTRY_BYTES)
    a, b, c = (chain(store, tag, 1)[0] for tag in (1, 2, 3))
    for entry in (a, b, c):
        store.get(entry.key)  # one hit each; a is now the least recent
    chain(store, 4, 1)
    assert store.peek(a.key) is None
    assert store.peek(b.key) is not None and store.peek(c.key) is not None


def test_frequently_used_system_prompt_survives_a_flood():
    store = ChunkStore(max_bytes=8 * ENTRY_BYTES)
    system = chain(store, 0, 2)
    for _ in range(20):
        for entry in system:
            store.get(entry.key)
    for tag in range(1, 40):  # one-off prompts, never hit again
        chain(store, tag, 2)
    assert all(store.peek(e.key) is not None for e in system)


def test_child_of_evicted_parent_is_refused():
    store = ChunkStore(max_bytes=100 * ENTRY_BYTES)
    orphan_parent = prefix_hash(ROOT, [9, 9, 9, 9])
    kv = ((torch.zeros(1, 2, TOKENS, 8), torch.zeros(1, 2, TOKENS, 8)),)
    entry = ChunkEntry(
        key=prefix_hash(orphan_parent, [1, 2, 3, 4]),
        parent=orphan_parent,
        content=content_hash(ROOT, [1, 2, 3, 4]),
        token_ids=(1, 2, 3, 4),
        kv=kv,
        start=4,
    )
    assert not store.put(entry, root=ROOT)
    assert len(store) == 0 and store.stats().rejected == 1


def test_oversized_entry_is_refused_without_evicting():
    store = ChunkStore(max_bytes=ENTRY_BYTES - 1)
    chain(store, 1, 1)
    assert len(store) == 0 and store.stats().evictions == 0


def test_complete_chunk_replaces_its_partial_tail():
    store = ChunkStore(max_bytes=100 * ENTRY_BYTES)
    kv = ((torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8)),)
    partial = ChunkEntry(
        key=prefix_hash(ROOT, [5, 6]),
        parent=ROOT,
        content=content_hash(ROOT, [5, 6]),
        token_ids=(5, 6),
        kv=kv,
        start=0,
        complete=False,
    )
    store.put(partial, root=ROOT)
    full = ChunkEntry(
        key=prefix_hash(ROOT, [5, 6, 7, 8]),
        parent=ROOT,
        content=content_hash(ROOT, [5, 6, 7, 8]),
        token_ids=(5, 6, 7, 8),
        kv=((torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)),),
        start=0,
    )
    store.put(full, root=ROOT)
    assert store.peek(partial.key) is None and store.children(ROOT) == [full]


def test_approximate_write_back_marks_chunks_holding_copied_kv_derived():
    """Chunks overlapping a copied range are ``derived``; with ``derived_too=False`` they are skipped and
    the next chunk kept roots a new run (its parent is not stored)."""
    from transformers import DynamicCache

    from kvb_cache.chunking import Chunker
    from kvb_cache.writeback import write_back_approximate

    root = root_hash("m")
    ids = list(range(100, 140))  # 10 chunks of 4
    cache = DynamicCache([(torch.randn(1, 1, 40, 2), torch.randn(1, 1, 40, 2))])
    kwargs = dict(start=8, num_layers=1, store_partial_tail=False)

    store = ChunkStore(max_bytes=1 << 20)
    write_back_approximate(store, Chunker(4), root, ids, cache, copied=[(10, 18)], **kwargs)
    stored = sorted(store._entries.values(), key=lambda e: e.start)
    assert [e.start for e in stored] == list(range(8, 40, 4))
    assert [e.start for e in stored if e.derived] == [8, 12, 16]
    assert not any(e.exact for e in stored)

    store = ChunkStore(max_bytes=1 << 20)
    write_back_approximate(
        store, Chunker(4), root, ids, cache, copied=[(10, 18)], derived_too=False, **kwargs
    )
    stored = sorted(store._entries.values(), key=lambda e: e.start)
    assert [e.start for e in stored] == list(range(20, 40, 4)) and not any(e.derived for e in stored)
    # The first one kept is computed after the skipped chunk: it roots its run; the rest chain on it.
    assert stored[0].parent not in store and all(b.parent == a.key for a, b in pairwise(stored))


class ScanStore(ChunkStore):
    """Reference: picks each victim by scanning every leaf (the definition the heap must reproduce)."""

    def _evict_one(self, protected):
        leaves = [e for k, e in self._entries.items() if k not in protected and not self._children.get(k)]
        if not leaves:
            return False
        victim = min(leaves, key=self.policy.priority)
        self._remove(victim)
        self._evictions += 1
        return True


def test_heap_eviction_matches_a_full_scan_of_the_leaves():
    """Random puts (chains, branches, partial tails), hits and aging: the heap-ordered store evicts exactly
    what a scan over every leaf would, keeps its leaf set right, and never orphans a chain."""
    import random

    from kvb_cache.store import FrequencyRecencyPolicy

    def entry(parent, ids, start, complete=True):
        n = len(ids)
        return ChunkEntry(
            key=prefix_hash(parent, ids),
            parent=parent,
            content=content_hash(ROOT, ids),
            token_ids=tuple(ids),
            kv=((torch.zeros(1, 2, n, 8), torch.zeros(1, 2, n, 8)),),
            start=start,
            complete=complete,
        )

    for seed in range(6):
        rng = random.Random(seed)
        stores = [
            # Aging re-ranks everything (a heap rebuild) every 37 inserts for half the seeds, never for the rest.
            cls(max_bytes=24 * ENTRY_BYTES, policy=FrequencyRecencyPolicy(37 if seed % 2 else 10**9))
            for cls in (ChunkStore, ScanStore)
        ]
        for step in range(1500):
            keys = sorted(stores[1]._entries, key=lambda k: stores[1]._entries[k].last_used)
            op = rng.random()
            if op < 0.35 and keys:  # a hit on some stored chunk (a frequency and recency change)
                key = rng.choice(keys)
                for store in stores:
                    store.get(key)
                continue
            parents = [e for e in (stores[1]._entries[k] for k in keys) if e.complete]
            parent = rng.choice(parents) if parents and rng.random() < 0.7 else None
            base, start = (parent.key, parent.start + TOKENS) if parent else (ROOT, 0)
            ids = [rng.randrange(6) for _ in range(TOKENS)]
            if rng.random() < 0.2:  # a partial tail: 1-3 tokens, later subsumed by a complete sibling
                ids = ids[: rng.randrange(1, TOKENS)]
            for store in stores:
                store.put(entry(base, ids, start, complete=len(ids) == TOKENS), root=ROOT)
            heap, scan = stores
            assert set(heap._entries) == set(scan._entries), f"seed {seed} step {step}"
            assert heap.stats() == scan.stats(), f"seed {seed} step {step}"
            assert heap._leaves == {k for k in heap._entries if not heap._children.get(k)}
            assert all(reachable(heap, e) for e in heap._entries.values())
        assert stores[0].stats().evictions > 200  # the comparison covered a full store
