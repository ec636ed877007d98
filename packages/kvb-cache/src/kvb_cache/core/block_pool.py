"""Block bookkeeping of the paged KV pool: reference counts, prefix hashes, the free queue.

No tensors live here (:class:`kvb_cache.core.kv_storage.KVStorage` holds them), so the pool's policy is
tested with exact block ids on plain Python objects.

A block is in exactly one of three states:

- **used**: ``ref_count > 0``; owned by one or more running requests (shared prefix blocks have several).
- **cached**: ``ref_count == 0`` but it still holds reusable KV, indexed by its prefix hash (a full block) or
  under its parent hash as a *partial* tail (the first ``num_tokens`` tokens after that parent). It sits in
  the free queue and is evicted (its index entries dropped) only when a new block is needed.
- **free**: ``ref_count == 0`` and nothing indexed.

The free queue is in eviction order, least recently released first. A request's blocks are released
last-block-first, so a chain's tail is evicted before its head and a surviving head stays reachable.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NewType

from kvb_cache.hashing import ChunkHash
from kvb_cache.lookup import common_prefix_len

BlockId = NewType("BlockId", int)


@dataclass(slots=True, eq=False)
class Block:
    """One fixed-size KV block.

    ``hash`` is set when the block is full and its KV is exact for ``parent`` followed by ``token_ids``
    (then ``hash == prefix_hash(parent, token_ids)``); a partial cached tail has ``hash is None`` and
    ``parent`` / ``token_ids`` set.
    """

    id: BlockId
    ref_count: int = 0
    hash: ChunkHash | None = None
    parent: ChunkHash | None = None
    token_ids: tuple[int, ...] = field(default=())

    @property
    def indexed(self) -> bool:
        return self.parent is not None


class NoFreeBlocksError(Exception):
    """Raised internally when the pool cannot provide a block (the scheduler preempts on it)."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        on_evict: called with a cached block just before its index entries are dropped for reuse.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, on_evict: Callable[[Block], None] | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        self.on_evict = on_evict
        # block id -> None, in eviction order (front first). Every block with ref_count 0 is here.
        self._free: OrderedDict[BlockId, None] = OrderedDict((b.id, None) for b in self.blocks)
        self._by_hash: dict[ChunkHash, BlockId] = {}
        # parent hash -> the cached blocks (full or partial) that follow it, as (token_ids, block id) sorted:
        # the token-granular tail match. Sorted, the block sharing the longest prefix with a query is next to
        # the query's insertion point (O(log n)); scanning every child made admission slow down linearly
        # with the finished requests whose tails share a prefix (5120 of them: 4x slower).
        self._children: dict[ChunkHash, list[tuple[tuple[int, ...], BlockId]]] = {}
        self.evictions = 0
        self.registrations = 0
        # Free blocks that hold indexed KV, kept as blocks move: counting them walked the whole free queue,
        # and the server reads the pool's stats after every step (O(num_blocks) per step).
        self._cached_free = 0

    # ---------------------------------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks a new request can take (free + cached)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Evictable blocks that still hold indexed KV."""
        return self._cached_free

    def lookup(self, block_hash: ChunkHash) -> Block | None:
        """The full block cached under ``block_hash`` (used or not), or None."""
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def children(self, parent: ChunkHash) -> list[Block]:
        """Indexed blocks (full or partial) whose tokens directly follow ``parent``."""
        return [self.blocks[b] for _, b in self._children.get(parent, ())]

    def longest_child(self, parent: ChunkHash, tokens: Sequence[int]) -> tuple[Block | None, int]:
        """The indexed block after ``parent`` whose tokens share the longest prefix with ``tokens``, and
        that length (``(None, 0)`` when none shares a first token)."""
        children = self._children.get(parent)
        if not children:
            return None, 0
        query = tuple(tokens[: self.block_size])
        at = bisect_left(children, (query,))
        best, best_len = None, 0
        for i in (at - 1, at):
            if 0 <= i < len(children):
                n = common_prefix_len(children[i][0], query)
                if n > best_len:
                    best, best_len = self.blocks[children[i][1]], n
        return best, best_len

    # ---------------------------------------------------------------------------------------- ownership
    def take(self, count: int) -> list[Block]:
        """Take ``count`` blocks out of the free queue (evicting cached ones), each with ``ref_count == 1``.

        Raises:
            NoFreeBlocksError: fewer than ``count`` blocks are free or cached (nothing is taken then).
        """
        if count > len(self._free):
            raise NoFreeBlocksError(f"{count} blocks wanted, {len(self._free)} available")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.indexed:
                self._cached_free -= 1  # out of the free queue already: _drop_index counts nothing
                if self.on_evict is not None:
                    self.on_evict(block)
                self._drop_index(block)
                self.evictions += 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def share(self, block: Block) -> None:
        """Add an owner to ``block`` (a prefix hit); a cached block leaves the free queue."""
        if block.ref_count == 0:
            del self._free[block.id]
            self._cached_free -= block.indexed
        block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one owner from each block, in the given order; unowned blocks join the free queue's tail.

        Callers pass a request's blocks last-first so that chains are evicted tail first. A block that holds
        no cached prefix goes to the head instead: it is taken before any cached one is evicted (at the tail,
        a request's uncached blocks let the cached ones that were freed before them reach the head, and a
        prompt repeated in a loop evicted a cached document one block per repeat with free blocks to spare).
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.id} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.id] = None
                if block.indexed:
                    self._cached_free += 1
                else:
                    self._free.move_to_end(block.id, last=False)

    # ---------------------------------------------------------------------------------------- indexing
    def register_full(
        self, block: Block, *, parent: ChunkHash, block_hash: ChunkHash, token_ids: tuple[int, ...]
    ) -> bool:
        """Index a full block under ``block_hash``. Returns False (block left unindexed) when another block
        already holds that hash: two requests computed the same block concurrently; the first one wins."""
        if block_hash in self._by_hash:
            return False
        if block.indexed:
            self._drop_index(block)
        block.hash, block.parent, block.token_ids = block_hash, parent, token_ids
        self._cached_free += block.id in self._free
        self.registrations += 1
        self._by_hash[block_hash] = block.id
        insort(self._children.setdefault(parent, []), (token_ids, block.id))
        return True

    def register_partial(self, block: Block, *, parent: ChunkHash, token_ids: tuple[int, ...]) -> None:
        """Index a partially filled block as a tail after ``parent`` (its first ``len(token_ids)`` tokens)."""
        if block.indexed:
            self._drop_index(block)
        block.hash, block.parent, block.token_ids = None, parent, token_ids
        self._cached_free += block.id in self._free
        insort(self._children.setdefault(parent, []), (token_ids, block.id))

    def touch(self, block: Block) -> None:
        """Move an unowned cached block to the back of the eviction order (it was just read)."""
        if block.ref_count == 0 and block.id in self._free:
            self._free.move_to_end(block.id)

    def reset(self) -> int:
        """Drop every index entry of unowned blocks (``clear_cache``); owned blocks keep theirs.

        Returns how many blocks were un-indexed."""
        dropped = 0
        for block_id in list(self._free):
            block = self.blocks[block_id]
            if block.indexed:
                self._drop_index(block)
                dropped += 1
        return dropped

    def _drop_index(self, block: Block) -> None:
        assert block.parent is not None
        self._cached_free -= block.id in self._free
        if block.hash is not None and self._by_hash.get(block.hash) == block.id:
            del self._by_hash[block.hash]
        siblings = self._children.get(block.parent)
        if siblings is not None:
            entry = (block.token_ids, block.id)
            at = bisect_left(siblings, entry)
            if at < len(siblings) and siblings[at] == entry:
                del siblings[at]
            if not siblings:
                del self._children[block.parent]
        block.hash, block.parent, block.token_ids = None, None, ()
