"""Which earlier requests will bring a prompt's documents into the stitching store.

Chunks enter the stitching store once a request's prompt is computed. A prompt added while an earlier
request with the same documents is still prefilling waits for it (:mod:`kvb_cache.core.deferred`) instead
of computing them a second time: this module names the requests worth waiting for.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvb_cache.core.outputs import RequestId
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
    store: ChunkStore, root: ChunkHash, req: Request, pending: Iterable[Request]
) -> frozenset[RequestId]:
    """The ``pending`` requests (earlier ones whose prompts are not computed yet) that will store a complete
    chunk ``req``'s prompt holds and the store does not: its documents, past the prefix the two share.

    Chunks inside the shared prefix are left out (``req`` reuses them as an exact prefix hit once computed,
    waiting or not), and so are chunks the store already has under ``root`` (``req``'s salted root).
    """
    prompt = req.tokens[: req.prompt_len]
    haystack = _as_bytes(prompt)
    sources: set[RequestId] = set()
    for other in pending:
        if other.root != req.root:
            continue  # another tenant's chunks are never stitched into this one
        theirs = other.tokens[: other.prompt_len]
        shared = common_prefix_len(theirs, prompt)
        for span in other.spans:
            if not span.complete or span.start < shared:
                continue
            tokens = tuple(theirs[span.start : span.end])
            if store.by_content(content_hash(root, tokens)):
                continue
            if _occurs(haystack, _as_bytes(tokens)):
                sources.add(other.request_id)
                break
    return frozenset(sources)
