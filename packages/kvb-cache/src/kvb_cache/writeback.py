"""Store the chunks of a finished forward, sliced out of the cache it filled."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import Cache

from kvb_cache.chunking import Chunker
from kvb_cache.hashing import ChunkHash, approximate_root
from kvb_cache.kv import slice_kv
from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.lookup import chunk_keys
from kvb_cache.store import ChunkEntry, ChunkStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class WritebackResult:
    #: Complete chunks covering the sequence that are now stored (new or already present).
    stored_chunks: int
    new_chunks: int
    partial_tail: bool


_NOTHING = WritebackResult(stored_chunks=0, new_chunks=0, partial_tail=False)


def _trusted(cache: Cache, num_layers: int, length: int) -> bool:
    """Whether ``cache`` has every layer, all of one length, holding at least ``length`` positions."""
    own = own_kv_layers(cache)
    lengths = {layer.get_seq_length() if layer.is_initialized else 0 for layer in own}
    if len(own) != num_layers or len(lengths) != 1 or lengths.pop() < length:
        logger.warning("cache layers have inconsistent lengths; not storing this request's chunks")
        return False
    return True


def write_back(
    store: ChunkStore,
    chunker: Chunker,
    root: ChunkHash,
    ids: Sequence[int],
    cache: Cache,
    *,
    num_layers: int,
    row: int = 0,
    offset: int = 0,
    store_partial_tail: bool = True,
) -> WritebackResult:
    """Store every chunk of ``ids`` not yet cached, using the KV already in ``cache``.

    Args:
        ids: the token sequence whose KV occupies ``cache`` positions ``[offset, offset + len(ids))`` of
            batch row ``row`` (offset > 0 when the row is left-padded).

    Nothing is recomputed: KV is copied out of the cache the request's own forward filled. A cache whose
    layers disagree on length or that lacks layers (a forward that failed midway) is not trusted and nothing is
    stored.
    """
    if not _trusted(cache, num_layers, offset + len(ids)):
        return _NOTHING
    spans = chunker.split(ids)
    keys = chunk_keys(root, ids, spans)
    stored = new = 0
    partial = False
    parent = root
    for span, key, content in zip(keys.spans, keys.prefix, keys.content):
        if not span.complete and not store_partial_tail:
            break
        if key not in store:
            entry = ChunkEntry(
                key=key,
                parent=parent,
                content=content,
                token_ids=tuple(ids[span.start : span.end]),
                kv=slice_kv(cache, offset + span.start, offset + span.end, row=row),
                start=span.start,
                complete=span.complete,
            )
            if not store.put(entry, root=root):
                break
            new += span.complete
            partial = not span.complete
        stored += span.complete
        parent = key
    return WritebackResult(stored_chunks=stored, new_chunks=new, partial_tail=partial)


def write_back_approximate(
    store: ChunkStore,
    chunker: Chunker,
    root: ChunkHash,
    ids: Sequence[int],
    cache: Cache,
    *,
    start: int,
    num_layers: int,
    store_partial_tail: bool = True,
    copied: Sequence[tuple[int, int]] = (),
    derived_too: bool = True,
) -> WritebackResult:
    """Store the chunks of ``ids`` that reach past ``start`` (a stitched request's first stitched position)
    as approximate entries: keys on the approximate chain of ``root`` (never a prefix hash a lookup can
    match), content hashes rooted in ``root`` (so stitching finds them), ``exact=False``.

    A stitched request's KV from ``start`` on was computed over re-positioned chunks, so it may not serve an
    exact prefix hit; but a document first seen there is still worth reusing the way every stitched chunk
    is, approximately, with its seam repaired. ``cache`` holds positions ``[0, len(ids))``.

    ``copied``: the request's ranges whose KV was copied from stored chunks (stitched, not recomputed); a
    chunk overlapping one is stored ``derived`` (not an independent copy of its tokens), or skipped when
    ``derived_too`` is False (then only chunks the request computed itself are kept).
    """
    if not _trusted(cache, num_layers, len(ids)):
        return _NOTHING
    spans = chunker.split(ids)
    content = chunk_keys(root, ids, spans).content
    approximate = chunk_keys(approximate_root(root), ids, spans).prefix
    stored = new = 0
    partial = False
    anchor: ChunkHash | None = None  # the parent of the first chunk stored: the run's root in the store
    for i, span in enumerate(spans):
        if span.end <= start:
            continue
        if not span.complete and not store_partial_tail:
            break
        derived = any(a < span.end and span.start < b for a, b in copied)
        if derived and not derived_too:
            anchor = None  # the next chunk kept roots a new run (its parent is not stored)
            continue
        parent = approximate[i - 1] if i else approximate_root(root)
        anchor = parent if anchor is None else anchor
        if approximate[i] not in store:
            entry = ChunkEntry(
                key=approximate[i],
                parent=parent,
                content=content[i],
                token_ids=tuple(ids[span.start : span.end]),
                kv=slice_kv(cache, span.start, span.end),
                start=span.start,
                complete=span.complete,
                exact=False,
                derived=derived,
            )
            # The first chunk's parent (on the approximate chain, before ``start``) is never stored: it roots
            # the run; each later chunk's parent is the chunk before it.
            if not store.put(entry, root=anchor):
                break
            new += span.complete
            partial = not span.complete
        stored += span.complete
    return WritebackResult(stored_chunks=stored, new_chunks=new, partial_tail=partial)
