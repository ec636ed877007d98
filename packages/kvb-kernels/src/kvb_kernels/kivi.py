"""int8 asymmetric (KIVI-style) K/V: the coded layout, a reference codec, and attention that reads the codes.

Layout contract (per attention layer; KIVI, Liu et al. 2024: keys per channel, values per token):

- ``key_codes``: ``[batch, kv_heads, kv_len, head_dim]`` uint8. ``key = code * key_scale + key_zero`` with
  ``key_scale``/``key_zero``: ``[batch, kv_heads, ceil(kv_len / group_size), head_dim]``, one pair per channel per
  group of ``group_size`` consecutive tokens (outlier channels get their own range).
- ``value_codes``: ``[batch, kv_heads, kv_len, head_dim]`` uint8. ``value = code * value_scale + value_zero`` with
  ``value_scale``/``value_zero``: ``[batch, kv_heads, kv_len, 1]``, one pair per token.
- Scales and zeros are any float dtype (fp16 halves their overhead; fp32 here by default for accuracy).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from kvb_kernels import launch
from kvb_kernels.checks import check_group, check_query, check_same, check_window, is_int, softmax_scale
from kvb_kernels.errors import DeviceError, DTypeError, GradientError, ShapeError

_LEVELS = 255


@dataclass(frozen=True, slots=True, kw_only=True)
class KiviKV:
    """KIVI-coded K/V of one layer (see the module docstring for shapes)."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        if not is_int(self.group_size) or self.group_size < 1:
            raise ShapeError(f"group_size must be an int >= 1 (tokens), got {self.group_size!r}")
        # A Python int: the kernel takes it as a compile-time constant (a NumPy int failed in the launch).
        object.__setattr__(self, "group_size", operator.index(self.group_size))
        for name in ("key_scale", "key_zero", "value_scale", "value_zero"):
            stat = getattr(self, name)
            if not stat.is_floating_point():  # integer scales were taken as they were: wrong K/V, silently
                raise DTypeError(f"{name} must be floating point (the codec's scale_dtype), got {stat.dtype}")
            if stat.requires_grad and torch.is_grad_enabled():
                raise GradientError(f"{name} requires grad, but kvb-kernels are forward-only (no backward)")
        for name in ("key_codes", "value_codes"):
            codes = getattr(self, name)
            if codes.dtype != torch.uint8 or codes.dim() != 4:
                raise DTypeError(
                    f"{name} must be uint8 [batch, kv_heads, kv_len, head_dim], got {codes.dtype} "
                    f"{tuple(codes.shape)}"
                )
        if self.key_codes.shape != self.value_codes.shape:
            raise ShapeError(
                f"key_codes {tuple(self.key_codes.shape)} and value_codes "
                f"{tuple(self.value_codes.shape)} must have one shape"
            )
        batch, heads, length, dim = self.key_codes.shape
        groups = -(-length // self.group_size)
        want = {
            "key_scale": (batch, heads, groups, dim),
            "key_zero": (batch, heads, groups, dim),
            "value_scale": (batch, heads, length, 1),
            "value_zero": (batch, heads, length, 1),
        }
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ShapeError(
                    f"{name} must have shape {shape} for group_size={self.group_size}, got {got}"
                )

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``[batch, kv_heads, kv_len, head_dim]`` K and V in ``dtype`` (the unfused path)."""
        length = self.key_codes.shape[2]
        k_scale = self.key_scale.repeat_interleave(self.group_size, dim=2)[:, :, :length].float()
        k_zero = self.key_zero.repeat_interleave(self.group_size, dim=2)[:, :, :length].float()
        key = self.key_codes.float() * k_scale + k_zero
        value = self.value_codes.float() * self.value_scale.float() + self.value_zero.float()
        return key.to(dtype), value.to(dtype)


def kivi_quantize(
    key: torch.Tensor, value: torch.Tensor, *, group_size: int = 32, scale_dtype: torch.dtype = torch.float32
) -> KiviKV:
    """Code K per channel (groups of ``group_size`` tokens) and V per token into uint8, min/max asymmetric.

    Args:
        key: ``[batch, kv_heads, kv_len, head_dim]``.
        value: Same shape as ``key``.
        group_size: Tokens sharing one key scale/zero per channel.
        scale_dtype: dtype of the stored scales and zeros (fp16 needs K/V within its range, +-65504).

    Returns:
        The coded K/V; ``dequantize`` reconstructs them within half a quantisation step (of the stored
        step, whatever ``scale_dtype``).
    """
    if key.shape != value.shape or key.dim() != 4:
        raise ShapeError(
            f"key and value must share one [batch, kv_heads, kv_len, head_dim] shape, got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if not is_int(group_size) or group_size < 1:
        raise ShapeError(f"group_size must be an int >= 1 (tokens), got {group_size!r}")
    group_size = operator.index(group_size)
    if not (isinstance(scale_dtype, torch.dtype) and scale_dtype.is_floating_point):
        # An integer dtype was an untyped RuntimeError from finfo.
        raise DTypeError(
            f"scale_dtype must be a floating dtype (float32, float16, bfloat16), got {scale_dtype!r}"
        )
    batch, heads, length, dim = key.shape
    groups = -(-length // group_size)
    pad = groups * group_size - length
    # Pad with copies of the last token so the tail group's min/max are its own tokens'.
    padded = torch.cat([key, key[:, :, -1:].expand(batch, heads, pad, dim)], dim=2) if pad else key
    grouped = padded.float().view(batch, heads, groups, group_size, dim)
    k_lo, k_scale = _grid(grouped.amin(dim=3), grouped.amax(dim=3), scale_dtype)  # [B, H, G, D]
    k_scale_tok = k_scale.float().repeat_interleave(group_size, dim=2)[:, :, :length]
    k_lo_tok = k_lo.float().repeat_interleave(group_size, dim=2)[:, :, :length]
    key_codes = ((key.float() - k_lo_tok) / k_scale_tok).round().clamp(0, _LEVELS).to(torch.uint8)

    v = value.float()
    v_lo, v_scale = _grid(
        v.amin(dim=3, keepdim=True), v.amax(dim=3, keepdim=True), scale_dtype
    )  # [B, H, L, 1]
    value_codes = ((v - v_lo.float()) / v_scale.float()).round().clamp(0, _LEVELS).to(torch.uint8)
    for name, stat in (("key", k_scale), ("key", k_lo), ("value", v_scale), ("value", v_lo)):
        if not bool(torch.isfinite(stat).all()):
            # fp16 scales of K/V past +-65504 overflowed to inf and every decoded value was NaN, silently.
            raise DTypeError(
                f"the {name} scales or zeros overflow scale_dtype={scale_dtype} (K/V beyond its range, or "
                "not finite): use scale_dtype=torch.float32"
            )
    return KiviKV(
        key_codes=key_codes,
        key_scale=k_scale,
        key_zero=k_lo,
        value_codes=value_codes,
        value_scale=v_scale,
        value_zero=v_lo,
        group_size=group_size,
    )


def _grid(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero point and step in ``dtype`` (from fp32 ``lo``/``hi``) whose grid covers ``[lo, hi]``.

    The codes are chosen on the stored grid, so its zero point is rounded down and its step up: rounded to
    nearest, a bf16 step fell short of the range and the top values were clamped (1.7 steps of error with
    bf16 scales, 0.62 with fp16; the bound is half a step).
    """
    zero = lo.to(dtype)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -math.inf)), zero)
    step = torch.where(hi > lo, (hi - zero.float()) / _LEVELS, torch.ones_like(hi))
    stored = step.to(dtype)
    stored = torch.where(
        stored.float() < step, torch.nextafter(stored, torch.full_like(stored, math.inf)), stored
    )
    return zero, stored


def kivi_attention(
    query: torch.Tensor,
    kv: KiviKV,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over KIVI-coded K/V, dequantising tile by tile inside the kernel.

    Args:
        query: ``[batch, heads, q_len, head_dim]``; positions bottom-right aligned as in
            :func:`kvb_kernels.flash_attention`.
        kv: The coded K/V (see :class:`KiviKV`).
        causal: Mask keys after each query's position.
        window: Sliding window (keys visible per query, itself included); None: unbounded.
        scale: Softmax scale; default ``1/sqrt(head_dim)``.
        num_splits: Key slices per program; None picks from the SM count.

    Returns:
        ``[batch, heads, q_len, head_dim]`` in ``query``'s dtype (transposed view of ``[batch, q_len, heads, D]``).
    """
    if torch.compiler.is_compiling():
        # One opaque custom op under torch.compile, as flash_attention (Inductor must not re-lower the kernel).
        out = torch.ops.kvb_kernels.kivi_attention(
            query,
            kv.key_codes,
            kv.key_scale,
            kv.key_zero,
            kv.value_codes,
            kv.value_scale,
            kv.value_zero,
            kv.group_size,
            causal,
            window,
            scale,
            num_splits,
        )
        return out.transpose(1, 2)
    return _kivi_attention(query, kv, causal, window, scale, num_splits)


def _kivi_attention(
    query: torch.Tensor,
    kv: KiviKV,
    causal: bool,
    window: int | None,
    scale: float | None,
    num_splits: int | None,
) -> torch.Tensor:
    """:func:`kivi_attention`'s checks and launch (positional, the custom op's schema)."""
    check_query(query)
    window = check_window(window)
    batch, heads, q_len, head_dim = query.shape
    _, kv_heads, kv_len, kv_dim = kv.key_codes.shape
    if kv.key_codes.shape[0] != batch or kv_dim != head_dim:
        raise ShapeError(
            f"coded K/V {tuple(kv.key_codes.shape)} must share batch ({batch}) and head_dim "
            f"({head_dim}) with query"
        )
    for name in ("key_codes", "value_codes"):
        check_same(query, name, getattr(kv, name), dtype=torch.uint8)
    for name in ("key_scale", "key_zero", "value_scale", "value_zero"):
        if getattr(kv, name).device != query.device:
            raise DeviceError(
                f"{name} is on {getattr(kv, name).device} but query is on {query.device}; move the scales and "
                "zeros with the codes"
            )
    group = check_group(heads, kv_heads)
    # Scales/zeros are small next to the codes; one layout lets both share a stride set.
    k_scale, k_zero = kv.key_scale.contiguous(), kv.key_zero.contiguous()
    v_scale, v_zero = kv.value_scale.contiguous(), kv.value_zero.contiguous()
    qk_scale = softmax_scale(scale, head_dim) * launch.LOG2E
    out = torch.empty(batch, q_len, heads, head_dim, device=query.device, dtype=query.dtype)

    def call(kernel, grid, parts, splits):
        kernel[grid](
            query,
            kv.key_codes,
            k_scale,
            k_zero,
            kv.value_codes,
            v_scale,
            v_zero,
            out,
            parts.out if parts else out,
            parts.lse if parts else out,
            *query.stride(),
            *kv.key_codes.stride(),
            *k_scale.stride(),
            *kv.value_codes.stride(),
            *v_scale.stride()[:3],
            out.stride(0),
            out.stride(2),
            out.stride(1),
            out.stride(3),
            qk_scale,
            kv_heads,
            q_len,
            kv_len,
            window or 0,
            splits,
            launch.bucket(q_len * group),
            launch.bucket(kv_len),
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=launch.block_d(head_dim),
            K_GROUP=kv.group_size,
            CAUSAL=causal,
            HAS_WINDOW=window is not None,
            HAS_MASK=False,
            SPLIT=parts is not None,
            INPUT_PRECISION=launch.input_precision(query.dtype),
        )

    launch.run("kivi", call, out=out, kv_heads=kv_heads, group=group, kv_len=kv_len, num_splits=num_splits)
    return out.transpose(1, 2)


@torch.library.custom_op("kvb_kernels::kivi_attention", mutates_args=())
def _kivi_attention_op(
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    group_size: int,
    causal: bool,
    window: int | None,
    scale: float | None,
    num_splits: int | None,
) -> torch.Tensor:
    kv = KiviKV(
        key_codes=key_codes,
        key_scale=key_scale,
        key_zero=key_zero,
        value_codes=value_codes,
        value_scale=value_scale,
        value_zero=value_zero,
        group_size=group_size,
    )
    # A custom op may not return a view: the contiguous [B, q_len, H, D] buffer; the caller transposes.
    return _kivi_attention(query, kv, causal, window, scale, num_splits).transpose(1, 2)


_kivi_attention_op.register_fake(launch.attention_output_like)
