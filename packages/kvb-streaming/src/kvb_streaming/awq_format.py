"""AWQ GEMM int4 format: pack, unpack, round-to-nearest quantize and dequantize, in plain torch.

AutoAWQ's GEMM layout for a linear layer with ``in_features`` inputs, ``out_features`` outputs and group size
``g`` (weights stored transposed, input-major):

- ``qweight`` int32 ``[in, out / 8]``: 4-bit values, eight per word;
- ``qzeros``  int32 ``[in / g, out / 8]``: 4-bit zero points, packed the same way;
- ``scales``  fp16  ``[in / g, out]``.

Nibble ``i`` (bits ``4i .. 4i+3``) of word ``c`` holds column ``8c + AWQ_ORDER[i]``, and
``w[i, j] = (q[i, j] - z[i // g, j]) * s[i // g, j]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvb_streaming.errors import AWQFormatError

#: Column held by each nibble of a packed word (AutoAWQ GEMM packing order).
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
#: Nibble that holds each column: the inverse permutation of :data:`AWQ_ORDER`.
AWQ_REVERSE_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)
_PACK = 8
_MAX_Q = 15


class AWQTensors(NamedTuple):
    """One AWQ GEMM linear layer's quantized tensors (shapes in the module docstring)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Packs 4-bit values into int32 words in AWQ GEMM order.

    Args:
        values: integer tensor ``[rows, cols]`` with entries in ``0..15``; ``cols`` a multiple of 8.

    Returns:
        int32 ``[rows, cols / 8]``.
    """
    rows, cols = values.shape
    if cols % _PACK:
        raise AWQFormatError(
            f"AWQ packs 8 columns per int32 word; got {cols} columns (pad to a multiple of 8)"
        )
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > _MAX_Q):
        raise AWQFormatError("int4 values must lie in 0..15; quantize before packing")
    # Column j of each group of 8 goes to nibble AWQ_REVERSE_ORDER[j]: shift it there directly.
    grouped = values.reshape(rows, cols // _PACK, _PACK).to(torch.int64)  # [rows, cols/8, 8]
    shifts = torch.tensor(
        [4 * nibble for nibble in AWQ_REVERSE_ORDER], device=values.device, dtype=torch.int64
    )
    words = (grouped << shifts).sum(dim=2)
    # Words above 2**31 - 1 must wrap to negative int32, as AutoAWQ's packer produces.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`.

    Args:
        words: int32 ``[rows, cols / 8]``.

    Returns:
        int32 ``[rows, cols]`` with entries in ``0..15``, columns in natural order.
    """
    if words.dtype != torch.int32:
        raise AWQFormatError(f"packed AWQ tensors are int32, got {words.dtype}")
    rows, n_words = words.shape
    # Column j of each word sits in nibble AWQ_REVERSE_ORDER[j]; shifting by that directly yields columns in
    # natural order. The arithmetic shift of negative words is harmless after the mask.
    shifts = torch.tensor(
        [4 * nibble for nibble in AWQ_REVERSE_ORDER], device=words.device, dtype=torch.int32
    )
    return ((words.unsqueeze(-1) >> shifts) & _MAX_Q).reshape(rows, n_words * _PACK)  # [rows, words * 8]


def quantize(weight: torch.Tensor, group_size: int) -> AWQTensors:
    """Round-to-nearest asymmetric int4 quantization of a linear weight into AWQ GEMM tensors.

    This is AutoAWQ's ``pseudo_quantize_tensor`` (zero point, per-group min/max) without its
    activation-aware scale search, which needs calibration data; the *format* is identical.

    Args:
        weight: ``nn.Linear.weight`` ``[out, in]`` (any float dtype).
        group_size: input rows sharing a scale and zero point; must divide ``in``.

    Returns:
        :class:`AWQTensors`; ``scales`` are fp16 and the integers are computed from those fp16 scales, so
        :func:`dequantize` reproduces exactly what was quantized.
    """
    out_features, in_features = weight.shape
    check_shapes(in_features, out_features, group_size)
    # [in/g, g, out]: AWQ stores the transposed weight, grouped along the input dimension.
    w = weight.detach().to(torch.float32).t().reshape(in_features // group_size, group_size, out_features)
    w_max = w.amax(dim=1, keepdim=True)
    w_min = w.amin(dim=1, keepdim=True)
    scales = ((w_max - w_min).clamp(min=1e-5) / _MAX_Q).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = (-torch.round(w_min / s)).clamp(0, _MAX_Q)
    q = (torch.round(w / s) + zeros).clamp(0, _MAX_Q).to(torch.int32)
    return AWQTensors(
        qweight=pack_int4(q.reshape(in_features, out_features)),
        qzeros=pack_int4(zeros.to(torch.int32).reshape(-1, out_features)),
        scales=scales.reshape(-1, out_features).contiguous(),
    )


def dequantize(tensors: AWQTensors, group_size: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Dequantizes AWQ GEMM tensors: ``w[i, j] = (q[i, j] - z[i // g, j]) * s[i // g, j]``.

    Args:
        tensors: ``qweight`` ``[in, out/8]``, ``qzeros`` ``[in/g, out/8]``, ``scales`` ``[in/g, out]``.
        group_size: ``g``.
        dtype: result dtype; the product is rounded once into it.

    Returns:
        ``[in, out]`` (the transpose of ``nn.Linear.weight``).
    """
    q = unpack_int4(tensors.qweight)  # [in, out]
    z = unpack_int4(tensors.qzeros)  # [in/g, out]
    n_groups, out_features = z.shape
    if q.shape != (n_groups * group_size, out_features) or tuple(tensors.scales.shape) != (
        n_groups,
        out_features,
    ):
        raise AWQFormatError(
            f"inconsistent AWQ shapes for group_size={group_size}: qweight -> {tuple(q.shape)}, "
            f"qzeros -> {tuple(z.shape)}, scales {tuple(tensors.scales.shape)}; check the checkpoint's group_size"
        )
    # Multiply in a dtype that holds the scales exactly (fp16 scales into bf16 would round twice), so the
    # result is rounded once. Broadcast over the group: no [in, out] copies of z and s.
    compute = torch.promote_types(dtype, tensors.scales.dtype)
    w = (q.view(n_groups, group_size, out_features) - z.unsqueeze(1)).to(compute)  # [in/g, g, out]
    w = w * tensors.scales.to(compute).unsqueeze(1)
    return w.reshape(n_groups * group_size, out_features).to(dtype)


def check_shapes(in_features: int, out_features: int, group_size: int) -> None:
    """Raises :class:`AWQFormatError` unless a layer of this shape can be stored in AWQ GEMM format."""
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise AWQFormatError(f"group_size must be an int, got {group_size!r}")
    if group_size < 1 or in_features % group_size:
        # NOTE: suggest only sizes that fit this layer (576 = 9 x 64 takes 64, not 128).
        fits = [g for g in (128, 64, 32, 16) if in_features % g == 0][:2]
        hint = f"such as {' or '.join(str(g) for g in fits)}" if fits else "that divides it"
        raise AWQFormatError(
            f"group_size={group_size} must divide in_features={in_features}; pick a group_size {hint}"
        )
    if out_features % _PACK:
        raise AWQFormatError(f"out_features={out_features} must be a multiple of 8 for AWQ GEMM packing")
