"""Attention over keys and values already gathered: plain torch, shared by the paged forward and the repair.

Owns the arithmetic only (no pool, no model): grouped-query layout without repeating keys and values, SDPA
or the eager formula when soft-capping or attention sinks need it, and the position mask (causal, sliding
window, attention chunk). :mod:`kvb_cache.core.paged_attention` gathers a step's keys/values from the pool
and calls it; :mod:`kvb_cache.repair.rows` does the same for a repair forward's recomputed rows.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, Q, D]`` -> ``[B, KVH, G * Q, D]``: each key/value head attended by its ``G`` query heads at
    once (grouped-query attention without repeating keys and values; query rows are independent)."""
    b, heads, q_len, d = q.shape
    return q.reshape(b, kv_heads, (heads // kv_heads) * q_len, d)


def sink_column(sinks: torch.Tensor, kv_heads: int, q_len: int) -> torch.Tensor:
    """Per-head sink logits ``[H]`` laid out for grouped queries: ``[KVH, G * q_len, 1]`` (row ``g * q + i`` of
    key head ``h`` is query head ``h * G + g``)."""
    groups = sinks.shape[0] // kv_heads
    return sinks.view(kv_heads, groups, 1, 1).expand(kv_heads, groups, q_len, 1).reshape(kv_heads, -1, 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float | None,
    softcap: float | None,
    causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` ``[B, H, Q, D]``, ``k``/``v`` ``[B, H, L, D]``, bool ``mask`` ``[B, 1, Q, L]`` -> ``[B, H, Q, Dv]``.

    ``sinks`` ``[H, Q, 1]`` (gpt-oss): a learned logit per head that joins every row's softmax as one more
    "key" with a zero value, so a row may give part of its attention to nothing.
    """
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, is_causal=causal)
    # SDPA has neither logit soft-capping (Gemma 2) nor sinks (gpt-oss): the eager formula, as transformers'
    # eager paths compute it.
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril(
            k.shape[-2] - q.shape[-2]
        )
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, column], dim=-1).float()
        probs = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


def causal_mask(
    q_len: int, ctx: int, window: int | None, device: torch.device, chunk: int | None = None
) -> torch.Tensor:
    """``[q_len, ctx]`` bool: query ``i`` (position ``ctx - q_len + i``) sees key ``j <= `` its position,
    within the sliding window when there is one and inside its own attention chunk when there is one."""
    q_pos = torch.arange(ctx - q_len, ctx, device=device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if chunk is not None:
        mask &= k_pos // chunk == q_pos // chunk
    return mask
