"""Token bitmasks: ``int32`` words, bit ``j % 32`` of word ``j // 32`` set when token ``j`` is allowed."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(scores: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to ``-inf`` in place.

    Args:
        scores: ``[R, V]`` float logits.
        rows: ``[M]`` int64, the rows of ``scores`` that ``bitmask`` constrains.
        bitmask: ``[M, ceil(V / 32)]`` int32 (CPU).
    """
    vocab = scores.shape[-1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :vocab]  # [M, V]
    allowed = allowed.to(scores.device, non_blocking=True)
    scores[rows] = scores[rows].masked_fill(~allowed, -float("inf"))
