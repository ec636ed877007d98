"""What the engine needs to know about a model, and which models it declines."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from kvb_cache.cache_kwarg import cache_argument
from kvb_cache.errors import ConfigError, UnsupportedModelError
from kvb_cache.kv_sharing import kv_sources

logger = logging.getLogger(__name__)

# Attention layer kinds whose KV is a plain per-token key/value cache the engine can slice and reuse
# (chunked attention, Llama 4's local layers, is full attention inside fixed chunks: only the mask differs).
_KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# transformers' layer kinds (``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING``) whose cache is a recurrent state:
# state-space (Mamba), linear attention (DeltaNet, lightning), short convolutions (LFM2), or both a state and
# KV ("hybrid": Falcon-H1, Zamba2).
_RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
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
    #: Positions and packed forwards must stay below this many tokens (Llama 4's temperature tuning reads a
    #: token's index in the forward call as its position; below the limit that makes no difference). None:
    #: no such limit.
    position_limit: int | None = None
    #: Why ``context_length`` is below the model's own window (shown in every ContextLengthError); None: it is not.
    context_reason: str | None = None
    #: Per decoder layer, the layer whose keys/values it attends (Gemma 3n / Gemma 4 E2B share the last
    #: layers' KV, :mod:`kvb_cache.kv_sharing`); None: every layer attends its own.
    kv_sources: tuple[int, ...] | None = None

    @property
    def kv_layers(self) -> int:
        """Layers that hold keys/values of their own: what the pool, chunk store and tiers keep per token
        (the first ``kv_layers`` layers; KV-shared layers come after them)."""
        return (
            self.num_layers if self.kv_sources is None else sum(s == i for i, s in enumerate(self.kv_sources))
        )


def cap_context(traits: ModelTraits, max_model_len: int | None) -> ModelTraits:
    """``traits`` with the context held to ``max_model_len`` (vLLM's option: a smaller context than the
    model's, e.g. to bound one request's KV); None leaves it.

    Raises:
        ConfigError: ``max_model_len`` is above what the engine serves for this model (its window, or the
            smaller exact limit ``context_reason`` explains): positions past it were never trained (vLLM
            refuses it too unless told to allow it).
    """
    if max_model_len is None:
        return traits
    limit = traits.context_length
    if limit is not None and max_model_len > limit:
        raise context_exceeded(max_model_len, limit, traits.context_reason)
    if limit == max_model_len:
        return traits
    reason = f"max_model_len={max_model_len} (--max-model-len) limits it"
    if limit is not None:
        reason += f"; the model's context is {limit} tokens"
    return replace(traits, context_length=max_model_len, context_reason=reason)


def context_exceeded(max_model_len: int, limit: int, reason: str | None = None) -> ConfigError:
    """The error of a ``max_model_len`` above the context the engine serves for a model (``reason``: why
    that is below the model's own window)."""
    why = f" ({reason})" if reason else ""
    return ConfigError(
        f"max_model_len={max_model_len} (--max-model-len) exceeds the model's context of {limit} tokens{why}: "
        "lower it or leave it unset"
    )


def inspect_model(model: PreTrainedModel) -> ModelTraits:
    """Read a model's traits; raise :class:`UnsupportedModelError` for models whose cache is not plain KV."""
    compiled = getattr(model, "_orig_mod", None)
    if isinstance(compiled, torch.nn.Module):
        # torch.compile(model) wraps it in an OptimizedModule whose forward hides the cache argument: it was
        # refused as a model "that keeps its own recurrent state (RWKV's state, ...)".
        raise UnsupportedModelError(
            f"{type(compiled).__name__} was passed compiled (torch.compile(model)); pass the model itself. "
            "model.compile() keeps the model object and works, but the engine's cache routing breaks the "
            "graph (dynamo falls back to eager), so it is no faster"
        )
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; KVBoost serves decoder-only causal LMs."
        )
    layer_types = getattr(config, "layer_types", None) or ()
    recurrent = sorted(set(layer_types) & _RECURRENT_LAYER_TYPES)
    if recurrent:
        raise UnsupportedModelError(
            f"{name} has {recurrent} layers whose cache is a recurrent state of the whole prefix (state space, "
            "linear attention or convolution), not a per-token key/value cache: a cached prefix cannot be "
            "reused block by block, nor a chunk moved. KVBoost serves models whose every layer is attention."
        )
    params = inspect.signature(model.forward).parameters
    if cache_argument(model) is None:
        cache = params.get("cache")
        held = (
            f"its `cache` argument is {getattr(cache.annotation, '__name__', None) or cache.annotation}, not a "
            "transformers Cache"
            if cache is not None
            else "its forward takes no `past_key_values` / `cache`"
        )
        raise UnsupportedModelError(
            f"{name} keeps no transformers Cache of per-token keys/values ({held}): either a recurrent state "
            "of the whole prefix (RWKV, xLSTM) or no cache at all (OpenAI-GPT, XLNet, Reformer's own), so a "
            "cached prefix cannot be reused block by block."
        )
    unsupported = sorted(set(layer_types) - _KV_LAYER_TYPES)
    if unsupported:
        raise UnsupportedModelError(
            f"{name} has {unsupported} layers whose cache is not a per-token key/value cache; "
            "chunk reuse is only defined for full, sliding-window and chunked attention."
        )
    # Llama 4's attention temperature tuning scales its NoPE layers' queries by a factor of each token's
    # position, which it counts from `past_key_values`; the engine's packed forward passes none, so the model
    # takes a token's index in the packed batch for its position. Below `floor_scale` the factor is exactly 1
    # either way: served exactly with positions and packed forwards kept below it.
    position_limit = None
    if getattr(config, "attn_temperature_tuning", False) and 0 in (
        getattr(config, "no_rope_layers", None) or ()
    ):
        position_limit = int(config.floor_scale) - 1
        logger.warning(
            "%s scales its NoPE layers' queries by position from %d tokens on (attention temperature tuning), "
            "counted from past_key_values, which the engine's packed forward does not pass: context capped at "
            "%d tokens and each packed forward kept below it, where the factor is 1 and the engine is exact.",
            name,
            position_limit + 1,
            position_limit,
        )
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not num_layers:
        raise UnsupportedModelError(f"cannot tell how many decoder layers {name} has")
    context = declared_context(config)
    sliding = (
        getattr(config, "sliding_window", None)
        if "sliding_attention" in layer_types or not layer_types
        else None
    )
    if sliding:
        logger.info(
            "%s uses sliding-window attention (window %d): the engine keeps full KV for every layer and lets "
            "the model's sliding mask limit attention, so reuse stays exact.",
            name,
            sliding,
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    # GPT-J / CodeGen also carry n_positions, but rotate keys (``rotary_dim``): not absolute embeddings.
    absolute = rope is None and hasattr(config, "n_positions") and not getattr(config, "rotary_dim", None)
    if position_limit is not None:
        context = min(context, position_limit) if context else position_limit
    reason = None
    short = _longrope_original_length(config)
    if short is not None and (context is None or context > short):
        # LongRoPE picks its short or long frequencies from the longest position of each forward call, so
        # a key's rotation depends on how far that call reached: a block cached by a short request is not
        # what a long request would compute, and one packed step mixing both would rotate the short one's
        # keys with the long factors. Below the switch every forward uses the short factors: exact.
        reason = (
            f"{name} uses LongRoPE, whose frequencies switch at {short} tokens "
            "(original_max_position_embeddings) depending on each forward's length, which cached and "
            "batched prefixes cannot follow; KVBoost serves it exactly up to that length"
        )
        logger.warning("%s: context capped at %d tokens.", reason, short)
        context = short
    try:
        sources = kv_sources(config, int(num_layers))
    except ValueError as exc:
        raise UnsupportedModelError(f"{name}: {exc}") from exc
    return ModelTraits(
        num_layers=int(num_layers),
        kv_sources=sources if sources != tuple(range(int(num_layers))) else None,
        context_length=context,
        context_reason=reason,
        position_limit=position_limit,
        absolute_positions=absolute,
        sliding_window=sliding if isinstance(sliding, int) else None,
        logits_to_keep="logits_to_keep" in params,
    )


def declared_context(config: object) -> int | None:
    """The context a model's config declares (``max_position_embeddings`` or its older names), of its text
    decoder for a multimodal config; None when it declares none.

    YaRN extends it to ``original_max_position_embeddings`` (else ``max_position_embeddings``) times its
    ``factor``, vLLM's derivation of ``max_model_len``, when that is larger (Qwen2.5 / Qwen3 with the YaRN block their model cards add:
    32768 -> 131072; capped at 32768 those long prompts were refused). YaRN's rotation does not depend on a
    request's length, so reuse stays exact; other scalings are left as declared (a per-layer-type dict such
    as Gemma 3's already counts its linear factor in ``max_position_embeddings``; LongRoPE is capped below)."""
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config(decoder=True)
    context = next(
        (getattr(config, f) for f in _CONTEXT_FIELDS if isinstance(getattr(config, f, None), int)), None
    )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if context is None or not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "yarn":
        return context
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings") or context
    if (
        isinstance(factor, (int, float))
        and not isinstance(factor, bool)
        and factor > 1
        and isinstance(original, int)
    ):
        return max(context, int(original * factor))
    return context


def _longrope_original_length(config: object) -> int | None:
    """``original_max_position_embeddings`` of a LongRoPE model (any layer type); None for other RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # Per-layer-type models (Gemma 3) hold one parameter dict per layer type.
    groups = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    lengths = [
        g.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        for g in groups
        if isinstance(g, dict) and g.get("rope_type", g.get("type")) == "longrope"
    ]
    lengths = [n for n in lengths if isinstance(n, int)]
    return min(lengths) if lengths else None
