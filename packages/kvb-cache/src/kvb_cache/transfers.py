"""Private ``transformers`` caches to and from the pool: solo requests' prefixes, stores, stitching.

Mixed into :class:`~kvb_cache.engine.KVBoost`. Solo requests (speculative, per-request quantized KV) run
on a ``DynamicCache`` assembled from the pool's exact prefix, and write their exact KV back; a stitched
prompt is planned here too (:meth:`CacheTransfers._plan_stitch`); its repair then runs in slices across
steps and the result is handed to its loop request (:mod:`kvb_cache.core.preparing`). Stitching engines
also keep finished requests' chunks in a content-indexed ``ChunkStore``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from transformers import Cache, DynamicCache

from kvb_cache import generation
from kvb_cache.core.tier_loads import loaded_records
from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.live_quant import is_live_quantized, quantize_live
from kvb_cache.pool_io import dense_cache, probe_request
from kvb_cache.prepared import PreparedPrompt
from kvb_cache.serialized import serialized
from kvb_cache.writeback import WritebackResult, write_back, write_back_approximate

if TYPE_CHECKING:
    from kvb_cache.chunking import Chunker
    from kvb_cache.config import EngineConfig
    from kvb_cache.core.kv_manager import KVCacheManager
    from kvb_cache.core.request import Request
    from kvb_cache.hashing import ChunkHash
    from kvb_cache.model_traits import ModelTraits
    from kvb_cache.stitch_job import StitchJob
    from kvb_cache.stitching import Stitcher
    from kvb_cache.store import ChunkStore, LayerKV


class CacheTransfers:
    kv: KVCacheManager
    chunker: Chunker
    config: EngineConfig
    traits: ModelTraits
    stitcher: Stitcher
    store: ChunkStore
    root: bytes

    def _storable(self, req: Request) -> list[int]:
        """The tokens of a finished request whose KV may be stored: its prompt, plus its output with
        ``store_outputs`` (the last token was never fed)."""
        return req.tokens[:-1] if self.config.store_outputs else req.tokens[: req.prompt_len]

    def _store_chunks(self, req: Request) -> None:
        """Stitching engines: also keep the finished request's chunks in the content-indexed store."""
        ids = self._storable(req)
        if req.exact_until is not None:
            ids = ids[: req.exact_until]  # a stitched request: only its exact part (the store rule)
        self._write_back_pooled(req, ids, whole=True)

    def _store_prompt_chunks(self, req: Request) -> None:
        """Stitching engines: keep a request's complete prompt chunks as soon as its prompt is computed, so a
        request added while it still decodes can stitch them (not only requests after it finishes).

        Only the chunks inside the blocks committed so far (the prompt's full blocks) and no partial tail:
        the rest is stored when the request finishes (:meth:`_store_chunks`), where already stored chunks
        are skipped.
        """
        if self.stitcher.config is None or not self.kv.caching:
            return
        ids = req.tokens[: req.prompt_len]
        if req.exact_until is not None:
            ids = ids[: req.exact_until]
        self._write_back_pooled(req, ids, whole=False)

    def _write_back_pooled(self, req: Request, ids: list[int], *, whole: bool) -> None:
        """Copy the chunks of ``ids`` (a prefix of ``req``'s tokens) from the pool into the stitching store.

        ``whole``: store only if the pool holds all of ``ids`` (a finished request; partial tail included),
        else the block-aligned part it holds, complete chunks only.
        """
        probe = probe_request(ids, root=req.root)
        hit = self.kv.admit(probe, max_tokens=len(ids), count=False)
        try:
            if hit.tokens and (hit.tokens == len(ids) or not whole):
                slots = self.kv.slots(probe, hit.tokens)
                write_back(
                    self.store,
                    self.chunker,
                    self.kv.root_of(probe),
                    ids[: hit.tokens],
                    dense_cache(self.kv.storage.read(slots)),
                    num_layers=self.traits.kv_layers,
                    store_partial_tail=self.config.store_partial_tail and whole,
                )
        finally:
            self.kv.free(probe)

    def _store_approximate(self, req: Request) -> None:
        """With ``StitchConfig.keep_approximate``: keep a finished stitched request's KV from its first
        stitched position on as approximate chunks (content lookups only; see
        :func:`kvb_cache.writeback.write_back_approximate`), read from its private blocks before they are
        freed, so a document first seen after a stitched one is reused by later stitches. With
        ``collect_copies`` > 1 alone, only the chunks it computed itself (a document it recomputed to
        collect another copy, a miss), not the ones holding copied KV."""
        stitching = self.stitcher.config
        if (
            stitching is None
            or not (stitching.keep_approximate or stitching.collect_copies > 1)
            or req.exact_until is None
            or not self.kv.caching
        ):
            return
        ids = self._storable(req)[: req.num_computed]
        if len(ids) <= req.exact_until:
            return
        write_back_approximate(
            self.store,
            self.chunker,
            self.kv.root_of(req),
            ids,
            dense_cache(self.kv.storage.read(self.kv.slots(req, len(ids)))),
            start=req.exact_until,
            num_layers=self.traits.kv_layers,
            store_partial_tail=self.config.store_partial_tail,
            copied=req.copied,
            derived_too=stitching.keep_approximate,
        )

    def _prepare(
        self,
        ids: list[int],
        *,
        max_reuse: int,
        stitch: bool = False,
        root: ChunkHash | None = None,
        loaded: Mapping[ChunkHash, LayerKV] | None = None,
    ) -> PreparedPrompt:
        """The cached prefix of ``ids`` as a private ``DynamicCache`` (solo requests); ``stitch`` also reuses
        non-prefix chunks (when ``config.stitching`` is set). ``root``: the request's salted chain root.
        ``loaded``: tier records already read for this prompt (none is read here); None reads the tiers."""
        spans = tuple(self.chunker.split(ids))
        probe = probe_request(ids, root=root)
        hit = self.kv.admit(probe, max_tokens=max_reuse, count=False, loaded=loaded)
        try:
            kv = self.kv.storage.read(self.kv.slots(probe, hit.tokens)) if hit.tokens else None
        finally:
            self.kv.free(probe)
        cache = dense_cache(kv) if kv is not None else DynamicCache()
        prepared = PreparedPrompt(
            ids=ids,
            spans=spans,
            cache=cache,
            cached_tokens=hit.tokens,
            chunks=generation.chunk_hits(spans, hit.tokens),
            root=root,
        )
        if stitch:
            self.stitcher.extend(prepared, max_reuse=max_reuse)
        return prepared

    def _plan_stitch(self, req: Request) -> StitchJob | None:
        """The stitch of loop request ``req``'s prompt, planned (exact prefix read, pieces found and
        re-positioned) with its repair still to run; None when no piece hits (a plain request)."""
        ids = req.tokens[: req.prompt_len]
        # What its lookup read, else nothing: planning never waits on a tier (KVBoost._queue_stitched).
        loaded, req.tier_load = loaded_records(self.kv.tiers, req.tier_load), None
        prepared = self._prepare(ids, max_reuse=len(ids) - 1, root=req.root, loaded=loaded)
        return self.stitcher.plan(prepared, max_reuse=len(ids) - 1)

    def _apply_kv_bits(self, prepared: PreparedPrompt, bits: int | None) -> None:
        """Swap the prepared cache for a live-quantized one when ``kv_cache_bits`` asks for 8/4 bits."""
        if bits is not None:
            prepared.cache = quantize_live(prepared.cache, num_layers=self.traits.kv_layers, bits=bits)

    @serialized
    def store_sequence(
        self, ids: Sequence[int], cache: Cache, *, root: ChunkHash | None = None
    ) -> WritebackResult:
        """Cache the KV of ``ids`` held in ``cache`` positions ``[0, len(ids))`` (batch row 0) in the pool,
        under chain ``root`` (a request's salted root; None: the engine's unsalted root).

        A live-quantized cache (``kv_cache_bits`` 8/4) is never stored: its KV is approximate, so under the
        engine's prefix keys it would turn later exact hits into approximate ones.
        """
        ids = list(ids)
        if is_live_quantized(cache) or not ids or not self.kv.caching:
            return WritebackResult(stored_chunks=0, new_chunks=0, partial_tail=False)
        own = own_kv_layers(cache)
        length = {layer.get_seq_length() for layer in own}
        if len(own) != self.traits.kv_layers or len(length) != 1 or length.pop() < len(ids):
            return WritebackResult(stored_chunks=0, new_chunks=0, partial_tail=False)
        probe = probe_request(ids, root=root)
        hit = self.kv.admit(probe, max_tokens=len(ids), count=False)
        try:
            if hit.tokens < len(ids) and self.kv.allocate(probe, len(ids) - hit.tokens):
                layers = [
                    (layer.keys[:1, :, hit.tokens : len(ids)], layer.values[:1, :, hit.tokens : len(ids)])
                    for layer in own
                ]
                self.kv.storage.write(self.kv.slots(probe, len(ids))[hit.tokens :], layers)
                probe.num_computed = len(ids)
                self.kv.commit(probe)
        finally:
            self.kv.free(probe)
        if self.config.stitching is not None:
            write_back(
                self.store,
                self.chunker,
                self.kv.root_of(probe),
                ids,
                cache,
                num_layers=self.traits.kv_layers,
                store_partial_tail=self.config.store_partial_tail,
            )
        complete = sum(span.complete for span in self.chunker.split(ids))
        done = sum(span.complete and span.end <= hit.tokens for span in self.chunker.split(ids))
        return WritebackResult(
            stored_chunks=complete,
            new_chunks=complete - done,
            partial_tail=bool(ids) and not self.chunker.split(ids)[-1].complete,
        )
