"""Bytes held by a KV cache of a given length at 16, 8 or 4 bits.

Quantized layout (KIVI-style, as the kvb-cache int8/int4 codecs): keys are quantized per channel over
groups of ``group_size`` tokens, values per token over groups of ``group_size`` channels; each group keeps
a scale and a zero point in the model dtype. The most recent ``residual_tokens`` tokens stay unquantized
(they are still being appended to), so a short cache costs as much as an unquantized one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvb_planner.errors import PlannerConfigError, check_int
from kvb_planner.ladder import SUPPORTED_KV_BITS
from kvb_planner.shape import ModelShape


@dataclass(frozen=True, slots=True, kw_only=True)
class KVQuantLayout:
    """How a quantized KV cache is laid out (only used for ``kv_bits < 16``).

    Attributes:
        group_size: Elements sharing one scale/zero pair (tokens for keys, channels for values).
        residual_tokens: Most recent tokens kept in the model dtype.
    """

    group_size: int = 64
    residual_tokens: int = 128

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise PlannerConfigError(f"group_size must be >= 1 (got {self.group_size})")
        if self.residual_tokens < 0:
            raise PlannerConfigError(f"residual_tokens must be >= 0 (got {self.residual_tokens})")


#: Immutable default (group 64, 128 residual tokens).
DEFAULT_KV_LAYOUT = KVQuantLayout()


def kv_cache_bytes(
    shape: ModelShape,
    *,
    tokens: int,
    batch_size: int,
    kv_bits: int,
    layout: KVQuantLayout = DEFAULT_KV_LAYOUT,
) -> int:
    """Bytes of K and V for ``tokens`` positions of ``batch_size`` sequences in every layer holding KV
    (``shape.layer_channels``; the formulas below are for ``Hkv * d`` channels of K and of V per layer).

    Unquantized: ``2 * L * B * Hkv * d * T * dtype_bytes`` (GQA shrinks it by ``Hq / Hkv``).
    Quantized, with ``R = min(residual_tokens, T)`` and ``Q = T - R`` quantized tokens, per layer and
    sequence: ``ceil(2 * Q * Hkv * d * bits / 8)`` packed bytes + key scales ``ceil(Q / G) * Hkv * d * 2 *
    dtype_bytes`` + value scales ``Q * ceil(Hkv * d / G) * 2 * dtype_bytes`` + ``2 * R * Hkv * d *
    dtype_bytes`` for the residual window.
    """
    check_int("tokens", tokens, minimum=0)
    check_int("batch_size", batch_size, minimum=1)
    if kv_bits not in SUPPORTED_KV_BITS:
        raise PlannerConfigError(f"kv_bits must be one of {SUPPORTED_KV_BITS} (got {kv_bits})")
    elem = shape.dtype_bytes
    residual = min(layout.residual_tokens, tokens)
    quantized = tokens - residual
    group = layout.group_size
    total = 0
    for keys, values in shape.layer_channels:  # channels of K and of V per token, per layer holding KV
        if kv_bits == 16:
            total += tokens * (keys + values) * elem
            continue
        packed = math.ceil(quantized * (keys + values) * kv_bits / 8)
        key_scales = math.ceil(quantized / group) * keys * 2 * elem
        value_scales = quantized * math.ceil(values / group) * 2 * elem
        total += packed + key_scales + value_scales + residual * (keys + values) * elem
    return batch_size * total
