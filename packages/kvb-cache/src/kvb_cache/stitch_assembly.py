"""The assembled KV of a stitch: the exact prefix, then each stitched piece's stored KV re-positioned.

:func:`assemble_layers` builds what the repair forward starts from (:meth:`~kvb_cache.stitching.Stitcher.plan`
calls it): per layer the cached prefix, every piece rotated from the position it was computed at to its new
one (:mod:`kvb_cache.rope`), optionally averaged with the other stored copies of its run, and zeros for the
gaps between pieces (the recompute forward writes them before anything attends to them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import DynamicCache

from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.rope import KeyRepositioner
from kvb_cache.stitch_lookup import StitchedPiece
from kvb_cache.store import ChunkEntry


class AssembledKV(NamedTuple):
    """:func:`assemble_layers`' result."""

    #: Per layer ``[keys, values]``, each ``[1, kv_heads, end, head_dim]``: positions ``[0, end)``.
    layers: list[list[torch.Tensor]]
    #: Stitched positions whose KV is the mean of several stored copies.
    averaged: int


def dense_kv(entry: ChunkEntry):
    """Per layer ``(keys, values)``; quantized tiers keep entries encoded and decode through ``dense()``."""
    dense = getattr(entry, "dense", None)
    return dense() if dense is not None else entry.kv


def assemble_layers(
    mover: KeyRepositioner,
    cache: DynamicCache,
    pieces: list[StitchedPiece],
    runs: list[tuple[int, int]],
    copies: list[list[list[StitchedPiece]]],
    prefix: int,
    end: int,
) -> AssembledKV:
    """Per layer ``[keys, values]`` covering positions ``[0, end)``: the exact prefix (``cache``'s first
    ``prefix`` positions), re-positioned pieces, zeros for the gaps (overwritten by the recompute forward
    before anything attends to them).

    ``copies`` (per run in ``runs``, :func:`~kvb_cache.stitch_lookup.copy_pieces`): other stored copies
    of the run's tokens; each stitched position gets the mean of every copy that holds it (the run's own
    piece included), re-positioned the same way. A position no other copy holds keeps its piece's KV
    exactly (nothing is divided). An empty prefix gives ``cache`` empty full layers, to receive the tensors."""
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
    # Every piece and copy in one call: one rotation per layer, not one per piece and layer.
    rotated = mover.reposition_many(
        [(dense_kv(p.entry), p.entry.start, p.start) for p in (*pieces, *(e[2] for e in extra))]
    )
    moved, extra_kv = rotated[: len(pieces)], rotated[len(pieces) :]
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
            cached = own_kv_layers(cache)[layer]
            region_k = torch.cat([cached.keys, region_k], dim=2)
            region_v = torch.cat([cached.values, region_v], dim=2)
        layers.append([region_k, region_v])
    if not prefix:
        # An empty prefix leaves the cache without layers; give it full layers to receive the tensors.
        empty = [(k[:, :, :0], v[:, :, :0]) for k, v in first]
        fresh = DynamicCache(empty)
        cache.layers[:] = fresh.layers
    averaged = 0 if count is None else int((count > 1).sum())
    return AssembledKV(layers, averaged)
