"""Input validation shared by the attention entry points. Every failure names the fix."""

from __future__ import annotations

import math
import operator

import torch

from kvb_kernels.backend import device_supported, dtype_supported, interpreter_enabled, require_triton
from kvb_kernels.errors import DeviceError, DTypeError, GradientError, ShapeError

MAX_HEAD_DIM = 256


def check_query(query: torch.Tensor) -> None:
    """``query`` must be ``[batch, heads, q_len, head_dim]`` on a device and dtype the kernels serve."""
    require_triton()
    if query.dim() != 4:
        raise ShapeError(f"query must be [batch, heads, q_len, head_dim], got shape {tuple(query.shape)}")
    if query.shape[2] < 1:
        raise ShapeError("query has q_len == 0; pass at least one query token")
    if torch.is_grad_enabled() and query.requires_grad:
        # The output had no grad_fn: training through a kernel gave the projections no gradient, silently.
        raise GradientError(
            "query requires grad, but kvb-kernels are forward-only (no backward): call them under "
            "torch.no_grad() or torch.inference_mode(), or train with torch's scaled_dot_product_attention"
        )
    if not 1 <= query.shape[-1] <= MAX_HEAD_DIM:
        raise ShapeError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {query.shape[-1]}")
    if not device_supported(query.device):
        hint = "set TRITON_INTERPRET=1 to run on CPU (tests only)" if not interpreter_enabled() else ""
        raise DeviceError(f"kvb-kernels run on CUDA tensors; query is on {query.device}. {hint}".strip())
    if not dtype_supported(query.dtype, query.device):
        raise DTypeError(
            f"query dtype {query.dtype} is not served on {query.device.type}; "
            + (
                "the CPU interpreter serves float16 and float32 (its bfloat16 dot products are wrong)"
                if query.device.type == "cpu"
                else "use float16 or bfloat16 (float32 also works)"
            )
        )


def check_group(query_heads: int, kv_heads: int) -> int:
    """Return the GQA group size ``query_heads // kv_heads``; heads must divide evenly."""
    if kv_heads < 1 or query_heads % kv_heads:
        raise ShapeError(
            f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads}) for grouped-query attention"
        )
    return query_heads // kv_heads


def check_same(
    query: torch.Tensor, name: str, other: torch.Tensor, *, dtype: torch.dtype | None = None
) -> None:
    """``other`` must live on ``query``'s device and have ``dtype`` (default: ``query``'s dtype)."""
    if other.device != query.device:
        raise DeviceError(
            f"{name} is on {other.device} but query is on {query.device}; move both to one device"
        )
    want = query.dtype if dtype is None else dtype
    if other.dtype != want:
        raise DTypeError(f"{name} has dtype {other.dtype}; expected {want}")
    if torch.is_grad_enabled() and other.requires_grad:
        # As for the query: the output has no grad_fn, so keys / values / scales would get no gradient.
        raise GradientError(
            f"{name} requires grad, but kvb-kernels are forward-only (no backward): call them under "
            "torch.no_grad() or torch.inference_mode(), or train with torch's scaled_dot_product_attention"
        )


def check_window(window: int | None) -> int | None:
    """A sliding window counts the keys a query sees, itself included, so it must be >= 1. Returns it as a
    Python int (a NumPy int or 0-d tensor passed the check and then failed inside Triton's launch)."""
    if window is not None and (not is_int(window) or window < 1):
        raise ShapeError(
            f"window must be an int >= 1 (keys visible per query, itself included) or None, got {window!r}"
        )
    return None if window is None else operator.index(window)


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` unless given (then it must be positive)."""
    if scale is None:
        return head_dim**-0.5
    if not math.isfinite(scale) or scale <= 0:
        raise ShapeError(f"scale must be finite and > 0, got {scale}; pass None for 1/sqrt(head_dim)")
    return float(scale)


def is_int(value: object) -> bool:
    """An integer (Python, NumPy or 0-d integer tensor), not a bool or a float."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
