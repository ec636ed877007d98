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
