"""Forward passes that extend a ``transformers.Cache``, and rollback of rejected draft positions."""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from kvb_speculative.errors import CacheRollbackError


def extend(model: PreTrainedModel, cache: Cache, tokens: torch.Tensor) -> torch.Tensor:
    """Run ``model`` over ``tokens`` after the positions already in ``cache``, appending their KV to it.

    Args:
        model: a Hugging Face causal LM.
        cache: KV for the ``P`` positions before ``tokens``; grows to ``P + n`` in place.
        tokens: ``[n]`` int64 token ids, ``n >= 1``.

    Returns:
        ``[n, V]`` float32 logits; row ``i`` predicts the token that follows ``tokens[i]``.
    """
    start = cache.get_seq_length()
    n = tokens.shape[0]
    device = cache_device(model)
    input_ids = tokens.to(device).unsqueeze(0)
    position_ids = torch.arange(start, start + n, device=device).unsqueeze(0)
    # no_grad rather than inference_mode: the engine owns the cache and may edit its tensors in place later.
    with torch.no_grad():
        out = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids, use_cache=True)
    return out.logits[0].float()


def cache_device(model: PreTrainedModel) -> torch.device:
    """Where ``model`` takes its inputs (its input embeddings' device; cheaper than ``model.device``)."""
    return model.get_input_embeddings().weight.device


def rollback(cache: Cache, length: int) -> None:
    """Cut ``cache`` back to its first ``length`` positions (no-op when it is not longer).

    Raises:
        CacheRollbackError: the cache type cannot drop positions (e.g. a sliding-window layer past its
            window that does not record its past); use a ``DynamicCache``.
    """
    excess = cache.get_seq_length() - length
    if excess <= 0:
        return
    # NOTE: a negative argument means "remove this many positions" in every transformers 5.x release;
    # a positive one is an absolute length in older releases and rejected by newer ones.
    try:
        cache.crop(-excess)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        raise CacheRollbackError(
            f"{type(cache).__name__} cannot drop its last {excess} positions ({exc}); speculative decoding "
            "needs a cache that can be cropped, e.g. transformers.DynamicCache."
        ) from exc
    if cache.get_seq_length() != length:
        raise CacheRollbackError(
            f"{type(cache).__name__}.crop left {cache.get_seq_length()} positions instead of {length}; "
            "use transformers.DynamicCache."
        )
