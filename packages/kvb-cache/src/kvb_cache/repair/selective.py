"""Selective seam repair: which positions lost the most context when a chunk was stitched."""

from __future__ import annotations

from collections.abc import Sequence


def selective_positions(pieces: Sequence[tuple[int, int]], *, overlap_k: int, sink_tokens: int) -> list[int]:
    """Positions to recompute: the first ``overlap_k`` tokens *after* each seam, plus stitched sinks.

    A stitched chunk's first tokens attended to almost nothing of their new history (their old history is
    what they saw), while its later tokens still see most of their own chunk; so the error concentrates right
    after the seam, not before it (repairing the tokens before a seam, as kvboost 0.9 did, touches KV that
    was exact). The prompt's first ``sink_tokens`` draw outsized attention everywhere, so they are
    recomputed when they are stitched.

    Args:
        pieces: ``(start, end)`` prompt positions of each stitched run (chunks that were neighbours where
            they were computed form one run: :func:`kvb_cache.stitching.chained_runs`).
    """
    chosen: set[int] = set()
    for start, end in pieces:
        chosen.update(range(start, min(end, start + overlap_k)))
        chosen.update(p for p in range(start, end) if p < sink_tokens)
    return sorted(chosen)
