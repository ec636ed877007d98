"""One step's attention metadata (:class:`PagedBatch`): plain tensors the model runner builds once per step
and every attention layer reads (:mod:`kvb_cache.core.paged_attention`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvb_cache.core.kv_storage import KVStorage
from kvb_cache.core.pool_kernel import PoolKernel, block_table


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillSeq:
    """A request feeding ``q_len`` tokens at packed offsets ``[start, start + q_len)``; ``slots`` ``[ctx]``
    index its whole context (cached + new), ``positions`` ``[ctx]`` are their positions (0..ctx-1)."""

    start: int
    q_len: int
    slots: torch.Tensor
    #: ``[1, P]`` int32 blocks of ``slots`` and ``[1]`` int32 ``ctx``: set when a pool kernel attends.
    block_table: torch.Tensor | None = None
    kv_len: torch.Tensor | None = None
    #: The position mask of a slice attended in one block, built by the first layer that needs it and reused
    #: by the others, keyed by (query groups, sliding window, attention chunk): ``[1, 1, G * q, ctx]`` bool.
    masks: dict[tuple[int, int | None, int | None], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeGroup:
    """Requests feeding one token each: ``rows`` ``[B]`` packed offsets (None when ``row_start`` says them),
    ``slots`` ``[B, L]`` context slots padded with slot 0, ``valid`` ``[B, L]`` bool (False on pads),
    ``lengths`` ``[B]`` context lengths."""

    rows: torch.Tensor | None
    slots: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor
    #: ``rows`` is ``row_start, row_start + 1, ...`` (the scheduler puts decodes first, so it usually is):
    #: layers then read and write the rows as a slice, not through an index gather and scatter each.
    row_start: int | None = None
    #: ``[B, P]`` int32 blocks of ``slots`` and ``[B]`` int32 ``lengths``: set when a pool kernel attends.
    block_table: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    #: Position masks built by the first layer that needs one and reused by every other layer of the step,
    #: keyed by (row range, sliding window, attention chunk): ``[b, 1, 1, L]`` bool.
    masks: dict[tuple[int, int, int | None, int | None], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def padded(
        cls,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        *,
        block_size: int | None,
        rows: torch.Tensor | None = None,
        row_start: int | None = None,
    ) -> DecodeGroup:
        """The group of rows whose context slots are ``slots`` ``[B, L]`` (padded past each row's length)
        and ``lengths`` ``[B]``; ``block_size`` set: with the block tables a pool kernel reads (built once
        per step, read by every layer)."""
        tables = {}
        if block_size is not None:
            tables = {"block_table": block_table(slots, block_size), "kv_lens": lengths.to(torch.int32)}
        valid = torch.arange(slots.shape[1], device=slots.device).unsqueeze(0) < lengths.unsqueeze(1)
        return cls(rows=rows, slots=slots, valid=valid, lengths=lengths, row_start=row_start, **tables)

    def rows_at(self, part: slice) -> slice | torch.Tensor:
        """The packed rows of ``part`` of this group: a slice when they are contiguous, else ``[b]`` indices."""
        if self.row_start is None:
            assert self.rows is not None
            return self.rows[part]
        return slice(self.row_start + part.start, self.row_start + part.stop)


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedBatch:
    """Everything attention needs for one step; plain tensors, built by the model runner."""

    storage: KVStorage
    #: ``[T]`` pool slot of every packed token.
    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSeq, ...]
    decode: DecodeGroup | None
    #: Attention that reads the pool's blocks in place (:mod:`kvb_cache.core.pool_kernel`); None: gather + SDPA.
    kernel: PoolKernel | None = None

    @property
    def decode_only(self) -> bool:
        """Only decoding rows, packed 0..B-1: a layer's attention output is then theirs as it comes."""
        return not self.prefills and self.decode is not None and self.decode.row_start == 0
