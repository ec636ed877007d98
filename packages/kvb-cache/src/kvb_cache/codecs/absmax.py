"""Per-group absmax int8: the wire codec for sending KV over a network.

Symmetric, one fp16 scale per ``(token, head)`` vector (group = ``head_dim``): cheap to encode and decode
on any device, ``8 + 16 / head_dim`` bits per element (8.25 for head_dim 64: 1.94x smaller than fp16,
3.88x smaller than fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvb_cache.codecs.base import LayerPair, TensorMap, layer_names


class AbsmaxInt8Codec:
    """``q = round(x / s)`` with ``s = max|x| / 127`` per head_dim vector; ``x' = q * s``."""

    name = "absmax8"
    exact = False

    def encode(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for layer, pair in enumerate(kv):
            for prefix, x in zip(layer_names(layer), pair):
                # [1, H, T, D] -> scale [1, H, T, 1]
                scale = (x.float().abs().amax(dim=-1, keepdim=True) / 127).to(torch.float16)
                safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
                out[f"{prefix}.q"] = torch.round(x.float() / safe).clamp_(-127, 127).to(torch.int8)
                out[f"{prefix}.scale"] = scale
        return out

    def decode_layer(self, tensors: TensorMap, layer: int, *, tokens: int, dtype: torch.dtype) -> LayerPair:
        k_name, v_name = layer_names(layer)
        k, v = (
            (tensors[f"{p}.q"].float() * tensors[f"{p}.scale"].float()).to(dtype) for p in (k_name, v_name)
        )
        return LayerPair(k, v)
