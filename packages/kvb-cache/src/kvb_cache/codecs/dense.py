"""The identity codec: KV stored as computed (fp32/bf16/fp16), bit-exact."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvb_cache.codecs.base import LayerPair, TensorMap, layer_names


class DenseCodec:
    """No compression. Encoding returns views of the inputs (no copy); decoding returns the stored tensors."""

    name = "none"
    exact = True

    def encode(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for layer, (keys, values) in enumerate(kv):
            k_name, v_name = layer_names(layer)
            out[k_name], out[v_name] = keys.contiguous(), values.contiguous()
        return out

    def decode_layer(self, tensors: TensorMap, layer: int, *, tokens: int, dtype: torch.dtype) -> LayerPair:
        k_name, v_name = layer_names(layer)
        return LayerPair(tensors[k_name].to(dtype), tensors[v_name].to(dtype))
