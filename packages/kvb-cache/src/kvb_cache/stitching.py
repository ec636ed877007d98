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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.hashing import ChunkHash, approximate_root
from kvb_cache.lookup import chunk_keys
from kvb_cache.model_traits import ModelTraits
from kvb_cache.repair.cacheblend import CacheBlendRepair
from kvb_cache.repair.recompute import RecomputeLayout, RecomputePass, RepairWork
from kvb_cache.repair.selective import selective_positions
from kvb_cache.results import ChunkHit, HitKind
from kvb_cache.rope import KeyRepositioner
from kvb_cache.stitch_config import StitchConfig
from kvb_cache.stitch_lookup import (
    ContentLookup,
    StitchedPiece,
    chained_runs,
    copy_pieces,
    find_pieces,
    keep_held_runs,
    own_chain,
)
from kvb_cache.store import ChunkEntry, ChunkStore

if TYPE_CHECKING:
    from kvb_cache.prepared import PreparedPrompt

logger = logging.getLogger(__name__)


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
            # stitched tokens that got the mean of several stored copies (StitchConfig.average_copies)
            "averaged_tokens": c.averaged_tokens,
            # stitched tokens computed instead to collect another copy (StitchConfig.collect_copies)
            "collected_tokens": c.collected_tokens,
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
        root = self.root if prepared.root is None else prepared.root
        lookup = ContentLookup(self.store, root, ids, max_reuse, self.lengths)
        approximate = approximate_root(root)
        approximate_keys = chunk_keys(approximate, ids, prepared.spans).prefix
        kept = own_chain(self.store, ids, prepared.spans, approximate_keys, start=prefix, stop=max_reuse)
        if kept:
            # Less than a chunk before it: found in a lookup that stops where the chain starts.
            before = ContentLookup(self.store, root, ids, kept[0].start, self.lengths)
            found = find_pieces(
                self.store, root, ids, start=prefix, stop=kept[0].start, lengths=self.lengths, lookup=before
            )
            found += kept
            start = kept[-1].end
        else:
            found, start = [], prefix
        found += find_pieces(
            self.store, root, ids, start=start, stop=max_reuse, lengths=self.lengths, lookup=lookup
        )
        pieces = [p for p in found if p.end - p.start >= cfg.min_reuse_tokens]
        if not pieces:
            return None
        runs = chained_runs(pieces)
        wanted = max(cfg.average_copies, cfg.collect_copies, cfg.idle_copies)
        copies = copy_pieces(lookup, pieces, max_copies=wanted, slack=self.lengths[0], runs=runs)
        # A run whose copy was computed after this very prompt's tokens (its parent is one of the prompt's
        # own prefix keys, exact or approximate: the same prompt, or one sharing all of it, asked before)
        # has the best history there is: it is neither averaged with copies after other histories nor
        # computed again to collect one.
        history = {root, approximate, *approximate_keys, *chunk_keys(root, ids, prepared.spans).prefix}
        firsts = {p.start: p for p in pieces}
        own = [firsts[run_start].entry.parent in history for run_start, _ in runs]
        copies = [[] if same else chains for same, chains in zip(own, copies)]
        under_held = any(not same and len(chains) + 1 < cfg.idle_copies for same, chains in zip(own, copies))
        if cfg.collect_copies > 1:
            pieces, runs, copies, dropped = keep_held_runs(pieces, runs, copies, own, cfg.collect_copies)
            self.counters.record_collected(dropped)
            if not pieces:
                return None
        copies = [chains[: cfg.average_copies - 1] for chains in copies]
        end = pieces[-1].end
        layers, averaged = self._assemble(prepared.cache, pieces, runs, copies, prefix, end)
        stitched = [p for piece in pieces for p in range(piece.start, piece.end)]
        covered = set(stitched)
        gaps = [p for p in range(prefix, end) if p not in covered]
        strategy = cfg.recompute_strategy
        work: RepairWork
        repaired: list[int] | None
        if strategy == "none":
            work, repaired = RecomputePass(self.model, layers, ids, gaps, self.layout), []
        elif strategy == "selective":
            repaired = selective_positions(runs, overlap_k=cfg.overlap_k, sink_tokens=cfg.sink_tokens)
            positions = sorted(set(gaps) | set(repaired))
            work = RecomputePass(self.model, layers, ids, positions, self.layout)
        else:
            seams = selective_positions(runs, overlap_k=cfg.overlap_k, sink_tokens=cfg.sink_tokens)
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
            averaged=averaged,
            under_held=under_held,
        )

    def _finish(self, job: StitchJob, repaired: list[int]) -> None:
        """Hand the repaired KV and the telemetry to the prepared prompt, and count the stitch."""
        prepared = job.prepared
        prepared.under_held = job.under_held
        for cache_layer, (keys, values) in zip(prepared.cache.layers, job.layers):
            cache_layer.keys, cache_layer.values = keys, values
        self._describe(prepared, job.pieces, set(repaired), job.prefix, job.end)
        stitched = sum(p.end - p.start for p in job.pieces)
        self.counters.record(len(job.pieces), stitched, len(repaired))
        self.counters.record_averaged(job.averaged)

    def _assemble(
        self,
        cache: DynamicCache,
        pieces: list[StitchedPiece],
        runs: list[tuple[int, int]],
        copies: list[list[list[StitchedPiece]]],
        prefix: int,
        end: int,
    ) -> tuple[list[list[torch.Tensor]], int]:
        """Per layer ``[keys, values]`` covering positions ``[0, end)``: the exact prefix, re-positioned pieces,
        zeros for the gaps (overwritten by the recompute forward before anything attends to them).

        ``copies`` (per run in ``runs``, :func:`~kvb_cache.stitch_lookup.copy_pieces`): other stored copies
        of the run's tokens; each stitched position gets the mean of every copy that holds it (the run's own
        piece included), re-positioned the same way. A position no other copy holds keeps its piece's KV
        exactly (nothing is divided). Returns the layers and how many positions got a mean."""
        moved = [
            self.mover.reposition(_dense_kv(piece.entry), piece.entry.start, piece.start) for piece in pieces
        ]
        # (first, last) prompt positions each other copy adds to, clipped to its run.
        extra: list[tuple[int, int, StitchedPiece]] = []
        for (run_start, run_end), chains in zip(runs, copies):
            for piece in (p for chain in chains for p in chain):
                lo, hi = max(piece.start, run_start), min(piece.end, run_end)
                if lo < hi:
                    extra.append((lo, hi, piece))
        count = None
        if extra:
            count = torch.ones(end - prefix)
            for lo, hi, _ in extra:
                count[lo - prefix : hi - prefix] += 1
        extra_kv = [
            self.mover.reposition(_dense_kv(piece.entry), piece.entry.start, piece.start)
            for _, _, piece in extra
        ]
        first = moved[0]
        layers = []
        for layer, (k0, v0) in enumerate(first):
            region_k = k0.new_zeros((1, k0.shape[1], end - prefix, k0.shape[3]))
            region_v = v0.new_zeros((1, v0.shape[1], end - prefix, v0.shape[3]))
            for piece, kv in zip(pieces, moved):
                region_k[:, :, piece.start - prefix : piece.end - prefix] = kv[layer][0]
                region_v[:, :, piece.start - prefix : piece.end - prefix] = kv[layer][1]
            if count is not None:
                for (lo, hi, piece), kv in zip(extra, extra_kv):
                    region_k[:, :, lo - prefix : hi - prefix] += kv[layer][0][
                        :, :, lo - piece.start : hi - piece.start
                    ]
                    region_v[:, :, lo - prefix : hi - prefix] += kv[layer][1][
                        :, :, lo - piece.start : hi - piece.start
                    ]
                scale = count.to(region_k.dtype)[None, None, :, None]
                region_k /= scale
                region_v /= scale
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
        averaged = 0 if count is None else int((count > 1).sum())
        return layers, averaged

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
