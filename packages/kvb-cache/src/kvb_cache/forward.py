"""The two model calls the engine makes: prefill a suffix over a cache, and one decode step."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.model_traits import ModelTraits


def prefill(
    model: PreTrainedModel,
    traits: ModelTraits,
    cache: DynamicCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    slice_size: int | None = None,
) -> torch.Tensor:
    """Run the uncached suffix through the model, appending its KV to ``cache``.

    Args:
        input_ids: ``[B, S]`` suffix tokens.
        position_ids: ``[B, S]`` their absolute positions.
        attention_mask: ``[B, past + S]`` (1 = attend) when rows are padded; None for one unpadded row.
        slice_size: process the suffix in slices of this many tokens (bounded activation memory); the
            result equals a single forward up to float rounding.

    Returns:
        ``[B, V]`` logits at the last suffix position.
    """
    length = input_ids.shape[1]
    step = slice_size or length
    past = cache.get_seq_length()
    extra = {"logits_to_keep": 1} if traits.logits_to_keep else {}
    logits = None
    for start in range(0, length, step):
        end = min(start + step, length)
        mask = attention_mask[:, : past + end] if attention_mask is not None else None
        out = model(
            input_ids=input_ids[:, start:end],
            position_ids=position_ids[:, start:end],
            attention_mask=mask,
            **cache_kwargs(model, cache),
            use_cache=True,
            **extra,
        )
        logits = out.logits[:, -1]
    assert logits is not None, "prefill needs at least one token"
    return logits


def decode_step(
    model: PreTrainedModel,
    cache: DynamicCache,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed one token per row (``tokens``/``positions`` ``[B, 1]``); return ``[B, V]`` next-token logits."""
    out = model(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=attention_mask,
        **cache_kwargs(model, cache),
        use_cache=True,
    )
    return out.logits[:, -1]
