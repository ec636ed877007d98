"""Per-request live KV quantization: one request's working cache held KIVI-quantized (``kv_cache_bits``).

A request run with ``kv_cache_bits=8`` or ``4`` keeps its *live* KV (the cache its forwards attend to) in
the KIVI layout of :class:`kvb_cache.codecs.KiviCodec`: keys quantized per channel over groups of tokens,
values per token over groups of channels. The cache is built from transformers' own
:class:`~transformers.cache_utils.QuantizedLayer` (a full-precision residual window for the newest tokens,
everything older quantized; its ``update`` decides when to flush the window), so only ``_quantize`` /
``_dequantize`` are ours, and they call the KIVI codec. The layout matches the one ``kvb-planner`` charges
for "KV at 8/4 bits" (group 64, 128 residual tokens).

NOTE: ``QuantizedLayer.update`` dequantizes the whole layer for every forward and re-quantizes it when the
residual window fills (transformers' design): peak memory drops by the stored KV, speed does not improve.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, QuantizedLayer

from kvb_cache.codecs.base import LayerPair
from kvb_cache.codecs.kivi import KiviCodec
from kvb_cache.codecs.packing import Quantized
from kvb_cache.errors import InvalidRequestError
from kvb_cache.kv_sharing import own_kv_layers

#: ``kv_cache_bits`` values that quantize the live cache (16 keeps it as computed).
LIVE_QUANT_BITS = (8, 4)
#: Tokens sharing one key scale per channel, and channels sharing one value scale per token
#: (kvb-planner's ``KVQuantLayout.group_size``).
LIVE_GROUP_SIZE = 64
#: Newest tokens kept in full precision until the window flushes (``KVQuantLayout.residual_tokens``).
LIVE_RESIDUAL_TOKENS = 128
# QuantizedLayer passes an ``axis`` to ``_quantize``; here it names the axis the statistics run over.
_KEY_AXIS = -2  # over tokens: one scale per channel (KIVI keys)
_VALUE_AXIS = -1  # over channels: one scale per token (KIVI values)


class PackedKV(NamedTuple):
    """One quantized key or value tensor: the KIVI codes and what decoding needs to restore its shape."""

    data: Quantized
    axis: int
    tokens: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data)


class KiviLiveLayer(QuantizedLayer):
    """A ``QuantizedLayer`` whose quantizer is kvb-cache's KIVI codec.

    Tensors are ``[batch, kv_heads, seq, head_dim]``. Besides what transformers' layer does, it can be
    cropped (speculative rollback), have batch rows selected (finished rows leave a batch) and hand its
    full keys/values back (:meth:`dense`).
    """

    def __init__(
        self, *, bits: int, group_size: int = LIVE_GROUP_SIZE, residual_length: int = LIVE_RESIDUAL_TOKENS
    ) -> None:
        super().__init__(
            nbits=bits,
            axis_key=_KEY_AXIS,
            axis_value=_VALUE_AXIS,
            q_group_size=group_size,
            residual_length=residual_length,
        )
        self.cumulative_length = 0
        self._codec = KiviCodec(bits=bits, group_size=group_size)

    def _quantize(self, tensor: torch.Tensor, axis: int) -> PackedKV:
        # The codec's own grouping (keys: [B, H, T/G, G, D]; values: [B, H, T, D/g, g]); it is batch-agnostic.
        encode = self._codec.encode_keys if axis == _KEY_AXIS else self._codec.encode_values
        return PackedKV(data=encode(tensor), axis=axis, tokens=tensor.shape[-2], dtype=tensor.dtype)

    def _dequantize(self, q_tensor: PackedKV) -> torch.Tensor:
        # One tensor at a time: QuantizedLayer decodes keys and values apart.
        if q_tensor.axis == _KEY_AXIS:
            return self._codec.decode_keys(q_tensor.data, tokens=q_tensor.tokens, dtype=q_tensor.dtype)
        return self._codec.decode_values(q_tensor.data, dtype=q_tensor.dtype)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def _residual_tokens(self) -> int:
        return self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0

    def dense(self) -> LayerPair:
        """Every cached position, dequantized: keys and values ``[batch, kv_heads, seq, head_dim]``."""
        keys = self._dequantize(self._quantized_keys)
        values = self._dequantize(self._quantized_values)
        if self._residual_tokens():
            keys, values = torch.cat([keys, self.keys], dim=-2), torch.cat([values, self.values], dim=-2)
        return LayerPair(keys, values)

    def _refill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly ``keys``/``values`` (all quantized, empty residual window)."""
        self._quantized_keys = self._quantize(keys.contiguous(), axis=_KEY_AXIS)
        self._quantized_values = self._quantize(values.contiguous(), axis=_VALUE_AXIS)
        self.keys = keys.new_empty((0,))
        self.values = values.new_empty((0,))
        self.cumulative_length = keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (a negative count, as ``DynamicLayer.crop``).

        Positions still in the residual window are sliced off exactly. Cutting into the quantized part
        re-quantizes the kept positions from their dequantized values (group statistics change with the
        length), which adds rounding error of the same order as the original quantization.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        remove = -tokens_to_remove
        if remove == 0 or not self.is_initialized:
            return
        keep = max(self.cumulative_length - remove, 0)
        if remove <= self._residual_tokens():
            self.keys, self.values = self.keys[..., :-remove, :], self.values[..., :-remove, :]
            self.cumulative_length = keep
            return
        keys, values = self.dense()
        self._refill(keys[..., :keep, :], values[..., :keep, :])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep batch rows ``indices``: codes, scales and minima all lead with the batch dim, so this is exact."""
        if not self.is_initialized:
            return
        for name in ("_quantized_keys", "_quantized_values"):
            packed: PackedKV = getattr(self, name)
            setattr(self, name, packed._replace(data=Quantized(*(t[indices] for t in packed.data))))
        if self._residual_tokens():
            self.keys, self.values = self.keys[indices], self.values[indices]

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: KIVI codes, scales and minima plus the full-precision residual window."""
        if not self.is_initialized:
            return 0
        residual = sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return self._quantized_keys.nbytes + self._quantized_values.nbytes + residual


class LiveQuantizedCache(Cache):
    """A request's working cache with one :class:`KiviLiveLayer` per decoder layer."""

    def __init__(self, *, num_layers: int, bits: int) -> None:
        if bits not in LIVE_QUANT_BITS:
            raise ValueError(f"live KV quantization takes bits 8 or 4, got {bits!r}")
        super().__init__(layers=[KiviLiveLayer(bits=bits) for _ in range(num_layers)])
        self.bits = bits


def quantize_live(cache: Cache, *, num_layers: int, bits: int) -> LiveQuantizedCache:
    """A live-quantized working cache holding what ``cache`` holds (the assembled cached prefix).

    The prefix goes in through ``QuantizedLayer.update``, so reused chunk KV is quantized like the
    request's own; ``cache``'s tensors are not modified (they may be views of stored chunks).
    """
    live = LiveQuantizedCache(num_layers=num_layers, bits=bits)
    for source, target in zip(own_kv_layers(cache), live.layers):
        if source.get_seq_length():
            target.update(source.keys, source.values)
    return live


def is_live_quantized(cache: Cache) -> bool:
    return isinstance(cache, LiveQuantizedCache)


def layer_kv(layer: CacheLayerMixin) -> LayerPair:
    """A cache layer's full keys and values ``[batch, kv_heads, seq, head_dim]`` (dequantized when live-quantized).

    Dense layers return their own tensors (no copy), so the exact path is unchanged.
    """
    if isinstance(layer, KiviLiveLayer):
        return layer.dense()
    return LayerPair(layer.keys, layer.values)


def cache_kv_bytes(cache: Cache) -> int:
    """Bytes of KV a working cache holds now (codes, scales and residual window for live-quantized layers)."""
    total = 0
    for layer in own_kv_layers(cache):
        if isinstance(layer, KiviLiveLayer):
            total += layer.nbytes
        elif layer.is_initialized:
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


def check_kv_cache_bits(value: object) -> int | None:
    """Validate a per-request ``kv_cache_bits`` (16, 8, 4 or None); returns it.

    Raises:
        InvalidRequestError: anything else, naming ``kv_cache_bits``.
    """
    if value is None or (
        isinstance(value, int) and not isinstance(value, bool) and value in (16, *LIVE_QUANT_BITS)
    ):
        return value  # type: ignore[return-value]
    raise InvalidRequestError(
        f"kv_cache_bits must be 16 (KV as computed), 8 or 4 (KIVI-quantized live KV) or None (engine default), "
        f"got {value!r}",
        param="kv_cache_bits",
    )
