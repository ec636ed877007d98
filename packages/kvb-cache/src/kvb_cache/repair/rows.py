"""Attention of a few recomputed rows over the whole assembled cache, at the cost of those rows only.

A repair forward queries ``Q`` chosen positions (ascending, usually scattered) against the ``N`` cached
ones. A dense ``[Q, N]`` additive mask makes every row pay for all ``N`` keys (and CPU SDPA is slower per
row with a float mask than on its causal path). Here the rows are cut into a few *segments* of consecutive
rows; a segment whose last position is ``b`` attends keys ``[0, b]`` only, with a small boolean mask for
its own rows (the keys before the segment's first position are visible to all of them). A row at position
``p`` then pays for about ``p`` keys plus the segment's span, as in a causal prefill; with ``S`` segments the
extra work is at most ``N / S`` keys per row.

Full-attention layers only (no sliding window): the repair keeps its dense position mask for those.
"""

from __future__ import annotations

import torch

from kvb_cache.core.attend import attend, group_queries, sink_column

#: Rows per segment are ``ceil(Q / SEGMENTS)`` (at least ``MIN_ROWS``): few SDPA calls per layer, and a
#: segment spans about ``N / SEGMENTS`` positions when the rows are spread out.
SEGMENTS = 16
MIN_ROWS = 32


class RowAttention:
    """The row attention of a repair forward (made current with ``row_call``): queries at ``positions``
    over keys ``[0, N)``.

    Built once per forward; the masks are built for the first layer's grouping and shared by every layer.

    Args:
        positions: ``[Q]`` ascending prompt positions of the query rows (cache index == position).
    """

    def __init__(self, positions: torch.Tensor) -> None:
        q = positions.shape[0]
        rows = max(MIN_ROWS, -(-q // SEGMENTS))
        #: ``(start, end, keys, mask)`` per segment; ``mask`` ``[r, keys]`` bool (row at p sees key j <= p).
        self.segments: list[tuple[int, int, int, torch.Tensor | None]] = []
        for start in range(0, q, rows):
            end = min(q, start + rows)
            pos = positions[start:end]
            first, last = int(pos[0]), int(pos[-1])
            if end - start == 1 or (first == 0 and last + 1 == end - start):
                mask = None  # one row at ``last`` sees every key up to it / a contiguous run from 0: causal
            else:
                keys = torch.arange(last + 1, device=positions.device)
                mask = keys[None, :] <= pos[:, None]
            self.segments.append((start, end, last + 1, mask))
        self._device = positions.device
        self._grouped: dict[int, list[torch.Tensor | None]] = {}

    def _masks(self, groups: int) -> list[torch.Tensor | None]:
        """Per segment ``[1, 1, G * r, keys]`` (query rows are head-major after grouping), or None."""
        if groups not in self._grouped:
            masks = []
            for start, end, length, mask in self.segments:
                if mask is None and groups > 1 and end - start > 1:
                    # A contiguous run from 0 is plain causal for one query head per key head only.
                    rows = end - start
                    mask = torch.ones(rows, length, dtype=torch.bool, device=self._device).tril(length - rows)
                masks.append(None if mask is None else mask.repeat(groups, 1)[None, None])
            self._grouped[groups] = masks
        return self._grouped[groups]

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query`` ``[1, H, Q, D]``, ``key``/``value`` ``[1, KVH, N, D]`` -> ``[1, Q, H, Dv]``; ``sinks``
        ``[H]`` per-head sink logits (gpt-oss) or None."""
        heads, kv_heads = query.shape[1], key.shape[1]
        out = query.new_empty((query.shape[2], heads, value.shape[-1]))  # [Q, H, Dv]
        for (start, end, length, _), mask in zip(self.segments, self._masks(heads // kv_heads)):
            q = group_queries(query[:, :, start:end], kv_heads)  # [1, KVH, G*r, D]
            k, v = key[:, :, :length], value[:, :, :length]
            causal = mask is None and end - start > 1
            column = None if sinks is None else sink_column(sinks, kv_heads, end - start)
            o = attend(q, k, v, mask, scaling=scaling, softcap=softcap, causal=causal, sinks=column)
            out[start:end] = o[0].reshape(heads, end - start, -1).transpose(0, 1)
        return out.unsqueeze(0)
