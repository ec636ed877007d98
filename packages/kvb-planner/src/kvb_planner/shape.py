"""The memory-relevant dimensions of a decoder-only model, read from a Hugging Face config or model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from kvb_planner.errors import PlannerConfigError

#: Attention implementation of a hand-built ``ModelShape`` that names none (transformers' default for most
#: architectures). ``from_config`` resolves a config that names none through its model class instead
#: (:func:`_default_attn_implementation`).
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
#: Config fields that hold a model's context length, in the order kvb-cache's ``model_traits`` reads them.
CONTEXT_LENGTH_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _dtype_bytes(dtype: Any) -> int:
    if dtype is None:
        return 4  # transformers builds fp32 weights when a config names no dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise PlannerConfigError(f"unknown dtype {dtype!r}; pass a torch.dtype such as torch.bfloat16")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise PlannerConfigError(f"dtype must be a torch.dtype or its name, got {type(dtype).__name__}")
    return torch.empty((), dtype=dtype).element_size()


def _require(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int):
        raise PlannerConfigError(
            f"config has no integer {name!r}; ModelShape.from_config expects a decoder-only transformers config "
            "(Llama/Mistral/Qwen-style). Build a ModelShape(...) by hand for other architectures."
        )
    return value


def _text_config(config: Any) -> Any:
    """The decoder's config: ``text_config`` of a multimodal config (Gemma 3, Llava, ...), else ``config``."""
    text = None
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        try:
            text = get_text_config(decoder=True)
        except TypeError:  # an older transformers without the keyword
            text = get_text_config()
    text = text if text is not None else getattr(config, "text_config", None)
    return text if text is not None else config


def _attr(config: Any, name: str) -> Any:
    """``config.name``, or None when it has none or refuses to give one global value (transformers 5.2x
    raises for attributes that vary by layer, such as Gemma 4's ``head_dim``)."""
    try:
        return getattr(config, name, None)
    except Exception:  # AmbiguousGlobalPerLayerAttributeError (a RuntimeError) and the like
        return None


def _optional_size(config: Any, name: str) -> int | None:
    """An optional positive int field (None when absent or None). A string (a hand-edited config.json) was
    a TypeError deep in the arithmetic, and an explicit 0 KV heads was silently read as MHA."""
    value = _attr(config, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlannerConfigError(f"config {name} must be a positive int or absent, got {value!r}")
    return value


def _layer_mlp_widths(text: Any, layers: int) -> list[int]:
    """Per decoder layer, the MLP width: ``intermediate_size``, an int or (Gemma 3n) one int per layer."""
    value = _attr(text, "intermediate_size")
    if (
        isinstance(value, (list, tuple))
        and len(value) == layers
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return list(value)
    if value is None and hasattr(text, "n_inner"):
        # GPT-2 / GPT-J / CodeGen name it n_inner (None: 4 x hidden); GPT-2 is served (absolute positions:
        # exact prefix reuse), and its gate refused to plan it. Their MLP is not gated (two matrices, not
        # three): planned as gated, its activations are over-counted by a third, on the safe side.
        width = _optional_size(text, "n_inner")
        return [width if width is not None else 4 * _require(text, "hidden_size")] * layers
    return [_require(text, "intermediate_size")] * layers


def _layer_heads(text: Any, layers: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """Per decoder layer, ``(KV heads, head dim)``: from ``per_layer_config`` (transformers' per-layer view
    of heterogeneous configs), else Gemma 4's ``global_head_dim`` / ``num_global_key_value_heads`` on its
    full-attention layers (older transformers), else every layer alike."""
    views = _attr(text, "per_layer_config")
    if views is not None:
        try:
            heads = [
                (_attr(v, "num_key_value_heads") or kv_heads, _attr(v, "head_dim") or head_dim) for v in views
            ]
        except TypeError:  # not a sequence of configs
            heads = []
        if len(heads) == layers and all(isinstance(h, int) and isinstance(d, int) for h, d in heads):
            return heads
    global_dim = _attr(text, "global_head_dim")
    types = _attr(text, "layer_types") or ()
    if isinstance(global_dim, int) and len(types) == layers:
        global_heads = _attr(text, "num_global_key_value_heads")
        if not (_attr(text, "attention_k_eq_v") and isinstance(global_heads, int)):
            global_heads = kv_heads
        return [(global_heads, global_dim) if t == "full_attention" else (kv_heads, head_dim) for t in types]
    return [(kv_heads, head_dim)] * layers


def _context_length(text: Any, config: Any) -> int | None:
    """The first positive int among :data:`CONTEXT_LENGTH_FIELDS`, read from the decoder's config ``text``
    (:func:`_text_config`) and else from ``config`` itself, extended by YaRN (:func:`_yarn_context`); None
    when no field holds one."""
    for source in (text, config):
        for name in CONTEXT_LENGTH_FIELDS:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return _yarn_context(text, value)
    return None


def _yarn_context(text: Any, declared: int) -> int:
    """``declared`` extended as kvb-cache's ``model_traits.declared_context`` and vLLM's ``max_model_len``
    extend it: a YaRN block (Qwen2.5 / Qwen3 model cards add one) makes the context
    ``original_max_position_embeddings`` (else ``declared``) times its ``factor`` when that is larger.
    Without it a standalone plan refused a 64k-token prompt that the engine serves (32768 -> 131072); the
    rule is restated here because kvb-planner does not depend on kvb-cache. Only YaRN: the engine's caps
    below the declared context (LongRoPE's original length, chunked-attention models) are not applied."""
    rope = _attr(text, "rope_parameters") or _attr(text, "rope_scaling")
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type")) != "yarn":
        return declared
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings") or declared
    if (
        isinstance(factor, (int, float))
        and not isinstance(factor, bool)
        and factor > 1
        and isinstance(original, int)
    ):
        return max(declared, int(original * factor))
    return declared


#: ModelShape sizes that must be >= 1 (``dtype_bytes`` and ``weight_bytes`` are checked on their own).
_POSITIVE_SIZES = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """Dimensions that drive memory use. Build with :meth:`from_config` or :meth:`from_model`.

    Attributes:
        num_layers: Decoder layers, each holding its own K and V.
        hidden_size: Residual stream width ``H``.
        num_attention_heads: Query heads ``Hq``.
        num_kv_heads: Key/value heads ``Hkv`` (``< Hq`` under grouped-query attention).
        head_dim: Per-head width ``d``; K and V per token and layer are ``[Hkv, d]`` each.
        intermediate_size: MLP width ``I`` (gate/up projections).
        vocab_size: Logit width ``V``.
        dtype_bytes: Bytes per weight/activation element (4 fp32, 2 bf16/fp16).
        weight_bytes: Parameter bytes (tied weights counted once).
        attn_implementation: transformers' attention backend name (``"sdpa"``, ``"eager"``, ...); decides
            whether attention scores are materialised.
        context_length: Most prompt + generated tokens one request may take (the model's context window),
            or None when unknown: then :func:`~kvb_planner.plan` checks no context. :meth:`from_config` reads
            ``max_position_embeddings`` (or ``n_positions`` / ``max_sequence_length`` / ``seq_length``, also
            inside a multimodal config's ``text_config``). It is a fact of the model, so it lives here, not
            on the request; to plan against a tighter limit (an engine whose KV pool holds fewer tokens,
            e.g. ``KVBoost.context_length``), override it: ``dataclasses.replace(shape, context_length=n)``.
        kv_layer_channels: Per layer that holds keys/values of its own, ``(key channels, value channels)`` per
            token (``kv_heads x key_dim``, ``kv_heads x value_dim``), for models whose layers differ: Gemma 4's
            global layers (a wider head, fewer KV heads), Gemma 3n / Gemma 4 E2B (the last
            ``num_kv_shared_layers`` layers hold none). None: ``num_layers`` layers of ``num_kv_heads x
            head_dim`` each. :meth:`from_config` sets it for KV-shared configs; an engine's measured pool
            shapes give the exact one (``kvb_server.PlannerGate.for_engine`` uses them).
        weight_transient_bytes: Bytes a forward materializes from the weights at once, on top of its
            activations: a quantized model whose kernel dequantizes a block of a linear's weight per call
            (kvb-streaming's ``"torch"`` int4 kernel: its ``StreamingRuntime.transient_bytes``, at most
            ``dequant_chunk_bytes``). 0 for weights used as stored. Charged once per estimate, during
            whichever phase peaks.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    weight_bytes: int
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
    context_length: int | None = None
    kv_layer_channels: tuple[tuple[int, int], ...] | None = None
    weight_transient_bytes: int = 0

    def __post_init__(self) -> None:
        # Every size is checked to be an int first: a float (num_layers=1.5) was accepted and gave fractional
        # byte counts, a string ("2", as read from a JSON file by hand) failed with a bare TypeError.
        for name in (*_POSITIVE_SIZES, "dtype_bytes", "weight_bytes", "weight_transient_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlannerConfigError(f"{name} must be an int, got {value!r}")
        for name in _POSITIVE_SIZES:
            if getattr(self, name) < 1:
                raise PlannerConfigError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_attention_heads % self.num_kv_heads:
            raise PlannerConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise PlannerConfigError(f"dtype_bytes must be 1, 2, 4 or 8 (got {self.dtype_bytes})")
        for name in ("weight_bytes", "weight_transient_bytes"):
            if getattr(self, name) < 0:
                raise PlannerConfigError(f"{name} must be >= 0 (got {getattr(self, name)})")
        channels = self.kv_layer_channels
        if channels is not None and (
            not isinstance(channels, tuple)
            or not channels
            or any(
                not isinstance(pair, tuple)
                or len(pair) != 2
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in pair)
                for pair in channels
            )
        ):
            raise PlannerConfigError(
                "kv_layer_channels must be a non-empty tuple of (key channels, value channels) int pairs >= 1, "
                f"got {channels!r}"
            )
        ctx = self.context_length
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1):
            raise PlannerConfigError(
                f"context_length must be an int >= 1 or None (unknown: no context check), got {ctx!r}"
            )

    @property
    def layer_channels(self) -> tuple[tuple[int, int], ...]:
        """Per layer holding KV, ``(key channels, value channels)`` per token: ``kv_layer_channels``, or
        ``num_layers`` times ``(Hkv * d, Hkv * d)``."""
        if self.kv_layer_channels is not None:
            return self.kv_layer_channels
        width = self.num_kv_heads * self.head_dim
        return ((width, width),) * self.num_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Unquantized K+V bytes for one token across all layers: ``2 * L * Hkv * d * dtype_bytes`` when
        every layer is alike, else the sum of ``kv_layer_channels``."""
        return sum(k + v for k, v in self.layer_channels) * self.dtype_bytes

    @classmethod
    def from_config(
        cls, config: Any, *, dtype: torch.dtype | str | None = None, attn_implementation: str | None = None
    ) -> ModelShape:
        """Read a transformers decoder config (``LlamaConfig``, ``MistralConfig``, ...).

        ``weight_bytes`` is computed from the Llama layout (embeddings, q/k/v/o, gated MLP, two norms per
        layer, untied ``lm_head`` when ``tie_word_embeddings`` is false); biases are ignored. Use
        :meth:`from_model` for an exact count. ``context_length`` is the config's ``max_position_embeddings``
        extended by YaRN as the engine extends it (see :class:`ModelShape`), None when the config has none.

        Args:
            config: A transformers ``PretrainedConfig`` (any object with the same attributes).
            dtype: Element type the model runs in; defaults to ``config.dtype``, else fp32.
            attn_implementation: Overrides ``config._attn_implementation`` (default ``"sdpa"``).
        """
        # A multimodal config (Gemma 3, Llava, ...) keeps the decoder's sizes in its text config; the
        # vision tower's weights are not counted here (from_model counts every parameter).
        text = _text_config(config)
        if isinstance(getattr(text, "kv_lora_rank", None), int):
            # Read as per-head K/V, a DeepSeek-V3 config gave 2 * 128 heads * 64 = 16384 elements per token
            # and layer, where transformers caches the 576-element latent (28x too much KV) and then expands
            # it for every layer's attention (a transient not modelled at all): wrong either way, so refused.
            raise PlannerConfigError(
                f"{type(text).__name__} uses multi-head latent attention (kv_lora_rank={text.kv_lora_rank}): "
                "its cache holds a latent of kv_lora_rank + qk_rope_head_dim elements per token and layer, "
                "expanded per layer for attention, which this memory model (per-head keys and values) does not "
                "describe. Build a ModelShape(...) by hand and check it against measured peaks, or serve without "
                "the planner (kvboost-server --no-oom-planning)"
            )
        hidden = _require(text, "hidden_size")
        heads = _require(text, "num_attention_heads")
        kv_heads = _optional_size(text, "num_key_value_heads") or heads  # absent / None: MHA
        layers = _require(text, "num_hidden_layers")
        head_dim = _optional_size(text, "head_dim") or hidden // heads
        layer_heads = _layer_heads(text, layers, kv_heads, head_dim)
        head_dim = max(d for _, d in layer_heads)  # the widest head sizes the attention phase
        widths = _layer_mlp_widths(text, layers)
        vocab = _require(text, "vocab_size")
        config_dtype = getattr(config, "dtype", None) or getattr(text, "dtype", None)
        elem = _dtype_bytes(dtype if dtype is not None else config_dtype)
        tied = getattr(text, "tie_word_embeddings", None)
        tied = getattr(config, "tie_word_embeddings", False) if tied is None else tied
        embeddings = vocab * hidden * (1 if tied else 2)
        params = embeddings + hidden
        for (h, d), inter in zip(layer_heads, widths):
            params += hidden * d * (2 * heads + 2 * h) + 3 * hidden * inter + 2 * hidden
        impl = (
            attn_implementation
            or getattr(config, "_attn_implementation", None)
            or _default_attn_implementation(config)
        )
        # Gemma 3n / Gemma 4 E2B: the last num_kv_shared_layers layers attend to an earlier layer's
        # keys/values and cache none (transformers gives them a DummyLayer).
        shared = _attr(text, "num_kv_shared_layers")
        own = layers - shared if isinstance(shared, int) and 0 < shared < layers else layers
        channels = tuple((h * d, h * d) for h, d in layer_heads[:own])
        uniform = own == layers and set(layer_heads) == {(kv_heads, head_dim)}
        return cls(
            kv_layer_channels=None if uniform else channels,
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=max(widths),  # the widest MLP sizes the MLP phase
            vocab_size=vocab,
            dtype_bytes=elem,
            weight_bytes=params * elem,
            attn_implementation=impl,
            context_length=_context_length(text, config),
        )

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        """Read ``model.config`` and count the actual parameter bytes (tied tensors once) and dtype."""
        seen: set[int] = set()
        weight_bytes = 0
        dtype = None
        for param in model.parameters():  # parameters() already skips tied duplicates; the set guards views
            if param.data_ptr() in seen:
                continue
            seen.add(param.data_ptr())
            weight_bytes += param.numel() * param.element_size()
            dtype = dtype or param.dtype
        return replace(cls.from_config(model.config, dtype=dtype), weight_bytes=weight_bytes)


def _default_attn_implementation(config: Any) -> str:
    """The attention a model built from ``config`` gets when the config names none.

    A config fresh from ``AutoConfig.from_pretrained`` names none, and transformers then picks per model
    class: SDPA where the class supports it, else eager (Gemma 2, gpt-oss: soft-capping / sinks). Planned as
    SDPA, a Gemma 2 prefill's ``[B, H, P, P]`` fp32 scores went uncharged (0.08x of the measured peak). An
    architecture this cannot resolve (no transformers, a model type it does not map) is charged as eager,
    the costlier rule.
    """
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return "eager"
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
