"""Split-KV (flash-decoding): when there are too few (batch, head, row-block) programs to fill the GPU, the key
range is cut into ``num_splits`` slices computed in parallel, then merged here by their log-sum-exp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Below this many keys per split the merge costs more than the extra parallelism gains.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


class SplitBuffers(NamedTuple):
    """Scratch for a split launch.

    Attributes:
        out: ``[batch * kv_heads, num_splits, rows, head_dim]`` fp32, each split's normalised partial output.
        lse: ``[batch * kv_heads, num_splits, rows]`` fp32, each split's log2-sum-exp (``-inf``: saw no key).
    """

    out: torch.Tensor
    lse: torch.Tensor


def choose_num_splits(*, programs: int, kv_len: int, device: torch.device) -> int:
    """How many key slices to use so that ``programs * splits`` covers about two waves of SMs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    wanted = -(-2 * sms // programs)
    return max(1, min(wanted, kv_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def allocate(
    *, batch_kv_heads: int, num_splits: int, rows: int, head_dim: int, device: torch.device
) -> SplitBuffers:
    """Uninitialised scratch for a split launch (every element is written by the kernel)."""
    return SplitBuffers(
        out=torch.empty(batch_kv_heads, num_splits, rows, head_dim, device=device, dtype=torch.float32),
        lse=torch.empty(batch_kv_heads, num_splits, rows, device=device, dtype=torch.float32),
    )


def combine_splits(parts: SplitBuffers) -> torch.Tensor:
    """Merge split partials into ``[batch * kv_heads, rows, head_dim]`` fp32.

    Rows whose every split saw no key (fully masked) come out as zeros.
    """
    lse = parts.lse  # [BH, S, R]
    top = lse.amax(dim=1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp2(lse - top)  # exp2(-inf) = 0 for empty splits
    total = weight.sum(dim=1)  # [BH, R]
    merged = (weight.unsqueeze(-1) * parts.out).sum(dim=1)
    return merged / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)
