"""Causal prefill/decode attention over dense K/V: the FA2-style Triton kernel's public entry point."""

from __future__ import annotations

import torch

from kvb_kernels import launch
from kvb_kernels.checks import check_group, check_query, check_same, check_window, softmax_scale
from kvb_kernels.errors import DTypeError, ShapeError
from kvb_kernels.launch import bucket


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Softmax attention with online softmax, never materialising the ``[q_len, kv_len]`` score matrix.

    Query position ``i`` sits at absolute position ``kv_len - q_len + i`` (bottom-right alignment), so a chunk of
    new tokens attends to a cached prefix plus itself, and a single decode token attends to everything.

    Args:
        query: ``[batch, heads, q_len, head_dim]``, fp16/bf16 (fp32 is computed in IEEE fp32). Any strides.
        key: ``[batch, kv_heads, kv_len, head_dim]``; ``heads`` must be a multiple of ``kv_heads`` (GQA is served
            without expanding K/V). Any strides.
        value: Same shape as ``key``.
        causal: Mask keys after each query's absolute position.
        window: Sliding window: each query sees the ``window`` most recent keys, itself included. None: unbounded.
        attn_mask: Optional boolean keep-mask broadcastable to ``[batch, heads, q_len, kv_len]`` (True = attend),
            ANDed with ``causal``/``window``; padding masks go here. Rows left with no key give zeros.
        scale: Softmax scale; default ``1/sqrt(head_dim)``.
        num_splits: Split the key range over this many programs (flash-decoding). None picks from the SM count.

    Returns:
        ``[batch, heads, q_len, head_dim]`` in ``query``'s dtype: a transposed view of a contiguous
        ``[batch, q_len, heads, head_dim]`` buffer (the layout Hugging Face attention modules want next).

    Raises:
        ShapeError, DTypeError, DeviceError: Inputs outside the contract (the message says what to change).
        KernelUnavailableError: Triton is not installed.
    """
    if torch.compiler.is_compiling():
        # Under torch.compile (transformers compiles a static-cache decode step on CUDA) the launch goes through
        # an opaque custom op: Inductor otherwise re-lowers the Triton kernel itself and failed to compile it on
        # an H200 (tl.dot accumulator assertion, 2026-11-28). Eager calls skip the dispatcher.
        out = torch.ops.kvb_kernels.flash_attention(
            query, key, value, causal, window, attn_mask, scale, num_splits
        )
        return out.transpose(1, 2)
    return _flash_attention(query, key, value, causal, window, attn_mask, scale, num_splits)


def _flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    window: int | None,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    num_splits: int | None,
) -> torch.Tensor:
    """:func:`flash_attention`'s checks and launch (positional, the custom op's schema)."""
    check_query(query)
    window = check_window(window)
    if key.dim() != 4 or key.shape != value.shape:
        raise ShapeError(
            f"key and value must both be [batch, kv_heads, kv_len, head_dim]; got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    batch, heads, q_len, head_dim = query.shape
    if key.shape[0] != batch or key.shape[-1] != head_dim:
        raise ShapeError(
            f"key {tuple(key.shape)} must share batch ({batch}) and head_dim ({head_dim}) with query"
        )
    check_same(query, "key", key)
    check_same(query, "value", value)
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = check_group(heads, kv_heads)
    mask = _mask_view(attn_mask, query, kv_len)
    qk_scale = softmax_scale(scale, head_dim) * launch.LOG2E

    out = torch.empty(batch, q_len, heads, head_dim, device=query.device, dtype=query.dtype)
    mask_arg = mask if mask is not None else out
    mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)

    def call(kernel, grid, parts, splits):
        kernel[grid](
            query,
            key,
            value,
            mask_arg,
            out,
            parts.out if parts else out,
            parts.lse if parts else out,
            *query.stride(),
            *key.stride(),
            *value.stride(),
            *mask_strides,
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
            bucket(q_len * group),
            bucket(kv_len),
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=launch.block_d(head_dim),
            CAUSAL=causal,
            HAS_WINDOW=window is not None,
            HAS_MASK=mask is not None,
            SPLIT=parts is not None,
            INPUT_PRECISION=launch.input_precision(query.dtype),
        )

    launch.run("dense", call, out=out, kv_heads=kv_heads, group=group, kv_len=kv_len, num_splits=num_splits)
    return out.transpose(1, 2)


def _mask_view(attn_mask: torch.Tensor | None, query: torch.Tensor, kv_len: int) -> torch.Tensor | None:
    """A ``uint8`` view of the boolean mask expanded (stride 0, no copy) to ``[batch, heads, q_len, kv_len]``."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool:
        raise DTypeError(
            f"attn_mask must be boolean (True = attend), got {attn_mask.dtype}; convert an additive mask with "
            "`mask == 0`, or use SDPA for arbitrary float biases"
        )
    check_same(query, "attn_mask", attn_mask, dtype=torch.bool)
    batch, heads, q_len, _ = query.shape
    try:
        expanded = attn_mask.expand(batch, heads, q_len, kv_len)
    except RuntimeError as err:
        raise ShapeError(
            f"attn_mask {tuple(attn_mask.shape)} does not broadcast to [batch, heads, q_len, kv_len] = "
            f"{(batch, heads, q_len, kv_len)}"
        ) from err
    return expanded.view(torch.uint8)


@torch.library.custom_op("kvb_kernels::flash_attention", mutates_args=())
def _flash_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    window: int | None,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    num_splits: int | None,
) -> torch.Tensor:
    # A custom op may not return a view: hand back the contiguous [B, q_len, H, D] buffer; the caller transposes.
    return _flash_attention(query, key, value, causal, window, attn_mask, scale, num_splits).transpose(1, 2)


_flash_attention_op.register_fake(launch.attention_output_like)
