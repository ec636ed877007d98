"""Which decoder-layer linears stay on the device and which are streamed, per residency mode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NewType

from torch import nn

from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import AWQFormatError, StreamingConfigError

LayerIndex = NewType("LayerIndex", int)

# Module-name prefix of the feed-forward block in Llama-family decoder layers (Llama, Mistral, Qwen2, ...).
FFN_PREFIX = "mlp."


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.get_decoder().layers``: the decoder layers of a Llama-family causal LM.

    Raises:
        AWQFormatError: the model has another layout (GPT-2's ``transformer.h``, encoder-decoders, ...).
    """
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, nn.ModuleList):
        raise AWQFormatError(
            f"{type(model).__name__} has no model.get_decoder().layers; kvb-streaming supports Llama-family "
            "layouts (Llama, Mistral, Qwen2, ...)"
        )
    return layers


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyPlan:
    """The streamed linears of each decoder layer; everything not listed is resident.

    Attributes:
        streamed: layer index -> names (relative to the layer, e.g. ``"mlp.up_proj"``) of its streamed linears,
            for layers that stream anything, in execution order.
    """

    streamed: Mapping[LayerIndex, tuple[str, ...]]

    @property
    def streamed_layers(self) -> tuple[LayerIndex, ...]:
        return tuple(self.streamed)

    def is_streamed(self, layer: LayerIndex, linear: str) -> bool:
        return linear in self.streamed.get(layer, ())


def check_kept_layers(config: StreamingConfig, n_layers: int) -> None:
    """Raises ``StreamingConfigError`` when ``keep_first_k + keep_last_k`` exceeds ``n_layers``."""
    if config.keep_first_k + config.keep_last_k > n_layers:
        raise StreamingConfigError(
            f"keep_first_k + keep_last_k = {config.keep_first_k + config.keep_last_k} exceeds the model's "
            f"{n_layers} decoder layers; lower them, or use residency_mode='full_resident'"
        )


def plan_residency(config: StreamingConfig, linears_per_layer: Sequence[Sequence[str]]) -> ResidencyPlan:
    """Applies ``config.residency_mode`` to a model.

    Args:
        config: the streaming configuration.
        linears_per_layer: for each decoder layer in execution order, the names of its quantized linears.

    Raises:
        StreamingConfigError: ``keep_first_k + keep_last_k`` exceeds the number of layers.
    """
    n_layers = len(linears_per_layer)
    check_kept_layers(config, n_layers)
    if config.residency_mode == "full_resident":
        return ResidencyPlan(streamed={})
    kept = set(range(config.keep_first_k)) | set(range(n_layers - config.keep_last_k, n_layers))
    streamed: dict[LayerIndex, tuple[str, ...]] = {}
    for index, names in enumerate(linears_per_layer):
        if index in kept:
            continue
        if config.residency_mode == "ffn_only_stream":
            chosen = tuple(name for name in names if name.startswith(FFN_PREFIX))
        else:
            chosen = tuple(names)
        if chosen:
            streamed[LayerIndex(index)] = chosen
    if config.residency_mode == "ffn_only_stream" and not streamed and len(kept) < n_layers:
        # NOTE: e.g. Mixtral in transformers 5 keeps its experts as fused parameters, not nn.Linear under
        # "mlp.": the mode would silently stream nothing and load every weight on the device.
        raise StreamingConfigError(
            f"residency_mode='ffn_only_stream' found no quantized feed-forward linear (under {FFN_PREFIX!r}) in "
            "the streamed layers of this model; use 'partial_resident' or 'full_stream'"
        )
    return ResidencyPlan(streamed=streamed)
