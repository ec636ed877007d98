"""Non-prefix reuse: find cached chunks anywhere in the prompt, re-position them, repair the seams.

After the exact prefix (prefix-hash hits and the token-granular tail), the rest of the prompt is scanned for
runs of tokens that some stored chunk holds (content hash, at *any* offset: a document moved by a few tokens
still hits). Each such run is a *stitched piece*: its cached KV is rotated from the position it was computed
at to its new one (:mod:`kvb_cache.rope`) and placed in the assembled cache; the uncached gaps between pieces
are computed by the recompute forward, then the chosen repair runs (:mod:`kvb_cache.repair`).

:meth:`Stitcher.plan` does the cheap part (lookup, re-positioning, which positions to recompute) and returns
a :class:`StitchJob` whose repair forward runs in slices (the engine loop runs one bounded slice per step,
:mod:`kvb_cache.core.preparing`); :meth:`Stitcher.extend` runs the plan and all of its repair at once.

Store rule: KV at or after the first stitched position is approximate (stitched chunks, and everything
computed over them), so a request that stitched stores only the chunks *before* its first stitched piece
under their prefix hashes; an exact hit therefore always serves KV that a forward computed over the true
history. Its later chunks are kept as *approximate* entries (``ChunkEntry.exact`` False, keys on
:func:`~kvb_cache.hashing.approximate_root`'s chain, which no prefix lookup walks): only this module's
content lookup finds them, so a document first seen after a stitched one is reused the next time too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.hashing import ChunkHash, content_hash
from kvb_cache.model_traits import ModelTraits
from kvb_cache.repair.cacheblend import CacheBlendRepair
from kvb_cache.repair.recompute import RecomputeLayout, RecomputePass, RepairWork
from kvb_cache.repair.selective import selective_positions
from kvb_cache.results import ChunkHit, HitKind
from kvb_cache.rope import KeyRepositioner
from kvb_cache.stitch_config import StitchConfig
from kvb_cache.store import ChunkEntry, ChunkStore

if TYPE_CHECKING:
    from kvb_cache.prepared import PreparedPrompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class StitchedPiece:
    """Prompt tokens ``[start, end)`` served by ``entry`` (computed at ``entry.start`` after another history)."""

    start: int
    end: int
    entry: ChunkEntry


class _Lookup:
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
    store: ChunkStore, root: ChunkHash, ids: Sequence[int], *, start: int, stop: int, lengths: Sequence[int]
) -> list[StitchedPiece]:
    """Greedy left-to-right scan of ``ids[start:stop]`` for runs that a stored chunk holds.

    At each position the chunk lengths the chunker can produce (``lengths``) are tried; a hit jumps past
    the piece, a miss advances one token. ``O((stop - start) * len(lengths))`` hashes.

    The same tokens are often stored several times, computed after different histories (a document seen in
    several prompts). Which copy serves a position decides where the seams are, so the choice is: the copy
    computed right after the previous piece's chunk (no seam there), else the copy that starts the longest
    chain of such neighbours (fewest seams ahead), then the longest chunk. Taking whichever copy the store
    lists first could switch copies inside a document and cut it with seams that each need repair.
    """
    lookup = _Lookup(store, root, ids, stop, lengths)
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


def _dense_kv(entry: ChunkEntry):
    """Per layer ``(keys, values)``; quantized tiers keep entries encoded and decode through ``dense()``."""
    dense = getattr(entry, "dense", None)
    return dense() if dense is not None else entry.kv


@dataclass(eq=False, slots=True, kw_only=True)
class StitchJob:
    """A planned stitch (:meth:`Stitcher.plan`): pieces found, KV assembled, repair pending.

    :meth:`run` advances the repair; when its last slice has run, the repaired KV goes into
    ``prepared.cache`` and ``prepared``'s telemetry (chunks, ``exact_until``, ``cached_tokens``) is filled
    in, and the stitch is counted in ``cache_stats()["stitching"]``. Until then ``prepared`` is unchanged
    but for its cache, which must not be read (a job dropped half-way counts nothing).
    """

    stitcher: Stitcher
    prepared: PreparedPrompt
    pieces: list[StitchedPiece]
    #: Per layer ``[keys, values]``, each ``[1, kv_heads, end, head_dim]``: positions ``[0, end)``.
    layers: list[list[torch.Tensor]]
    work: RepairWork
    #: Stitched positions recomputed through all layers; None: the work chooses them (CacheBlend).
    repaired: list[int] | None
    prefix: int
    end: int
    finished: bool = False

    @property
    def done(self) -> bool:
        return self.finished

    def run(self, budget: int | None = None) -> int:
        """Run at most ``budget`` more repair positions (None: all that is left); returns how many ran."""
        ran = 0 if self.work.done else self.work.run(budget)
        if self.work.done and not self.finished:
            self.finished = True
            repaired = self.repaired
            if repaired is None:
                assert isinstance(self.work, CacheBlendRepair)
                repaired = self.work.repaired
            self.stitcher._finish(self, repaired)
        return ran


class StitchCounters:
    """Stitching totals for ``cache_stats()`` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.stitched_chunks = 0
        self.stitched_tokens = 0
        self.recomputed_tokens = 0

    def record(self, pieces: int, tokens: int, recomputed: int) -> None:
        with self._lock:
            self.requests += bool(pieces)
            self.stitched_chunks += pieces
            self.stitched_tokens += tokens
            self.recomputed_tokens += recomputed


class Stitcher:
    """Extends a prepared prompt's exact prefix with re-positioned, repaired content-hash hits."""

    def __init__(
        self,
        model: PreTrainedModel,
        traits: ModelTraits,
        store: ChunkStore,
        root: ChunkHash,
        config: StitchConfig | None,
        *,
        chunk_size: int,
        boundary_window: int,
    ) -> None:
        self.model = model
        self.store = store
        self.root = root
        self.config = config
        self.mover = KeyRepositioner.for_model(model, absolute_positions=traits.absolute_positions)
        self.layout = RecomputeLayout.for_model(model, traits.sliding_window)
        self.lengths = sorted(
            range(chunk_size - boundary_window, chunk_size + boundary_window + 1), reverse=True
        )
        self.counters = StitchCounters()
        if config is not None and not self.mover.support.supported:
            logger.warning("non-prefix reuse declined: %s", self.mover.support.reason)

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.mover.support.supported

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "enabled": self.enabled,
            "strategy": self.config.recompute_strategy if self.config else None,
            "declined_reason": None if self.config is None or self.enabled else self.mover.support.reason,
            "requests": c.requests,
            "stitched_chunks": c.stitched_chunks,
            "stitched_tokens": c.stitched_tokens,
            "recomputed_tokens": c.recomputed_tokens,
        }

    def extend(self, prepared: PreparedPrompt, *, max_reuse: int) -> None:
        """Stitch cached chunks after ``prepared``'s exact prefix (in place); a no-op when nothing hits.

        :meth:`plan` and its whole repair at once (the engine loop runs the repair in slices instead)."""
        job = self.plan(prepared, max_reuse=max_reuse)
        if job is not None:
            job.run()

    def plan(self, prepared: PreparedPrompt, *, max_reuse: int) -> StitchJob | None:
        """Find the pieces after ``prepared``'s exact prefix, assemble and re-position their KV and choose the
        positions to recompute; the repair forward is left to :meth:`StitchJob.run`. None when nothing hits.

        Content hashes are rooted in ``prepared.root`` (the request's salted root), so a salted request only
        finds chunks stored under the same salt. The store is only read here (and its hits touched)."""
        if not self.enabled:
            return None
        assert self.config is not None
        cfg = self.config
        ids, prefix = prepared.ids, prepared.cached_tokens
        pieces = [
            p
            for p in find_pieces(
                self.store,
                self.root if prepared.root is None else prepared.root,
                ids,
                start=prefix,
                stop=max_reuse,
                lengths=self.lengths,
            )
            if p.end - p.start >= cfg.min_reuse_tokens
        ]
        if not pieces:
            return None
        end = pieces[-1].end
        layers = self._assemble(prepared.cache, pieces, prefix, end)
        stitched = [p for piece in pieces for p in range(piece.start, piece.end)]
        covered = set(stitched)
        gaps = [p for p in range(prefix, end) if p not in covered]
        strategy = cfg.recompute_strategy
        spans = chained_runs(pieces)
        work: RepairWork
        repaired: list[int] | None
        if strategy == "none":
            work, repaired = RecomputePass(self.model, layers, ids, gaps, self.layout), []
        elif strategy == "selective":
            repaired = selective_positions(spans, overlap_k=cfg.overlap_k, sink_tokens=cfg.sink_tokens)
            positions = sorted(set(gaps) | set(repaired))
            work = RecomputePass(self.model, layers, ids, positions, self.layout)
        else:
            seams = selective_positions(spans, overlap_k=cfg.overlap_k, sink_tokens=cfg.sink_tokens)
            work = CacheBlendRepair(
                self.model,
                layers,
                ids,
                stitched=stitched,
                forced=sorted(set(gaps) | set(seams)),
                layout=self.layout,
                recompute_ratio=cfg.recompute_ratio,
                check_layer=cfg.check_layer,
            )
            repaired = None  # chosen by the check pass
        return StitchJob(
            stitcher=self,
            prepared=prepared,
            pieces=pieces,
            layers=layers,
            work=work,
            repaired=repaired,
            prefix=prefix,
            end=end,
        )

    def _finish(self, job: StitchJob, repaired: list[int]) -> None:
        """Hand the repaired KV and the telemetry to the prepared prompt, and count the stitch."""
        prepared = job.prepared
        for cache_layer, (keys, values) in zip(prepared.cache.layers, job.layers):
            cache_layer.keys, cache_layer.values = keys, values
        self._describe(prepared, job.pieces, set(repaired), job.prefix, job.end)
        stitched = sum(p.end - p.start for p in job.pieces)
        self.counters.record(len(job.pieces), stitched, len(repaired))

    def _assemble(self, cache: DynamicCache, pieces: list[StitchedPiece], prefix: int, end: int):
        """Per layer ``[keys, values]`` covering positions ``[0, end)``: the exact prefix, re-positioned pieces,
        zeros for the gaps (overwritten by the recompute forward before anything attends to them)."""
        moved = [
            self.mover.reposition(_dense_kv(piece.entry), piece.entry.start, piece.start) for piece in pieces
        ]
        first = moved[0]
        layers = []
        for layer, (k0, v0) in enumerate(first):
            region_k = k0.new_zeros((1, k0.shape[1], end - prefix, k0.shape[3]))
            region_v = v0.new_zeros((1, v0.shape[1], end - prefix, v0.shape[3]))
            for piece, kv in zip(pieces, moved):
                region_k[:, :, piece.start - prefix : piece.end - prefix] = kv[layer][0]
                region_v[:, :, piece.start - prefix : piece.end - prefix] = kv[layer][1]
            if prefix:
                cached = cache.layers[layer]
                region_k = torch.cat([cached.keys, region_k], dim=2)
                region_v = torch.cat([cached.values, region_v], dim=2)
            layers.append([region_k, region_v])
        if not prefix:
            # An empty prefix leaves the cache without layers; give it full layers to receive the tensors.
            empty = [(k[:, :, :0], v[:, :, :0]) for k, v in first]
            fresh = DynamicCache(empty)
            cache.layers[:] = fresh.layers
        return layers

    def _describe(self, prepared: PreparedPrompt, pieces, repaired: set[int], prefix: int, end: int) -> None:
        hits: list[ChunkHit] = [
            h if h.end <= prefix else replace(h, end=prefix)
            for h in prepared.chunks
            if h.start < prefix and h.cached_tokens
        ]
        cursor = prefix
        for piece in pieces:
            if piece.start > cursor:
                hits.append(ChunkHit(start=cursor, end=piece.start, kind=HitKind.MISS, cached_tokens=0))
            count = sum(1 for p in range(piece.start, piece.end) if p in repaired)
            hits.append(
                ChunkHit(
                    start=piece.start,
                    end=piece.end,
                    kind=HitKind.STITCHED,
                    cached_tokens=piece.end - piece.start,
                    recomputed_tokens=count,
                )
            )
            cursor = piece.end
        if cursor < len(prepared.ids):
            hits.append(ChunkHit(start=cursor, end=len(prepared.ids), kind=HitKind.MISS, cached_tokens=0))
        prepared.chunks = tuple(hits)
        prepared.reused_tokens = prefix + sum(p.end - p.start for p in pieces)
        prepared.recomputed_tokens = len(repaired)
        prepared.exact_until = pieces[0].start
        prepared.cached_tokens = end
