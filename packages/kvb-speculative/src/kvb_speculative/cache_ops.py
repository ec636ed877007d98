"""Forward passes that extend a ``transformers.Cache``, and rollback of rejected draft positions."""

from __future__ import annotations

import functools
import inspect

import torch
import transformers
from transformers import Cache, DynamicCache, PreTrainedModel

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
        out = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=True, **cache_kwargs(model, cache)
        )
    return out.logits[0].float()


@functools.cache
def _cache_keyword(forward_type: type) -> str:
    # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns on every
    # call until 5.40); 5.0-5.23 know only ``past_key_values``. Read once per model class.
    return "cache" if "cache" in inspect.signature(forward_type.forward).parameters else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{keyword: cache}`` for ``model(..., **cache_kwargs(model, cache))`` on any transformers 5.x."""
    return {_cache_keyword(type(model)): cache}


def cache_device(model: PreTrainedModel) -> torch.device:
    """Where ``model`` takes its inputs (its input embeddings' device; cheaper than ``model.device``)."""
    return model.get_input_embeddings().weight.device


def _masks_cover_recorded_past() -> bool:
    # transformers 5.17 sizes a sliding-window layer's attention mask to the window, so a layer recording
    # its past (make_croppable) hands attention more keys than the mask has columns at the first rollback
    # past the window ("size of tensor a (9) must match ... b (8)"); 5.18 sizes it to what the layer holds.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 18)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model`` that speculative decoding can crop (with :func:`make_croppable` after
    the prefill): the model's own layer types (sliding-window layers bounded by their window). On
    transformers 5.17 and older, whose masks do not cover a sliding layer's recorded past, a cache of full
    layers instead: exact too, but it keeps every position (memory not bounded by the window)."""
    if _masks_cover_recorded_past():
        return DynamicCache(config=model.config)
    return DynamicCache()


def make_croppable(cache: Cache) -> None:
    """Let ``cache`` drop its newest positions even after a sliding window has filled.

    Call it after the prompt's prefill and before any draft enters the cache. transformers' sliding-window
    layers (``DynamicCache(config=...)`` of Mistral, gpt-oss, Gemma...) keep only their last ``window - 1``
    positions, so cropping a rejected draft past the window raises; recording their past (what
    transformers' own assisted decoding turns on after its prefill) keeps the positions a crop needs until
    :func:`rollback` trims the layer back to its window. A no-op for caches without sliding layers.
    """
    # NOTE: not before the prefill: a recording layer would hold the whole prompt until the first rollback.
    activate = getattr(cache, "activate_past_recording", None)
    if callable(activate):
        activate()


def _trim_recorded_past(cache: Cache) -> None:
    # crop(0) restricts a recording sliding layer to its window and is a no-op on every other layer type;
    # called only when some layer records, so caches that never saw make_croppable() are left alone.
    if any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", ())):
        cache.crop(0)


def rollback(cache: Cache, length: int) -> None:
    """Cut ``cache`` back to its first ``length`` positions (no-op when it is not longer).

    Layers that record their past (:func:`make_croppable`) are trimmed back to their window either way, so
    their memory stays bounded by the window plus one round of drafts.

    Raises:
        CacheRollbackError: the cache type cannot drop positions (e.g. a sliding-window layer past its
            window that does not record its past: call :func:`make_croppable` after the prefill, or use a
            ``DynamicCache()`` built without a config).
    """
    excess = cache.get_seq_length() - length
    if excess <= 0:
        _trim_recorded_past(cache)
        return
    # NOTE: a negative argument means "remove this many positions" in every transformers 5.x release;
    # a positive one is an absolute length in older releases and rejected by newer ones.
    try:
        cache.crop(-excess)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        raise CacheRollbackError(
            f"{type(cache).__name__} cannot drop its last {excess} positions ({exc}); speculative decoding "
            "needs a cache that can be cropped: call kvb_speculative.make_croppable(cache) after the prefill "
            "(sliding-window layers), or use transformers.DynamicCache()."
        ) from exc
    if cache.get_seq_length() != length:
        raise CacheRollbackError(
            f"{type(cache).__name__}.crop left {cache.get_seq_length()} positions instead of {length}; "
            "use transformers.DynamicCache."
        )
