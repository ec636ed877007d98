"""Block pool policy with exact block ids: sharing, eviction order, tail index, chain heads surviving."""

from __future__ import annotations

import pytest

from kvb_cache.core.block_pool import BlockPool, NoFreeBlocksError
from kvb_cache.hashing import ChunkHash

ROOT = ChunkHash(b"root")


def h(name: str) -> ChunkHash:
    return ChunkHash(name.encode())


def test_take_share_release_and_lru_eviction_order():
    pool = BlockPool(4, 2)
    a, b = pool.take(2)
    assert (a.id, b.id, pool.num_free) == (0, 1, 2)
    pool.register_full(a, parent=ROOT, block_hash=h("A"), token_ids=(1, 2))
    pool.register_full(b, parent=h("A"), block_hash=h("B"), token_ids=(3, 4))
    pool.release(reversed([a, b]))  # chain released tail first
    assert pool.num_free == 4 and pool.num_cached == 2
    # Never-used blocks go first, then the chain's tail before its head.
    assert [blk.id for blk in pool.take(3)] == [2, 3, 1]
    assert pool.lookup(h("B")) is None and pool.lookup(h("A")) is a
    assert pool.evictions == 1


def test_a_released_uncached_block_is_taken_before_any_cached_one_is_evicted():
    # At the tail, a request's uncached blocks let cached blocks freed before them reach the head: a prompt
    # repeated in a loop evicted a cached document one block per repeat while free blocks were to spare.
    pool = BlockPool(4, 2)
    a, b, c = pool.take(3)
    pool.register_full(a, parent=ROOT, block_hash=h("A"), token_ids=(1, 2))
    pool.release([a])  # a cached document block
    pool.release([b, c])  # a finished request's blocks that hold nothing cached
    assert [blk.id for blk in pool.take(3)] == [c.id, b.id, 3]
    assert pool.lookup(h("A")) is a and pool.evictions == 0


def test_shared_block_leaves_free_queue_and_is_not_evicted():
    pool = BlockPool(2, 2)
    (a,) = pool.take(1)
    pool.register_full(a, parent=ROOT, block_hash=h("A"), token_ids=(1, 2))
    pool.release([a])
    pool.share(pool.lookup(h("A")))
    assert a.ref_count == 1 and pool.num_free == 1
    pool.take(1)
    with pytest.raises(NoFreeBlocksError):
        pool.take(1)
    assert pool.lookup(h("A")) is a


def test_duplicate_hash_keeps_first_and_partial_tails_are_children():
    pool = BlockPool(3, 4)
    a, b, c = pool.take(3)
    assert pool.register_full(a, parent=ROOT, block_hash=h("A"), token_ids=(1, 2, 3, 4))
    assert not pool.register_full(b, parent=ROOT, block_hash=h("A"), token_ids=(1, 2, 3, 4))
    pool.register_partial(c, parent=h("A"), token_ids=(5, 6))
    assert [x.id for x in pool.children(h("A"))] == [c.id] and c.hash is None
    pool.release([c])
    pool.reset()
    assert pool.children(h("A")) == [] and pool.lookup(h("A")) is a  # owned blocks keep their index


def test_longest_child_equals_a_scan_of_every_child():
    """The sorted tail index answers what scanning every child answered (the block sharing the longest
    prefix with the query), through registrations, re-registrations and evictions."""
    import random

    from kvb_cache.lookup import common_prefix_len

    rng = random.Random(0)
    pool = BlockPool(64, 8)
    blocks = pool.take(64)
    for step in range(400):
        block = rng.choice(blocks)
        tokens = tuple(rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 8)))
        if rng.random() < 0.2 and block.indexed:
            pool.release([block])  # evictable; reset drops the index of every unowned block
            pool.reset()
            blocks = [b for b in blocks if b.ref_count]
            if not blocks:
                break
            continue
        if len(tokens) == 8:
            pool.register_full(block, parent=ROOT, block_hash=h(f"{step}"), token_ids=tokens)
        else:
            pool.register_partial(block, parent=ROOT, token_ids=tokens)
        query = [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 10))]
        scan = max((common_prefix_len(b.token_ids, query) for b in pool.children(ROOT)), default=0)
        best, n = pool.longest_child(ROOT, query)
        assert n == scan and (best is None) == (n == 0)
        assert best is None or common_prefix_len(best.token_ids, query) == n
    assert pool.longest_child(h("nothing"), [1]) == (None, 0)


def test_the_cached_count_follows_every_move_of_a_block():
    """num_cached is kept as blocks move (walking the free queue was O(num_blocks) per stats read)."""
    import random

    rng = random.Random(1)
    pool = BlockPool(32, 4)
    owned: list = []
    for step in range(2000):
        action = rng.random()
        if action < 0.3 and pool.num_free:
            owned += pool.take(rng.randint(1, min(3, pool.num_free)))
        elif action < 0.55 and owned:
            block = owned.pop(rng.randrange(len(owned)))
            pool.release([block])
        elif action < 0.75 and owned:
            block = rng.choice(owned)
            tokens = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 4)))
            if len(tokens) == 4:
                pool.register_full(block, parent=ROOT, block_hash=h(f"{tokens}"), token_ids=tokens)
            else:
                pool.register_partial(block, parent=ROOT, token_ids=tokens)
        elif action < 0.9:
            cached = [b for b in pool.blocks if b.ref_count == 0 and b.indexed]
            if cached:
                block = rng.choice(cached)
                pool.share(block)
                owned.append(block)
        elif action < 0.95:
            pool.reset()
        walked = sum(1 for b in pool.blocks if b.ref_count == 0 and b.indexed)
        assert pool.num_cached == walked, step
