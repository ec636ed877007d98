"""Content lookup of stitched reuse: which stored chunks hold the prompt's tokens, and where the seams are.

:func:`find_pieces` picks, position by position, one stored copy per piece (the one that keeps a document on
one chain of neighbours); :func:`chained_runs` cuts the pieces into runs at the true seams;
:func:`copy_pieces` finds the *other* stored copies of each run's tokens, which :mod:`kvb_cache.stitching`
averages with the chosen one (``StitchConfig.average_copies``); :func:`own_chain` finds the chunks kept
from this very prompt, and :func:`keep_held_runs` drops the runs to compute instead (``collect_copies``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvb_cache.chunking import ChunkSpan
from kvb_cache.hashing import ChunkHash, content_hash
from kvb_cache.store import ChunkEntry, ChunkStore


@dataclass(frozen=True, slots=True, kw_only=True)
class StitchedPiece:
    """Prompt tokens ``[start, end)`` served by ``entry`` (computed at ``entry.start`` after another history)."""

    start: int
    end: int
    entry: ChunkEntry


class ContentLookup:
    """Content-hash lookups of one scan, memoised per position (a chain is followed from several starts)."""

    def __init__(
        self, store: ChunkStore, root: ChunkHash, ids: Sequence[int], stop: int, lengths: Sequence[int]
    ) -> None:
        self.store, self.root, self.ids, self.stop, self.lengths = store, root, ids, stop, lengths
        self._at: dict[int, list[ChunkEntry]] = {}
        self._children: dict[int, dict[ChunkHash, ChunkEntry]] = {}
        self._reach: dict[tuple[int, ChunkHash], int] = {}

    def at(self, i: int) -> list[ChunkEntry]:
        """Entries holding exactly ``ids[i : i + length]`` for one of ``lengths`` (longest first)."""
        found = self._at.get(i)
        if found is None:
            found = []
            for length in self.lengths:
                if i + length > self.stop:
                    continue
                tokens = tuple(self.ids[i : i + length])
                found.extend(
                    e for e in self.store.by_content(content_hash(self.root, tokens)) if e.token_ids == tokens
                )
            self._at[i] = found
        return found

    def child(self, entry: ChunkEntry, i: int) -> ChunkEntry | None:
        """The entry at ``i`` computed right after ``entry`` (its ``parent`` is ``entry.key``), if any."""
        children = self._children.get(i)
        if children is None:
            children = {}
            for candidate in self.at(i):
                children.setdefault(candidate.parent, candidate)
            self._children[i] = children
        return children.get(entry.key)

    def reach(self, entry: ChunkEntry, i: int) -> int:
        """Exclusive end of the run that starts with ``entry`` at ``i`` and follows parent links."""
        end = i + entry.num_tokens
        trail = [(i, entry.key)]
        while end < self.stop:
            known = self._reach.get((end, entry.key))
            if known is not None:
                end = known
                break
            nxt = self.child(entry, end)
            if nxt is None:
                break
            trail.append((end, nxt.key))
            entry, end = nxt, end + nxt.num_tokens
        for position, key in trail:
            self._reach[(position, key)] = end
        return end


def find_pieces(
    store: ChunkStore,
    root: ChunkHash,
    ids: Sequence[int],
    *,
    start: int,
    stop: int,
    lengths: Sequence[int],
    lookup: ContentLookup | None = None,
) -> list[StitchedPiece]:
    """Greedy left-to-right scan of ``ids[start:stop]`` for runs that a stored chunk holds.

    At each position the chunk lengths the chunker can produce (``lengths``) are tried; a hit jumps past
    the piece, a miss advances one token. ``O((stop - start) * len(lengths))`` hashes.

    The same tokens are often stored several times, computed after different histories (a document seen in
    several prompts). Which copy serves a position decides where the seams are, so the choice is: the copy
    computed right after the previous piece's chunk (no seam there), else the copy that starts the longest
    chain of such neighbours (fewest seams ahead), then the longest chunk. Taking whichever copy the store
    lists first could switch copies inside a document and cut it with seams that each need repair.
    ``lookup``: a :class:`ContentLookup` over the same arguments to share with :func:`copy_pieces`.
    """
    if lookup is None:
        lookup = ContentLookup(store, root, ids, stop, lengths)
    pieces: list[StitchedPiece] = []
    i = start
    while i < stop:
        matches = lookup.at(i)
        if not matches:
            i += 1
            continue
        prev = pieces[-1].entry if pieces and pieces[-1].end == i else None
        hit = lookup.child(prev, i) if prev is not None else None
        if hit is None:
            # Fewest seams ahead first, then KV computed over an exact history; max() keeps the first of
            # equals: the longest chunk, as at() lists them.
            hit = (
                max(matches, key=lambda e: (lookup.reach(e, i), e.exact)) if len(matches) > 1 else matches[0]
            )
        store.touch(hit)
        pieces.append(StitchedPiece(start=i, end=i + hit.num_tokens, entry=hit))
        i += hit.num_tokens
    return pieces


def chained_runs(pieces: Sequence[StitchedPiece]) -> list[tuple[int, int]]:
    """``(start, end)`` of each maximal run of pieces that were also neighbours where they were computed.

    A piece whose entry's ``parent`` is the previous piece's ``key`` (and that starts where it ends) was
    computed right after that chunk's tokens: its KV already saw that neighbour, so the boundary between
    them is no seam. Only the first piece of a run lost its context (a true seam, which repair targets);
    a document stitched as ten chunks has one seam, not ten.
    """
    runs: list[tuple[int, int]] = []
    prev: StitchedPiece | None = None
    for piece in pieces:
        chained = prev is not None and prev.end == piece.start and piece.entry.parent == prev.entry.key
        if chained:
            runs[-1] = (runs[-1][0], piece.end)
        else:
            runs.append((piece.start, piece.end))
        prev = piece
    return runs


def copy_pieces(
    lookup: ContentLookup,
    pieces: Sequence[StitchedPiece],
    *,
    max_copies: int,
    slack: int,
    runs: Sequence[tuple[int, int]] | None = None,
) -> list[list[list[StitchedPiece]]]:
    """Per run of ``pieces`` (:func:`chained_runs`), the other stored copies of its tokens, as chains.

    A document seen in several prompts is stored once per history it followed, and each copy's KV carries
    its own foreign history. Averaging the copies cancels part of what is particular to each history (the
    pydoc prompts of docs/fidelity.md: with two copies, the mean's teacher-forced KL against no-cache is about
    half of either copy's), so every run's other copies are found here: each position of the run is probed
    (one content hash per chunk length), the entries that hold the prompt's tokens there and are not the
    run's own pieces are linked into chains by their parent links (as :func:`chained_runs` does), and a
    chain is kept when it starts no more than ``slack`` positions after the run does. Such a chain saw the
    prompt's own tokens as far back as the run's copy, up to chunk alignment, and differs from it only in
    the history before them. A chain that starts later lost context the run's copy kept (the run's copy was
    computed after the same neighbouring document as here, the other copy after another one) and would pull
    the mean away from it. The chains starting first (then the longest) are kept, at most
    ``max_copies - 1`` per run.

    ``runs``: ``chained_runs(pieces)`` when the caller has it already.

    Returns:
        One list per run of ``pieces``: the kept chains, each a list of pieces (full entries; they may reach
        past the run, the caller clips them to it).
    """
    if runs is None:
        runs = chained_runs(pieces)
    own = {p.entry.key for p in pieces}
    found: list[list[list[StitchedPiece]]] = []
    for run_start, run_end in runs:
        chains: list[list[StitchedPiece]] = []
        open_ends: dict[tuple[int, ChunkHash], list[StitchedPiece]] = {}
        if max_copies > 1:
            for i in range(run_start, run_end):
                for entry in lookup.at(i):
                    if entry.key in own or entry.derived:
                        continue
                    piece = StitchedPiece(start=i, end=i + entry.num_tokens, entry=entry)
                    chain = open_ends.pop((i, entry.parent), None)
                    if chain is None:
                        if i > run_start + slack:
                            continue  # this copy's context starts later than the run's: not averaged
                        chain = []
                        chains.append(chain)
                    chain.append(piece)
                    open_ends[(piece.end, entry.key)] = chain
        chains.sort(key=lambda c: (c[0].start, -(c[-1].end - c[0].start)))
        kept = chains[: max_copies - 1]
        for chain in kept:
            for piece in chain:
                lookup.store.touch(piece.entry)
        found.append(kept)
    return found


def own_chain(
    store: ChunkStore,
    ids: Sequence[int],
    spans: Sequence[ChunkSpan],
    keys: Sequence[ChunkHash],
    *,
    start: int,
    stop: int,
) -> list[StitchedPiece]:
    """The stored chunks that continue this very prompt after its exact prefix: its approximate-chain prefix
    ``keys`` (one per span), from the first span starting at or after ``start`` for as long as each is
    stored (the same stitched prompt asked again, with ``keep_approximate`` or ``collect_copies``). They are
    served as they were computed, so a repeated prompt gets the KV it had."""
    chain: list[StitchedPiece] = []
    for span, key in zip(spans, keys):
        if span.start < start:
            continue
        entry = store.get(key) if span.end <= stop else None
        if entry is None or entry.token_ids != tuple(ids[span.start : span.end]):
            break
        chain.append(StitchedPiece(start=span.start, end=span.end, entry=entry))
    return chain


def keep_held_runs(
    pieces: Sequence[StitchedPiece],
    runs: Sequence[tuple[int, int]],
    copies: Sequence[list[list[StitchedPiece]]],
    own: Sequence[bool],
    wanted: int,
) -> tuple[list[StitchedPiece], list[tuple[int, int]], list[list[list[StitchedPiece]]], int]:
    """Drop the runs held by fewer than ``wanted`` independent copies (``collect_copies``): the request
    computes them in its own context instead, and its finished KV is kept as one more copy. A run whose copy
    saw this prompt's own history (``own``) is always kept.

    Returns:
        The kept pieces, runs and copies, and how many stitched tokens were dropped.
    """
    kept_pieces: list[StitchedPiece] = []
    kept_runs: list[tuple[int, int]] = []
    kept_copies: list[list[list[StitchedPiece]]] = []
    dropped = 0
    i = 0
    for (start, end), chains, same in zip(runs, copies, own):
        first = i
        while i < len(pieces) and pieces[i].start < end:
            i += 1
        if same or 1 + len(chains) >= wanted:
            kept_pieces.extend(pieces[first:i])
            kept_runs.append((start, end))
            kept_copies.append(chains)
        else:
            dropped += end - start
    return kept_pieces, kept_runs, kept_copies, dropped
