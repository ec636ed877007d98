"""What the engine needs to know about a model, and which models it declines."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

from transformers import PreTrainedModel

from kvb_cache.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

# Attention layer kinds whose KV is a plain per-token key/value cache the engine can slice and reuse.
_KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelTraits:
    num_layers: int
    #: Longest prompt + output the model accepts (None: unknown / unbounded).
    context_length: int | None
    #: Learned absolute position embeddings (GPT-2): prefix reuse is exact, re-positioning impossible.
    absolute_positions: bool
    #: Sliding-window size of local-attention layers, if any.
    sliding_window: int | None
    #: The forward accepts ``logits_to_keep`` (skip the LM head on all but the last prompt position).
    logits_to_keep: bool


def inspect_model(model: PreTrainedModel) -> ModelTraits:
    """Read a model's traits; raise :class:`UnsupportedModelError` for models whose cache is not plain KV."""
    config = model.config.get_text_config(decoder=True)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; KVBoost serves decoder-only causal LMs."
        )
    layer_types = getattr(config, "layer_types", None) or ()
    unsupported = sorted(set(layer_types) - _KV_LAYER_TYPES)
    if unsupported:
        raise UnsupportedModelError(
            f"{type(model).__name__} has {unsupported} layers whose cache is not a per-token key/value cache; "
            "chunk reuse is only defined for full and sliding-window attention."
        )
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not num_layers:
        raise UnsupportedModelError(f"cannot tell how many decoder layers {type(model).__name__} has")
    context = next(
        (getattr(config, f) for f in _CONTEXT_FIELDS if isinstance(getattr(config, f, None), int)), None
    )
    sliding = (
        getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types or not layer_types
        else None
    )
    if sliding:
        logger.info(
            "%s uses sliding-window attention (window %d): the engine keeps full KV for every layer and lets "
            "the model's sliding mask limit attention, so reuse stays exact.",
            type(model).__name__,
            sliding,
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    absolute = rope is None and hasattr(config, "n_positions")
    params = inspect.signature(model.forward).parameters
    return ModelTraits(
        num_layers=int(num_layers),
        context_length=context,
        absolute_positions=absolute,
        sliding_window=sliding if isinstance(sliding, int) else None,
        logits_to_keep="logits_to_keep" in params,
    )
