"""Find the longest reusable cached prefix of a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvb_cache.chunking import ChunkSpan
from kvb_cache.hashing import ChunkHash, content_hash, prefix_hash
from kvb_cache.store import ChunkEntry, ChunkStore


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkKeys:
    """Hashes of a token sequence's chunks, in order (one pair per span, the tail included)."""

    spans: tuple[ChunkSpan, ...]
    prefix: tuple[ChunkHash, ...]
    content: tuple[ChunkHash, ...]


def chunk_keys(root: ChunkHash, ids: Sequence[int], spans: Sequence[ChunkSpan]) -> ChunkKeys:
    prefixes, contents = [], []
    parent = root
    for span in spans:
        tokens = ids[span.start : span.end]
        parent = prefix_hash(parent, tokens)
        prefixes.append(parent)
        contents.append(content_hash(root, tokens))
    return ChunkKeys(spans=tuple(spans), prefix=tuple(prefixes), content=tuple(contents))


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixMatch:
    """The cached pieces that reproduce the prompt's first ``cached_tokens`` tokens exactly.

    ``pieces`` are ``(entry, n)`` pairs: use the first ``n`` tokens of ``entry``. All but the last use whole
    chunks (prefix-hash hits); the last may be a token-granular match inside a cached chunk.
    """

    pieces: tuple[tuple[ChunkEntry, int], ...]
    cached_tokens: int
    #: Number of complete-chunk prefix-hash hits.
    exact_chunks: int
    #: Tokens reused from inside a chunk (radix-style tail match), 0 if none.
    partial_tokens: int
    #: Chunks after the matched prefix whose tokens are cached after some other history.
    content_hits: int


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_prefix(
    store: ChunkStore, root: ChunkHash, ids: Sequence[int], keys: ChunkKeys, *, max_tokens: int
) -> PrefixMatch:
    """Longest run of prefix-hash hits, then the longest token match among the next cached chunks.

    ``max_tokens`` caps the reuse (the engine passes ``len(ids) - 1`` so one token is always computed and
    yields the next-token logits).
    """
    pieces: list[tuple[ChunkEntry, int]] = []
    parent, covered, exact = root, 0, 0
    # One batched fetch of the chain from lower tiers (one Redis MGET) instead of a round trip per chunk.
    store.prefetch(
        [key for span, key in zip(keys.spans, keys.prefix) if span.complete and span.end <= max_tokens]
    )
    for span, key in zip(keys.spans, keys.prefix):
        if not span.complete or span.end > max_tokens:
            break
        entry = store.get(key)
        if entry is None:
            break
        pieces.append((entry, entry.num_tokens))
        parent, covered, exact = key, span.end, exact + 1
    partial = 0
    rest = ids[covered:max_tokens]
    if rest:
        best, best_len = None, 0
        for child in store.children(parent):
            n = common_prefix_len(child.token_ids, rest)
            if n > best_len:
                best, best_len = child, n
        if best is not None:
            store.touch(best)
            pieces.append((best, best_len))
            covered += best_len
            partial = best_len
    content_hits = 0
    for span, key, content in zip(keys.spans, keys.prefix, keys.content):
        if span.start >= covered and span.complete and key not in store and store.by_content(content):
            content_hits += 1
    return PrefixMatch(
        pieces=tuple(pieces),
        cached_tokens=covered,
        exact_chunks=exact,
        partial_tokens=partial,
        content_hits=content_hits,
    )
