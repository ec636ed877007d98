"""The launch plumbing every attention kernel shares: packed-row grid, split-KV scratch and merge."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch

from kvb_kernels.backend import autotune_enabled, interpreter_enabled
from kvb_kernels.checks import is_int
from kvb_kernels.errors import ShapeError
from kvb_kernels.splits import SplitBuffers, allocate, choose_num_splits, combine_splits

LOG2E = 1.4426950408889634

# A kernel call: (autotuned kernel, grid, split scratch or None, num_splits) -> None.
KernelCall = Callable[[Any, Callable[[dict], tuple[int, int, int]], SplitBuffers | None, int], None]


def run(
    kernel_name: str,
    call: KernelCall,
    *,
    out: torch.Tensor,
    kv_heads: int,
    group: int,
    kv_len: int,
    num_splits: int | None,
) -> None:
    """Launch ``kernel_name`` over ``out`` (``[batch, q_len, heads, head_dim]``), splitting the keys if useful.

    Args:
        call: Issues the launch with the kernel's own arguments.
        out: Result buffer, written in place.
        kv_heads: Key/value heads; one program column per (batch, kv head).
        group: Query heads per key/value head (rows per query position).
        kv_len: Longest key length (sizes the split slices).
        num_splits: Force the number of key slices (tests); None picks one from the GPU's SM count.
    """
    from kvb_kernels.triton.tuning import DECODE_ROWS_MAX, tuned

    batch, q_len, _, head_dim = out.shape
    rows = q_len * group
    decode = rows <= DECODE_ROWS_MAX
    if num_splits is None:
        programs = batch * kv_heads * math.ceil(rows / 64)
        num_splits = choose_num_splits(programs=programs, kv_len=kv_len, device=out.device)
    elif not is_int(num_splits) or num_splits < 1:
        raise ShapeError(f"num_splits must be an int >= 1 or None (automatic), got {num_splits!r}")
    else:
        num_splits = operator.index(num_splits)  # a NumPy int failed inside Triton's launch
    kernel = tuned(kernel_name, decode, interpreter_enabled(), autotune_enabled())

    def grid(meta: dict) -> tuple[int, int, int]:
        return (math.ceil(rows / meta["BLOCK_M"]), batch * kv_heads, num_splits)

    if num_splits == 1:
        call(kernel, grid, None, 1)
        return
    parts = allocate(
        batch_kv_heads=batch * kv_heads,
        num_splits=num_splits,
        rows=rows,
        head_dim=head_dim,
        device=out.device,
    )
    call(kernel, grid, parts, num_splits)
    merged = combine_splits(parts)  # [B * Hkv, q_len * group, D]
    merged = merged.view(batch, kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)
    out.copy_(merged.reshape(batch, q_len, kv_heads * group, head_dim))


def attention_output_like(query: torch.Tensor, *_: object) -> torch.Tensor:
    """The attention custom ops' fake: an empty ``[batch, q_len, heads, head_dim]`` buffer (what each op
    returns before the caller's transpose) for ``query`` ``[batch, heads, q_len, head_dim]``."""
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


def block_d(head_dim: int) -> int:
    """Head-dim tile: the next power of two (``tl.arange`` needs one), at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def input_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied in IEEE fp32 (never TF32) so fp32 results match fp32 SDPA."""
    return "ieee" if dtype == torch.float32 else "tf32"


def bucket(n: int) -> int:
    """Power-of-two bucket of ``n``: autotuning keys on it so a growing KV length does not retune each step."""
    return 1 << max(int(n) - 1, 0).bit_length()
