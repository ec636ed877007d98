"""Asymmetric uniform quantization with zero points, and 4-bit packing."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Quantized(NamedTuple):
    """``codes`` (uint8, packed two per byte when ``bits == 4``), ``scale`` and ``minimum`` (fp16)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> Quantized:
    """Quantize ``x`` with one scale and zero point per slice along ``dim`` (the group axis).

    ``x`` is already grouped: reducing over ``dim`` gives the per-group statistics. Scales and minima are
    rounded to fp16 *before* computing codes, so decoding with the stored fp16 values reproduces exactly
    the grid the codes were chosen on.
    """
    levels = (1 << bits) - 1
    x = x.float()
    minimum = x.amin(dim=dim, keepdim=True).to(torch.float16)
    maximum = x.amax(dim=dim, keepdim=True)
    scale = ((maximum - minimum.float()) / levels).to(torch.float16)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((x - minimum.float()) / safe).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = pack_nibbles(codes)
    return Quantized(codes, scale, minimum)


def dequantize_groups(q: Quantized, bits: int, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_nibbles(q.codes) if bits == 4 else q.codes
    return (codes.float() * q.scale.float() + q.minimum.float()).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim (which must be even): ``[..., D] -> [..., D // 2]``."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., D // 2] -> [..., D]``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
