"""Attention over K/V held as pages of a shared pool and a block table (no ``torch.cat`` of a stitched prefix).

Layout contract (what a cache layer must hand over, per attention layer):

- ``key_pages``, ``value_pages``: ``[num_pages, kv_heads, page_size, head_dim]``, any strides. One page is
  exactly a cached chunk's KV as transformers stores it (``[1, kv_heads, chunk_len, head_dim]``) without the
  batch dim, so a chunk is written into the pool once and then referenced by index.
- ``block_table``: ``[batch, max_pages]`` int32; entry ``p`` of row ``b`` is the pool page holding that sequence's
  tokens ``p * page_size ... (p + 1) * page_size - 1``. Entries past a sequence's last page are ignored.
- ``kv_lens``: ``[batch]`` int32, tokens per sequence. Every page but the last must be full.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from kvb_kernels import launch
from kvb_kernels.checks import check_group, check_query, check_same, check_window, is_int, softmax_scale
from kvb_kernels.errors import DeviceError, ShapeError


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedKV:
    """K/V of a batch of sequences stored as pool pages (see the module docstring for the contract).

    Attributes:
        key_pages: ``[num_pages, kv_heads, page_size, head_dim]``.
        value_pages: Same shape as ``key_pages``.
        block_table: ``[batch, max_pages]`` int32 page indices.
        kv_lens: ``[batch]`` int32 token counts, each ``<= max_pages * page_size``.
        max_len: At least the longest of ``kv_lens``, when the caller knows it on the host (an engine's
            scheduler does). Given, :func:`paged_attention` neither reads ``kv_lens`` back nor checks the table
            against the pool: on CUDA that read is a host sync per call, which stops the host from queueing
            the next layer's kernels while this one runs (an engine calls once per layer per step). The caller
            then vouches that the lengths and the table's pages in use are valid. None: read and checked.
    """

    key_pages: torch.Tensor
    value_pages: torch.Tensor
    block_table: torch.Tensor
    kv_lens: torch.Tensor
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.key_pages.dim() != 4 or self.key_pages.shape != self.value_pages.shape:
            raise ShapeError(
                "key_pages and value_pages must both be [num_pages, kv_heads, page_size, head_dim]; got "
                f"{tuple(self.key_pages.shape)} and {tuple(self.value_pages.shape)}"
            )
        if self.block_table.dim() != 2 or self.block_table.dtype != torch.int32:
            raise ShapeError(
                f"block_table must be [batch, max_pages] int32, got {tuple(self.block_table.shape)} "
                f"{self.block_table.dtype}; build it with torch.tensor(..., dtype=torch.int32)"
            )
        if self.kv_lens.shape != (self.block_table.shape[0],) or self.kv_lens.dtype != torch.int32:
            raise ShapeError(
                f"kv_lens must be [batch] = [{self.block_table.shape[0]}] int32, got {tuple(self.kv_lens.shape)} "
                f"{self.kv_lens.dtype}"
            )
        if self.max_len is not None:
            capacity = self.block_table.shape[1] * self.page_size
            if not is_int(self.max_len) or not 0 <= self.max_len <= capacity:
                raise ShapeError(
                    f"max_len must be an int in [0, {capacity}] (the block table's pages x page_size), got "
                    f"{self.max_len!r}"
                )

    @property
    def page_size(self) -> int:
        return self.key_pages.shape[2]

    @property
    def max_kv_len(self) -> int:
        """Longest sequence: ``max_len`` when given, else read from ``kv_lens`` (one host sync); 0 for an
        empty batch."""
        if self.max_len is not None:
            return self.max_len
        return int(self.kv_lens.max().item()) if self.kv_lens.numel() else 0

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``[batch, kv_heads, max_kv_len, head_dim]`` copies of K and V, zero past each ``kv_lens``.

        This is the unfused equivalent (the ``torch.cat`` the kernel avoids): used by tests and benchmarks.
        """
        batch, max_pages = self.block_table.shape
        if batch == 0:  # an empty batch (paged_attention takes one): reshape(-1) could not infer the length
            empty = self.key_pages.new_empty(0, self.key_pages.shape[1], 0, self.key_pages.shape[3])
            return empty, self.value_pages.new_empty(
                0, self.value_pages.shape[1], 0, self.value_pages.shape[3]
            )
        lens = self.kv_lens.long()
        # Entries past a sequence's last page are ignored (any value, e.g. a -1 or out-of-range sentinel).
        in_use = (
            torch.arange(max_pages, device=lens.device)[None, :]
            < (lens[:, None] + self.page_size - 1) // self.page_size
        )
        pages = torch.where(in_use, self.block_table.long(), 0)
        out = []
        for pool in (self.key_pages, self.value_pages):
            # [batch, max_pages, kv_heads, page, D] -> [batch, kv_heads, max_pages * page, D]
            dense = pool[pages].permute(0, 2, 1, 3, 4).reshape(batch, pool.shape[1], -1, pool.shape[3])
            dense = dense[:, :, : self.max_kv_len]
            valid = torch.arange(dense.shape[2], device=dense.device)[None, :] < lens[:, None]
            out.append(torch.where(valid[:, None, :, None], dense, torch.zeros((), dtype=dense.dtype)))
        return out[0], out[1]


def paged_attention(
    query: torch.Tensor,
    kv: PagedKV,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over the paged K/V in ``kv``.

    Query ``i`` of sequence ``b`` sits at absolute position ``kv_lens[b] - q_len + i`` (its own token must
    already be in the pages), so the same call serves decode (``q_len == 1``) and a chunk of new tokens.

    Args:
        query: ``[batch, heads, q_len, head_dim]``; ``heads`` a multiple of the pool's ``kv_heads``.
        kv: Pages, block table and lengths (see :class:`PagedKV`).
        causal: Mask keys after each query's position.
        window: Sliding window (keys visible per query, itself included); None: unbounded.
        scale: Softmax scale; default ``1/sqrt(head_dim)``.
        num_splits: Key slices per (batch, head) program; None picks from the SM count.

    Returns:
        ``[batch, heads, q_len, head_dim]`` (a transposed view of a contiguous ``[batch, q_len, heads, D]``).
    """
    if torch.compiler.is_compiling():
        # One opaque custom op under torch.compile, as flash_attention (Inductor must not re-lower the kernel).
        out = torch.ops.kvb_kernels.paged_attention(
            query,
            kv.key_pages,
            kv.value_pages,
            kv.block_table,
            kv.kv_lens,
            causal,
            window,
            scale,
            num_splits,
            kv.max_len,
        )
        return out.transpose(1, 2)
    return _paged_attention(query, kv, causal, window, scale, num_splits)


def _paged_attention(
    query: torch.Tensor,
    kv: PagedKV,
    causal: bool,
    window: int | None,
    scale: float | None,
    num_splits: int | None,
) -> torch.Tensor:
    """:func:`paged_attention`'s checks and launch (positional, the custom op's schema)."""
    check_query(query)
    window = check_window(window)
    check_same(query, "key_pages", kv.key_pages)
    check_same(query, "value_pages", kv.value_pages)
    if kv.block_table.device != query.device or kv.kv_lens.device != query.device:
        raise DeviceError(
            "block_table and kv_lens must live on the query's device; move them with .to(device)"
        )
    batch, heads, q_len, head_dim = query.shape
    kv_heads = kv.key_pages.shape[1]
    if kv.block_table.shape[0] != batch or kv.key_pages.shape[3] != head_dim:
        raise ShapeError(
            f"block_table batch ({kv.block_table.shape[0]}) and page head_dim ({kv.key_pages.shape[3]}) must "
            f"match query batch ({batch}) and head_dim ({head_dim})"
        )
    group = check_group(heads, kv_heads)
    # NOTE: the kernel reads kv_lens with unit stride (a strided view would give other sequences' lengths).
    kv_lens = kv.kv_lens.contiguous()
    if kv.max_len is not None:  # the caller's host-side bound: no read-back, no table check (PagedKV)
        max_kv_len, min_kv_len, bad_pages = operator.index(kv.max_len), 0, 0
    else:
        max_kv_len, min_kv_len, bad_pages = _table_summary(kv, kv_lens)
    if min_kv_len < 0:
        raise ShapeError(f"kv_lens holds a negative length ({min_kv_len}); lengths are token counts >= 0")
    if max_kv_len > kv.block_table.shape[1] * kv.page_size:
        raise ShapeError(
            f"kv_lens reaches {max_kv_len} tokens but block_table holds only {kv.block_table.shape[1]} pages of "
            f"{kv.page_size}; add pages to the table"
        )
    if bad_pages:
        raise ShapeError(
            f"block_table has {bad_pages} entries within kv_lens outside the pool's pages "
            f"0..{kv.key_pages.shape[0] - 1}; point them at pages of key_pages/value_pages"
        )
    qk_scale = softmax_scale(scale, head_dim) * launch.LOG2E
    out = torch.empty(batch, q_len, heads, head_dim, device=query.device, dtype=query.dtype)

    def call(kernel, grid, parts, splits):
        kernel[grid](
            query,
            kv.key_pages,
            kv.value_pages,
            kv.block_table,
            kv_lens,
            out,
            parts.out if parts else out,
            parts.lse if parts else out,
            *query.stride(),
            *kv.key_pages.stride(),
            *kv.value_pages.stride(),
            *kv.block_table.stride(),
            out.stride(0),
            out.stride(2),
            out.stride(1),
            out.stride(3),
            qk_scale,
            kv_heads,
            q_len,
            max_kv_len,
            window or 0,
            splits,
            launch.bucket(q_len * group),
            launch.bucket(max_kv_len),
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=launch.block_d(head_dim),
            PAGE_SIZE=kv.page_size,
            CAUSAL=causal,
            HAS_WINDOW=window is not None,
            HAS_MASK=False,
            SPLIT=parts is not None,
            INPUT_PRECISION=launch.input_precision(query.dtype),
        )

    launch.run(
        "paged", call, out=out, kv_heads=kv_heads, group=group, kv_len=max_kv_len, num_splits=num_splits
    )
    return out.transpose(1, 2)


@torch.library.custom_op("kvb_kernels::paged_attention", mutates_args=())
def _paged_attention_op(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    causal: bool,
    window: int | None,
    scale: float | None,
    num_splits: int | None,
    max_len: int | None = None,
) -> torch.Tensor:
    kv = PagedKV(
        key_pages=key_pages,
        value_pages=value_pages,
        block_table=block_table,
        kv_lens=kv_lens,
        max_len=max_len,
    )
    # A custom op may not return a view: the contiguous [B, q_len, H, D] buffer; the caller transposes.
    return _paged_attention(query, kv, causal, window, scale, num_splits).transpose(1, 2)


_paged_attention_op.register_fake(launch.attention_output_like)


def _table_summary(kv: PagedKV, kv_lens: torch.Tensor) -> tuple[int, int, int]:
    """``(max kv_len, min kv_len, block-table entries in use that are not pool pages)``, in one host sync.

    An out-of-range page index would make the kernel read outside the pool (garbage, or a fault on CUDA).
    """
    lens = kv_lens.long()
    pages_in_use = (lens + kv.page_size - 1) // kv.page_size  # [batch]
    table = kv.block_table
    in_use = torch.arange(table.shape[1], device=table.device)[None, :] < pages_in_use[:, None]
    outside = (table < 0) | (table >= kv.key_pages.shape[0])
    bad = (in_use & outside).sum()
    if lens.numel() == 0:
        return 0, 0, 0
    max_len, min_len, bad_count = torch.stack([lens.max(), lens.min(), bad]).tolist()
    return int(max_len), int(min_len), int(bad_count)
