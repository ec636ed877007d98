"""Which earlier requests will bring a prompt's documents into the stitching store.

Chunks enter the stitching store once a request's prompt is computed. A prompt added while an earlier
request with the same documents is still prefilling waits for it (:mod:`kvb_cache.core.deferred`) instead
of computing them a second time: this module names the requests worth waiting for.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvb_cache.core.request import Request
from kvb_cache.hashing import ChunkHash, content_hash
from kvb_cache.store import ChunkStore


class Piece(NamedTuple):
    """A complete chunk of a pending prompt, as :func:`stitch_sources` compares it."""

    start: int
    tokens: tuple[int, ...]
    #: ``tokens`` as 8-byte ids (:func:`_as_bytes`): searched for in, and compared with, a new prompt.
    raw: bytes
    key: ChunkHash  # content hash under the root


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


def prompt_pieces(req: Request, root: ChunkHash) -> tuple[Piece, ...]:
    """``req``'s complete prompt chunks with their content hashes under ``root``, computed once per request:
    a burst of W stitched arrivals read every pending prompt's W times (hashing them each time made adding
    825 RAG prompts take 16 s)."""
    memo = req.stitch_pieces
    if memo is not None and memo[0] == root:
        return memo[1]
    prompt = req.tokens[: req.prompt_len]
    pieces = []
    for span in req.spans:
        if span.complete:
            tokens = tuple(prompt[span.start : span.end])
            pieces.append(Piece(span.start, tokens, _as_bytes(tokens), content_hash(root, tokens)))
    req.stitch_pieces = (root, tuple(pieces))
    return req.stitch_pieces[1]


def _after_shared_prefix(pieces: tuple[Piece, ...], haystack: bytes) -> tuple[Piece, ...]:
    """The pieces starting at or after the prefix their prompt shares with ``haystack`` (a prompt as bytes).

    Pieces tile their prompt from token 0, so the shared prefix ends inside the first piece that differs: it
    is left out when its first token still matches (it starts inside the shared prefix), kept otherwise.
    """
    for i, piece in enumerate(pieces):
        at = 8 * piece.start
        if haystack[at : at + len(piece.raw)] != piece.raw:
            inside = haystack[at : at + 8] == piece.raw[:8]
            return pieces[i + 1 :] if inside else pieces[i:]
    return ()


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

    Cost: each pending prompt's chunks are hashed once (:func:`prompt_pieces`) and each distinct chunk is
    looked up and searched for once per call, so a call is a few dictionary probes per pending chunk.
    """
    haystack = _as_bytes(req.tokens[: req.prompt_len])
    holders: dict[ChunkHash, dict[int, Request]] = {}  # by id(): requests are compared by identity
    stored: dict[ChunkHash, int] = {}
    useful: dict[ChunkHash, bool] = {}  # fewer than ``wanted`` copies stored, and in ``req``'s prompt
    for other in pending:
        if other.root != req.root:
            continue  # another tenant's chunks are never stitched into this one
        for piece in _after_shared_prefix(prompt_pieces(other, root), haystack):
            key = piece.key
            if key not in useful:
                held = store.by_content(key)
                stored[key] = sum(1 for e in held if not e.derived and e.token_ids == piece.tokens)
                useful[key] = stored[key] < wanted and _occurs(haystack, piece.raw)
            if useful[key]:
                holders.setdefault(key, {})[id(other)] = other
    sources: dict[int, Request] = {}
    for key, names in holders.items():
        if stored[key] + len(names) >= wanted:
            sources.update(names)
    return tuple(sources.values())
