"""Asymmetric uniform quantization with zero points, and 4-bit packing."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvb_cache.errors import NonFiniteLogitsError


class Quantized(NamedTuple):
    """``codes`` (uint8, packed two per byte when ``bits == 4``), ``scale`` and ``minimum`` (fp16, or fp32
    where fp16 cannot hold them: :func:`stats_dtype`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor


#: The smallest normal fp16 number: below it a scale keeps fewer significant bits (at |x| ~ 1e-6, int8's
#: fp16 scale was a subnormal and the decoded KV was noisier than zeros).
_FP16_TINY = torch.finfo(torch.float16).tiny
_FP16_MAX = torch.finfo(torch.float16).max


def stats_dtype(*stats: torch.Tensor) -> torch.dtype:
    """fp16 when every scale / zero point in ``stats`` (fp32) is 0 or a normal fp16 number, else fp32.

    Half the bytes of fp32 for the KV of every model we measured; fp32 for KV beyond fp16's range (legal in
    fp32 and bf16 models: an fp16 scale of 3e5 was inf, the decoded KV NaN and every record refused) or so
    small that an fp16 scale loses its precision. The decoder reads either.
    """
    for t in stats:
        magnitude = t.abs()
        if bool((magnitude > _FP16_MAX).any()) or bool(((magnitude < _FP16_TINY) & (magnitude > 0)).any()):
            return torch.float32
    return torch.float16


def check_finite(x: torch.Tensor) -> None:
    """Refuse KV holding NaN or inf: one would spoil its whole group, and the record would be refused only
    when read back (after being stored and shipped)."""
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteLogitsError(
            "the KV to quantize holds NaN or inf (a numerical overflow, usually of float16 activations): "
            "not encoded; load the model in bfloat16 or float32"
        )


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> Quantized:
    """Quantize ``x`` with one scale and zero point per slice along ``dim`` (the group axis).

    ``x`` is already grouped: reducing over ``dim`` gives the per-group statistics. Scales and minima are
    rounded to their stored dtype (:func:`stats_dtype`) *before* computing codes, so decoding with the
    stored values reproduces exactly the grid the codes were chosen on.
    """
    check_finite(x)
    levels = (1 << bits) - 1
    x = x.float()
    minimum, maximum = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    dtype = stats_dtype(minimum, (maximum - minimum) / levels)
    minimum = minimum.to(dtype)
    # The range from the rounded minimum: the largest value must stay within the top code.
    scale = ((maximum - minimum.float()) / levels).to(dtype)
    safe = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((x - minimum.float()) / safe).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = pack_nibbles(codes)
    return Quantized(codes, scale, minimum)


def dequantize_groups(q: Quantized, bits: int, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_nibbles(q.codes) if bits == 4 else q.codes
    check_stats_fit(codes, q.scale, q.minimum)
    return (codes.float() * q.scale.float() + q.minimum.float()).to(dtype)


def check_stats_fit(codes: torch.Tensor, *stats: torch.Tensor) -> None:
    """Refuse statistics that do not broadcast *into* ``codes`` (one value per group, same rank).

    A record read from disk or Redis may be forged: codes ``[N, 1, 1]`` against a scale ``[1, N, 1]`` and a
    zero point ``[1, 1, N]`` broadcast into ``N**3`` floats, gigabytes allocated from a few kilobytes before
    any shape check could refuse the result. So the decoded tensor is never larger than its codes.
    """
    for stat in stats:
        if stat.dim() != codes.dim() or any(s not in (1, c) for s, c in zip(stat.shape, codes.shape)):
            raise ValueError(
                f"group statistics of shape {tuple(stat.shape)} do not fit codes of shape {tuple(codes.shape)}"
            )


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dim (which must be even): ``[..., D] -> [..., D // 2]``."""
    if codes.shape[-1] % 2:
        # Odd, the two strided halves differ in length and broadcast into a wrongly shaped result.
        raise ValueError(f"4-bit codes pack in pairs: the last dimension must be even, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., D // 2] -> [..., D]``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
