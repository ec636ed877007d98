"""A planned stitch, from :meth:`~kvb_cache.stitching.Stitcher.plan` to its last repair slice.

:class:`StitchJob` holds the assembled KV and the pending repair; when the repair is done it hands the
repaired KV to the prepared prompt, describes the stitch there (chunk hits, ``exact_until``, the copied
spans: :func:`describe_stitch`) and counts it in the stitcher's :class:`StitchCounters`
(``cache_stats()["stitching"]``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.repair.cacheblend import CacheBlendRepair
from kvb_cache.repair.recompute import RepairWork
from kvb_cache.results import ChunkHit, HitKind
from kvb_cache.stitch_lookup import StitchedPiece

if TYPE_CHECKING:
    from kvb_cache.prepared import PreparedPrompt
    from kvb_cache.stitching import Stitcher


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
    #: Stitched positions whose KV is the mean of several stored copies.
    averaged: int = 0
    #: A stitched run is held by fewer than ``StitchConfig.idle_copies`` independent copies: computing this
    #: prompt when the engine is idle would add one (:mod:`kvb_cache.core.idle`).
    under_held: bool = False
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
            self._finish(repaired)
        return ran

    def _finish(self, repaired: list[int]) -> None:
        """Hand the repaired KV and the telemetry to the prepared prompt, and count the stitch."""
        prepared = self.prepared
        prepared.under_held = self.under_held
        for cache_layer, (keys, values) in zip(own_kv_layers(prepared.cache), self.layers):
            cache_layer.keys, cache_layer.values = keys, values
        describe_stitch(prepared, self.pieces, set(repaired), self.prefix, self.end)
        stitched = sum(p.end - p.start for p in self.pieces)
        counters = self.stitcher.counters
        counters.record(len(self.pieces), stitched, len(repaired))
        counters.record_averaged(self.averaged)


class StitchCounters:
    """Stitching totals for ``cache_stats()`` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.stitched_chunks = 0
        self.stitched_tokens = 0
        self.recomputed_tokens = 0
        self.averaged_tokens = 0
        self.collected_tokens = 0

    def record(self, pieces: int, tokens: int, recomputed: int) -> None:
        with self._lock:
            self.requests += bool(pieces)
            self.stitched_chunks += pieces
            self.stitched_tokens += tokens
            self.recomputed_tokens += recomputed

    def record_averaged(self, tokens: int) -> None:
        with self._lock:
            self.averaged_tokens += tokens

    def record_collected(self, tokens: int) -> None:
        with self._lock:
            self.collected_tokens += tokens


def describe_stitch(
    prepared: PreparedPrompt, pieces: list[StitchedPiece], repaired: set[int], prefix: int, end: int
) -> None:
    """Fill ``prepared``'s telemetry for a stitch of ``pieces`` after its exact ``prefix`` (covering
    positions up to ``end``): chunk hits, reused / recomputed tokens, ``exact_until``, ``cached_tokens`` and
    the ``copied`` spans (stitched positions not in ``repaired``)."""
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
    copied: list[tuple[int, int]] = []
    for piece in pieces:
        for p in range(piece.start, piece.end):
            if p in repaired:
                continue
            if copied and copied[-1][1] == p:
                copied[-1] = (copied[-1][0], p + 1)
            else:
                copied.append((p, p + 1))
    prepared.copied = tuple(copied)
