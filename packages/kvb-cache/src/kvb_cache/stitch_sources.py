"""Which earlier requests will bring a prompt's documents into the stitching store.

Chunks enter the stitching store once a request's prompt is computed. A prompt added while an earlier
request with the same documents is still prefilling waits for it (:mod:`kvb_cache.core.deferred`) instead
of computing them a second time: this module names the requests worth waiting for.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvb_cache.core.request import Request
from kvb_cache.hashing import ChunkHash, content_hash
from kvb_cache.lookup import common_prefix_len
from kvb_cache.store import ChunkStore


def _as_bytes(ids: Sequence[int]) -> bytes:
    return array("q", ids).tobytes()


def _occurs(haystack: bytes, needle: bytes) -> bool:
    """Whether token ids ``needle`` occur in ``haystack`` at a token boundary (both 8 bytes per id)."""
    at = haystack.find(needle)
    while at != -1:
        if at % 8 == 0:
            return True
        at = haystack.find(needle, at + 1)
    return False


def stitch_sources(
    store: ChunkStore, root: ChunkHash, req: Request, pending: Iterable[Request], *, wanted: int = 1
) -> tuple[Request, ...]:
    """The ``pending`` requests (earlier ones whose prompts are not computed yet) whose prompts will bring a
    complete chunk of ``req``'s prompt, past the prefix the two share, to ``wanted`` stored copies
    (``StitchConfig.collect_copies``; 1: one copy) where the store holds fewer.

    Chunks inside the shared prefix are left out (``req`` reuses them as an exact prefix hit once computed,
    waiting or not), and so are chunks the store already holds ``wanted`` independent copies of under
    ``root`` (``req``'s salted root). A chunk that the pending requests cannot bring to ``wanted`` copies
    names none of them: ``req`` would compute it anyway (to collect a copy), so waiting would only delay it.
    """
    prompt = req.tokens[: req.prompt_len]
    haystack = _as_bytes(prompt)
    holders: dict[ChunkHash, dict[int, Request]] = {}  # by id(): requests are compared by identity
    stored: dict[ChunkHash, int] = {}
    for other in pending:
        if other.root != req.root:
            continue  # another tenant's chunks are never stitched into this one
        theirs = other.tokens[: other.prompt_len]
        shared = common_prefix_len(theirs, prompt)
        for span in other.spans:
            if not span.complete or span.start < shared:
                continue
            tokens = tuple(theirs[span.start : span.end])
            key = content_hash(root, tokens)
            if key not in stored:
                stored[key] = sum(1 for e in store.by_content(key) if not e.derived and e.token_ids == tokens)
            if stored[key] >= wanted or not _occurs(haystack, _as_bytes(tokens)):
                continue
            holders.setdefault(key, {})[id(other)] = other
    sources: dict[int, Request] = {}
    for key, names in holders.items():
        if stored[key] + len(names) >= wanted:
            sources.update(names)
    return tuple(sources.values())
