"""Non-prefix reuse: find cached chunks anywhere in the prompt, re-position them, repair the seams.

After the exact prefix (prefix-hash hits and the token-granular tail), the rest of the prompt is scanned for
runs of tokens that some stored chunk holds (content hash, at *any* offset: a document moved by a few tokens
still hits). Each such run is a *stitched piece*: its cached KV is rotated from the position it was computed
at to its new one (:mod:`kvb_cache.rope`) and placed in the assembled cache; the uncached gaps between pieces
are computed by the recompute forward, then the chosen repair runs (:mod:`kvb_cache.repair`).

:meth:`Stitcher.plan` does the cheap part (lookup, re-positioning, which positions to recompute) and returns
a :class:`~kvb_cache.stitch_job.StitchJob` whose repair forward runs in slices (the engine loop runs one
bounded slice per step, :mod:`kvb_cache.core.preparing`); :meth:`Stitcher.extend` runs the plan and all of
its repair at once. This module owns the plan; the lookup is :mod:`kvb_cache.stitch_lookup`, the assembled
KV :mod:`kvb_cache.stitch_assembly`, the job and its telemetry :mod:`kvb_cache.stitch_job`.

Store rule: KV at or after the first stitched position is approximate (stitched chunks, and everything
computed over them), so a request that stitched stores only the chunks *before* its first stitched piece
under their prefix hashes; an exact hit therefore always serves KV that a forward computed over the true
history. Its later chunks are kept as *approximate* entries (``ChunkEntry.exact`` False, keys on
:func:`~kvb_cache.hashing.approximate_root`'s chain, which no prefix lookup walks): only this module's
content lookup finds them, so a document first seen after a stitched one is reused the next time too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel

from kvb_cache.hashing import ChunkHash, approximate_root
from kvb_cache.lookup import chunk_keys
from kvb_cache.model_traits import ModelTraits
from kvb_cache.repair.cacheblend import CacheBlendRepair
from kvb_cache.repair.recompute import RecomputeLayout, RecomputePass, RepairWork
from kvb_cache.repair.selective import selective_positions
from kvb_cache.rope import KeyRepositioner
from kvb_cache.stitch_assembly import assemble_layers
from kvb_cache.stitch_config import StitchConfig
from kvb_cache.stitch_job import StitchCounters, StitchJob
from kvb_cache.stitch_lookup import (
    ContentLookup,
    chained_runs,
    copy_pieces,
    find_pieces,
    keep_held_runs,
    own_chain,
)
from kvb_cache.store import ChunkStore

if TYPE_CHECKING:
    from kvb_cache.prepared import PreparedPrompt

logger = logging.getLogger(__name__)


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
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.store = store
        self.root = root
        self.config = config
        self.mover = KeyRepositioner.for_model(model, absolute_positions=traits.absolute_positions)
        self.layout = RecomputeLayout.for_model(model, traits.sliding_window, kv_cache_dtype)
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
        layers, averaged = assemble_layers(self.mover, prepared.cache, pieces, runs, copies, prefix, end)
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
