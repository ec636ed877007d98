"""KIVI-style asymmetric int8/int4 KV quantization: keys per channel, values per token.

Keys have a few outlier *channels* (RoPE dims with large magnitudes), so each key channel gets its own
scale and zero point over a group of ``group_size`` consecutive tokens. Values have no channel outliers but
vary per token, so each token gets its own scale and zero point over ``group_size`` consecutive channels
(Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

Memory per element, scales and zero points in fp16: ``bits + 32 / group_size`` bits, against 16 for fp16:
int8 g32 = 9 bits (1.78x smaller than fp16), int4 g32 = 5 bits (3.2x), int8 g128 = 8.25 bits (1.94x),
int4 g128 = 4.25 bits (3.76x). Against fp32 KV the ratios double. The engine's disk/Redis records hold one
``block_size``-token block each, so its key groups span at most that many tokens (16 by default) whatever
``group_size`` says, and each record carries a header: measured on SmolLM2, its int8 / int4 records are
0.633x / 0.383x the bytes of the block's fp16 KV (docs/tiers.md). Scales and zero points are fp32 where fp16
cannot hold them (:func:`kvb_cache.codecs.packing.stats_dtype`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvb_cache.codecs.base import LayerPair, TensorMap, layer_names
from kvb_cache.codecs.packing import Quantized, dequantize_groups, quantize_groups
from kvb_cache.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class KiviCodec:
    """Asymmetric quantization with zero points (KIVI).

    Attributes:
        bits: 8 or 4 (4-bit codes are packed two per byte; ``head_dim`` must be even).
        group_size: tokens per key group (per channel) and channels per value group (per token). A value
            group that does not divide ``head_dim`` falls back to one group per token; a key group longer
            than the chunk is padded by repeating the last token (which leaves min/max unchanged).
    """

    bits: int = 8
    group_size: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in (4, 8):
            raise ConfigError(f"KIVI bits must be the int 8 or 4, got {self.bits!r}")
        group = self.group_size
        if isinstance(group, bool) or not isinstance(group, int) or group < 2:
            raise ConfigError(f"group_size must be an int >= 2 (32 or 128 are typical), got {group!r}")
        if self.bits == 4 and group % 2:
            raise ConfigError(
                f"4-bit KIVI packs two codes per byte within a group: group_size must be even, got {group}"
            )

    @property
    def name(self) -> str:
        return f"kivi{self.bits}-g{self.group_size}"

    @property
    def exact(self) -> bool:
        return False

    def encode(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for layer, (keys, values) in enumerate(kv):
            k_name, v_name = layer_names(layer)
            for prefix, q in ((k_name, self.encode_keys(keys)), (v_name, self.encode_values(values))):
                out[f"{prefix}.q"], out[f"{prefix}.scale"], out[f"{prefix}.min"] = q
        return out

    def decode_layer(self, tensors: TensorMap, layer: int, *, tokens: int, dtype: torch.dtype) -> LayerPair:
        k_name, v_name = layer_names(layer)
        kq = Quantized(tensors[f"{k_name}.q"], tensors[f"{k_name}.scale"], tensors[f"{k_name}.min"])
        vq = Quantized(tensors[f"{v_name}.q"], tensors[f"{v_name}.scale"], tensors[f"{v_name}.min"])
        return LayerPair(
            self.decode_keys(kq, tokens=tokens, dtype=dtype), self.decode_values(vq, dtype=dtype)
        )

    def decode_keys(self, q: Quantized, *, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`encode_keys`: ``[B, H, T/G, G, D]`` groups -> ``[B, H, tokens, D]``."""
        return dequantize_groups(q, self.bits, dtype).flatten(2, 3)[:, :, :tokens]

    def decode_values(self, q: Quantized, *, dtype: torch.dtype) -> torch.Tensor:
        """Inverse of :meth:`encode_values`: ``[B, H, T, D/g, g]`` groups -> ``[B, H, T, D]``."""
        return dequantize_groups(q, self.bits, dtype).flatten(-2)

    def encode_keys(self, keys: torch.Tensor) -> Quantized:
        """Keys ``[B, H, T, D]`` quantized per channel over groups of G tokens (KIVI)."""
        # [B, H, T, D] -> pad T to a multiple of G -> [B, H, T/G, G, D], stats over the G tokens.
        b, h, t, d = keys.shape
        g = min(self.group_size, t)  # a chunk shorter than a group is one group, not padded to group_size
        pad = -t % g
        if pad:
            keys = torch.cat([keys, keys[:, :, -1:].expand(b, h, pad, d)], dim=2)
        return quantize_groups(keys.reshape(b, h, (t + pad) // g, g, d), self.bits, dim=3)

    def encode_values(self, values: torch.Tensor) -> Quantized:
        """Values ``[B, H, T, D]`` quantized per token over groups of g channels (KIVI)."""
        # [B, H, T, D] -> [B, H, T, D/g, g], stats over g channels of each token.
        b, h, t, d = values.shape
        g = self.group_size if d % self.group_size == 0 else d
        return quantize_groups(values.reshape(b, h, t, d // g, g), self.bits, dim=4)
