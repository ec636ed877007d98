"""Per-request block tables over the pool: prefix hits, allocation, registration of computed blocks.

Full blocks are keyed by the prefix-hash chain ``h_i = prefix_hash(h_{i-1}, tokens of block i)`` rooted in
the model fingerprint (salted per request by ``cache_salt``: :func:`kvb_cache.hashing.salted_root`), so a
cached block *is* a cached chunk: an exact prefix hit maps the request's table onto those blocks (shared,
reference-counted, never written again: only a request's last, private block takes new tokens). After the full-block hits, the next block may match token by token (the radix-style
tail match): its first ``n`` tokens are copied into a fresh private block (copy-on-write of the shared
block). Below the pool, :class:`~kvb_cache.core.block_tiers.BlockTiers` serves misses from disk/Redis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from kvb_cache.core.block_pool import BlockPool, NoFreeBlocksError
from kvb_cache.core.block_tiers import BlockTiers
from kvb_cache.core.kv_storage import KVStorage
from kvb_cache.core.request import PreparedKV, Request
from kvb_cache.hashing import ChunkHash, content_hash, prefix_hash
from kvb_cache.store import ChunkEntry, LayerKV


class PrefixHit(NamedTuple):
    """What an admission reused: ``tokens`` in all, of which ``partial`` came from a tail match and
    ``promoted`` blocks from lower tiers."""

    tokens: int
    full_blocks: int
    partial: int
    promoted: int


class KVCacheManager:
    """Owns the pool's bookkeeping and tensors on behalf of requests (single-threaded: the engine loop)."""

    def __init__(
        self,
        pool: BlockPool,
        storage: KVStorage,
        root: ChunkHash,
        *,
        tiers: BlockTiers | None = None,
        caching: bool = True,
        store_outputs: bool = True,
        store_partial_tail: bool = True,
    ) -> None:
        self.pool = pool
        self.storage = storage
        self.root = root
        self.tiers = tiers
        #: False: no reuse across requests (``max_cache_bytes == 0``): nothing is matched or indexed.
        self.caching = caching
        self.store_outputs = store_outputs
        self.store_partial_tail = store_partial_tail
        self.block_size = pool.block_size
        self.queries = 0
        self.hits = 0

    # ------------------------------------------------------------------------------------ hashing
    def root_of(self, req: Request) -> ChunkHash:
        """The parent of ``req``'s first block: its salted root, else the fingerprint root."""
        return self.root if req.root is None else req.root

    def hashes(self, req: Request, upto: int) -> list[ChunkHash]:
        """Prefix hashes of the full blocks within ``req.tokens[:upto]`` (extends the request's cache)."""
        bs, chain = self.block_size, req.block_hashes
        while (len(chain) + 1) * bs <= upto:
            i = len(chain)
            chain.append(
                prefix_hash(chain[-1] if chain else self.root_of(req), req.tokens[i * bs : (i + 1) * bs])
            )
        return chain[: upto // bs]

    def cached_prefix_len(self, req: Request, max_tokens: int) -> int:
        """Tokens of ``req`` the pool holds as full blocks now (no side effects; the scheduler's ordering)."""
        n = 0
        for h in self.hashes(req, max_tokens):
            if self.pool.lookup(h) is None:
                break
            n += 1
        return n * self.block_size

    def tier_keys(self, req: Request, max_tokens: int) -> list[ChunkHash]:
        """Prefix hashes of ``req``'s full blocks within ``req.tokens[:max_tokens]`` past the run the pool
        holds now: what a lower tier could still serve (none without tiers)."""
        if self.tiers is None or not self.caching:
            return []
        hashes = self.hashes(req, max_tokens)
        held = self.cached_prefix_len(req, max_tokens) // self.block_size
        return hashes[held:]

    # ------------------------------------------------------------------------------------ admission
    def blocks_to_admit(self, req: Request, *, max_tokens: int, upto: int | None = None, cap: int = 0) -> int:
        """Free-queue blocks that admitting ``req`` would take, computed without side effects (at least that
        many when tiers may promote blocks): the cached blocks it would share that sit in the free queue,
        a copy of a cached partial tail, and fresh blocks up to token ``upto`` (None: ``cap`` tokens past
        what the lookup reuses, at most the whole of ``req.tokens``).

        NOTE: the scheduler asks this before :meth:`admit`. Admitting to find out evicted the least recently
        used cached block for the tail copy, and the failed attempt indexed that copy: a request waiting for
        room wore away one cached block per step, exactly when the pool was under pressure.
        """
        bs = self.block_size
        hits, reused = 0, 0
        parent = self.root_of(req)
        if self.caching:
            for h in self.hashes(req, max_tokens):
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits += 1
                reused += block.ref_count == 0  # shared, it leaves the free queue
                parent = h
        covered = hits * bs
        partial = 0
        rest = req.tokens[covered:max_tokens]
        if self.caching and self.store_partial_tail and rest:
            best, best_len = self.pool.longest_child(parent, rest)
            if best is not None:
                partial = min(best_len, bs - 1, len(rest))
        end = upto if upto is not None else min(len(req.tokens), covered + partial + cap)
        return reused + max(-(-end // bs) - hits, 0)

    def admit(
        self,
        req: Request,
        *,
        max_tokens: int,
        count: bool = True,
        queried: int | None = None,
        loaded: Mapping[ChunkHash, LayerKV] | None = None,
    ) -> PrefixHit:
        """Map the longest cached prefix of ``req.tokens[:max_tokens]`` onto ``req.blocks``.

        ``req`` must hold no blocks. Sets ``req.num_computed`` to the reused token count. ``count``: add
        to the prefix-cache query/hit counters (False for the engine's own lookups and stores), ``queried``
        tokens as queried (default ``max_tokens``; an admission counts its whole prompt, as vLLM does).
        ``loaded``: lower-tier KV already read for this request (:mod:`kvb_cache.core.tier_loads`); past the
        pool's run, only those blocks are promoted (no tier is read here). None reads the tiers now.
        """
        assert not req.blocks and req.num_computed == 0
        bs = self.block_size
        if count:
            self.queries += max_tokens if queried is None else queried
        if not self.caching:
            return PrefixHit(tokens=0, full_blocks=0, partial=0, promoted=0)
        hashes = self.hashes(req, max_tokens)
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            self.pool.share(block)
            req.blocks.append(block)
        full = len(req.blocks)
        if self.tiers is not None and full:
            self.tiers.touch(hashes[:full])  # RAM hits keep their tier records recent (queued, rate-limited)
            for i in self.tiers.unwritten(hashes[:full]):  # blocks a tier failed to take: written again
                parent = hashes[i - 1] if i else self.root_of(req)
                tokens = tuple(req.tokens[i * bs : (i + 1) * bs])
                self.tiers.write_behind(
                    self._entry(req.blocks[i].id, parent, hashes[i], tokens, start=i * bs)
                )
        promoted = (
            self._promote(req, hashes[full:], loaded) if self.tiers is not None and full < len(hashes) else 0
        )
        req.registered = len(req.blocks)
        covered = len(req.blocks) * bs
        partial = self._tail_match(req, covered, max_tokens)
        req.num_computed = covered + partial
        if count:
            self.hits += req.num_computed
        return PrefixHit(tokens=req.num_computed, full_blocks=full, partial=partial, promoted=promoted)

    def count_lookup(self, queried: int, hit: int) -> None:
        """Count a prefix lookup made outside :meth:`admit` (a solo request's, which reads the cached prefix
        into its own cache): ``queried`` prompt tokens looked up, ``hit`` of them served from cached blocks."""
        self.queries += queried
        self.hits += hit

    def adopt(
        self, req: Request, prepared: PreparedKV, *, loaded: Mapping[ChunkHash, LayerKV] | None = None
    ) -> PrefixHit | None:
        """Give ``req`` the KV of its first ``prepared.length`` tokens: the exact prefix the pool holds is
        mapped as usual (shared blocks), the rest is written into fresh private blocks. None (nothing held)
        when the pool is short.

        ``req.exact_until`` bounds what :meth:`commit` and :meth:`free` may ever register, so the adopted
        (approximate) KV never becomes reachable by a prefix hash.
        """
        assert req.prepared_kv is prepared
        hit = self.admit(req, max_tokens=req.adoptable_prefix, count=False, loaded=loaded)
        start = req.num_computed
        if not self.allocate(req, prepared.length - start):
            self.free(req)
            return None
        # The whole prompt was looked up, as for any admission (and a solo request): counting only the exact
        # prefix as queried made the stitched server's vLLM-style hit rate ~5x too high (41% for 8.4%).
        # Once, when it is admitted (a retry after a short pool is not a second lookup).
        self.count_lookup(len(req.tokens), hit.tokens)
        slots = self.slots(req, prepared.length)[start:]
        self.storage.write(
            slots,
            [
                (k[:, :, start : prepared.length], v[:, :, start : prepared.length])
                for k, v in prepared.layers
            ],
        )
        req.num_computed = prepared.length
        return hit._replace(tokens=prepared.length)

    def _limit(self, req: Request) -> int:
        """Tokens of ``req`` whose KV may be registered (prompt only unless ``store_outputs``; exact only)."""
        limit = req.num_computed if self.store_outputs else min(req.num_computed, req.prompt_len)
        return limit if req.exact_until is None else min(limit, req.exact_until)

    def _promote(
        self, req: Request, hashes: Sequence[ChunkHash], loaded: Mapping[ChunkHash, LayerKV] | None
    ) -> int:
        assert self.tiers is not None
        if loaded is None:
            run = self.tiers.fetch(hashes)
        else:
            run = []
            for h in hashes:
                kv = loaded.get(h)
                if kv is None:
                    break
                run.append(kv)
        promoted = 0
        for h, kv in zip(hashes, run):
            try:
                (block,) = self.pool.take(1)
            except NoFreeBlocksError:
                break
            i = len(req.blocks)
            self.storage.write(self._block_slots(block.id, self.block_size), kv)
            parent = req.block_hashes[i - 1] if i else self.root_of(req)
            self.pool.register_full(
                block,
                parent=parent,
                block_hash=h,
                token_ids=tuple(req.tokens[i * self.block_size : (i + 1) * self.block_size]),
            )
            req.blocks.append(block)
            promoted += 1
        return promoted

    def _tail_match(self, req: Request, covered: int, max_tokens: int) -> int:
        rest = req.tokens[covered:max_tokens]
        if not rest or not self.store_partial_tail:
            return 0
        parent = req.block_hashes[len(req.blocks) - 1] if req.blocks else self.root_of(req)
        best, best_len = self.pool.longest_child(parent, rest)
        if best is None:
            return 0
        best_len = min(best_len, self.block_size - 1, len(rest))
        # Hold the source while taking the destination, so taking cannot evict it.
        self.pool.share(best)
        try:
            (block,) = self.pool.take(1)
        except NoFreeBlocksError:
            return 0
        finally:
            self.pool.release([best])
        self.pool.touch(best)
        self.storage.copy_tokens(best.id, block.id, best_len)
        req.blocks.append(block)
        return best_len

    # ------------------------------------------------------------------------------------ growth
    def allocate(self, req: Request, new_tokens: int) -> bool:
        """Give ``req`` blocks for ``new_tokens`` more tokens; False (nothing taken) when the pool is short."""
        need = -(-(req.num_computed + new_tokens) // self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        try:
            req.blocks.extend(self.pool.take(need))
        except NoFreeBlocksError:
            return False
        return True

    def room(self, req: Request) -> int:
        """How many more tokens ``req`` can grow by: its blocks' free slots and every free block's."""
        return (len(req.blocks) + self.pool.num_free) * self.block_size - req.num_computed

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the whole pool holds (``num_blocks * block_size``)."""
        return self.pool.num_blocks * self.block_size

    def can_fit(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` tokens can ever fit in the pool."""
        return tokens <= self.capacity_tokens

    def commit(self, req: Request) -> None:
        """Index the full blocks ``req`` has computed so far (call after each forward)."""
        if not self.caching:
            return
        hashes = self.hashes(req, self._limit(req))
        bs = self.block_size
        for i in range(req.registered, len(hashes)):
            block = req.blocks[i]
            parent = hashes[i - 1] if i else self.root_of(req)
            tokens = tuple(req.tokens[i * bs : (i + 1) * bs])
            if (
                self.pool.register_full(block, parent=parent, block_hash=hashes[i], token_ids=tokens)
                and self.tiers
            ):
                self.tiers.write_behind(self._entry(block.id, parent, hashes[i], tokens, start=i * bs))
        req.registered = max(req.registered, len(hashes))

    def trim(self, req: Request) -> None:
        """Give back the blocks past ``req``'s computed tokens (taken for drafts that were rejected): they
        hold no committed token, so they were never registered; the next step takes a block again if its
        token needs one."""
        keep = max(-(-req.num_computed // self.block_size), req.registered)
        if len(req.blocks) > keep:
            extra, req.blocks = req.blocks[keep:], req.blocks[:keep]
            self.pool.release(reversed(extra))
            if req.slot_table is not None:  # its prefix stays valid: no rebuild of the whole table next step
                ids, table = req.slot_table
                req.slot_table = (ids[:keep], table[: keep * self.block_size])

    def free(self, req: Request) -> None:
        """Release ``req``'s blocks (full ones stay cached; the partial last block is indexed as a tail)."""
        if not req.blocks:
            return
        bs = self.block_size
        if not self.caching:
            self.pool.release(reversed(req.blocks))
            req.blocks, req.registered, req.num_computed = [], 0, 0
            return
        limit = self._limit(req)
        last = limit // bs
        tail = limit - last * bs
        if self.store_partial_tail and tail and last < len(req.blocks) and last == req.registered:
            block = req.blocks[last]
            if block.ref_count == 1 and not block.indexed:
                parent = req.block_hashes[last - 1] if last else self.root_of(req)
                tokens = tuple(req.tokens[last * bs : limit])
                # A block after the same parent already holding these tokens (the same prompt asked again)
                # serves them: one more copy would only push other cached prefixes out of the pool.
                if self.pool.longest_child(parent, tokens)[1] < len(tokens):
                    self.pool.register_partial(block, parent=parent, token_ids=tokens)
        if self.tiers is not None and req.registered:
            # The chain was written head first, so its head was its oldest record and evicted first,
            # leaving the rest unreachable; bumped now from its end, the head is the most recent.
            self.tiers.touch(req.block_hashes[: req.registered], force=True)
        self.pool.release(reversed(req.blocks))
        req.blocks = []
        req.registered = 0
        req.num_computed = 0

    # ------------------------------------------------------------------------------------ helpers
    def slots(self, req: Request, length: int) -> torch.Tensor:
        """``[length]`` pool slots of ``req``'s first ``length`` tokens.

        Every scheduled request needs its whole slot table each step; building it from the block list each
        time (a handful of small tensor ops and a host-to-device copy per request) was ~20% of a 32-row
        decode step on a small model. The table is kept on the request and only extended by the blocks it
        gained since; a block list that changed otherwise (preempted, blocks replaced) rebuilds it.
        """
        ids = [b.id for b in req.blocks]
        cached = req.slot_table
        if cached is None or ids[: len(cached[0])] != cached[0]:
            cached = (ids, self.storage.slots(ids, len(ids) * self.block_size))
        elif len(ids) > len(cached[0]):
            grown = self.storage.slots(ids[len(cached[0]) :], (len(ids) - len(cached[0])) * self.block_size)
            cached = (ids, torch.cat([cached[1], grown]))
        req.slot_table = cached
        return cached[1][:length]

    def _block_slots(self, block_id: int, count: int) -> torch.Tensor:
        start = block_id * self.block_size
        return torch.arange(start, start + count, device=self.storage.keys[0].device)

    def _entry(
        self, block_id: int, parent: ChunkHash, key: ChunkHash, tokens: tuple[int, ...], *, start: int
    ) -> ChunkEntry:
        """A full block as a tier record (its KV copied now: the block may be reused before the write)."""
        kv = tuple(self.storage.read(self._block_slots(block_id, self.block_size)))  # gathered: a copy
        # NOTE: the content hash stays rooted in the fingerprint even for salted chains: records verify it
        # against the fingerprint root, and lower tiers are looked up by key only (the salted chain), never
        # by content, so it cannot make one tenant's block reachable from another's.
        return ChunkEntry(
            key=key,
            parent=parent,
            content=content_hash(self.root, tokens),
            token_ids=tokens,
            kv=kv,
            start=start,
        )

    def clear(self) -> int:
        """Un-index every cached (unowned) block; returns how many were dropped."""
        return self.pool.reset()
