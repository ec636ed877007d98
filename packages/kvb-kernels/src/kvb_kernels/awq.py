"""int4 GEMM over AutoAWQ GEMM tensors (``awq_gemm``), and its plain-torch reference (``awq_dequantize``).

Layout contract (one linear layer, ``in`` inputs, ``out`` outputs, group size ``g``; weights input-major):

- ``qweight`` int32 ``[in, out / 8]``: eight 4-bit values per word; nibble ``j`` (bits ``4j .. 4j+3``) of word
  ``c`` holds column ``8c + AWQ_ORDER[j]`` (AutoAWQ's GEMM packing order);
- ``qzeros`` int32 ``[in / g, out / 8]``: 4-bit zero points, packed the same way;
- ``scales`` ``[in / g, out]`` float;
- ``W[i, o] = (q[i, o] - z[i // g, o]) * s[i // g, o]`` and ``awq_gemm`` returns ``x @ W``.
"""

from __future__ import annotations

import math

import torch

from kvb_kernels.backend import device_supported, interpreter_enabled, require_triton
from kvb_kernels.checks import is_int
from kvb_kernels.errors import DeviceError, DTypeError, GradientError, ShapeError

#: Column held by each nibble of a packed word (AutoAWQ GEMM order).
AWQ_ORDER: tuple[int, ...] = (0, 2, 4, 6, 1, 3, 5, 7)
#: Nibble holding each column: the inverse permutation of :data:`AWQ_ORDER`.
AWQ_REVERSE_ORDER: tuple[int, ...] = (0, 4, 1, 5, 2, 6, 3, 7)
_PACK = 8
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows, cols / 8]`` AWQ-packed words -> int32 ``[rows, cols]`` values in ``0..15``, natural order."""
    shifts = torch.tensor([4 * n for n in AWQ_REVERSE_ORDER], dtype=torch.int32, device=words.device)
    # Arithmetic shift of a negative word sign-extends; the mask keeps only the nibble.
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)


def awq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The reference dequantisation: ``[in, out]`` ``W`` in ``dtype``, each element rounded once into it.

    Args:
        qweight: int32 ``[in, out / 8]``; qzeros: int32 ``[in / g, out / 8]``; scales: ``[in / g, out]``.
        group_size: ``g``.
        dtype: result dtype; ``(q - z) * s`` is computed in fp32 (exact for fp16/bf16 scales) and rounded once.
    """
    q = awq_unpack(qweight)  # [in, out]
    z = awq_unpack(qzeros)  # [in/g, out]
    n_groups, out_features = z.shape
    compute = torch.promote_types(torch.float32, scales.dtype)
    w = (q.view(n_groups, group_size, out_features) - z.unsqueeze(1)).to(compute)  # [in/g, g, out]
    w = w * scales.to(compute).unsqueeze(1)
    return w.reshape(n_groups * group_size, out_features).to(dtype)


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """``x @ W`` for an AWQ GEMM int4 weight, dequantising tile by tile inside a Triton kernel.

    Args:
        x: ``[tokens, in]`` fp16/bf16 (fp32 also works, multiplied in IEEE fp32). Any strides.
        qweight: int32 ``[in, out / 8]`` (AWQ GEMM packing, see the module docstring).
        qzeros: int32 ``[in / g, out / 8]``.
        scales: ``[in / g, out]``, fp16/bf16/fp32 (normally ``x``'s dtype; AWQ checkpoints store fp16, which a
            bf16 model may pass as is: the product is computed in fp32 and rounded once to ``x``'s dtype).
        group_size: ``g``, a positive int dividing ``in``.

    Returns:
        ``[tokens, out]`` in ``x``'s dtype, accumulated in fp32.

    Raises:
        ShapeError, DTypeError, DeviceError, GradientError: inputs outside the contract (the message says what
            to change).
        KernelUnavailableError: Triton is not installed.
    """
    _check(x, qweight, qzeros, scales, group_size)
    require_triton()
    if not device_supported(x.device):
        hint = "" if interpreter_enabled() else " (or set TRITON_INTERPRET=1 to run on CPU, tests only)"
        raise DeviceError(f"awq_gemm runs on CUDA tensors; x is on {x.device}: move the layer to CUDA{hint}")
    return _launch(x, qweight, qzeros, scales, int(group_size))


def _check(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> None:
    """Raise the typed error, naming the fix, for any input outside the contract."""
    if x.dtype not in _X_DTYPES:
        raise DTypeError(
            f"x has dtype {x.dtype}; awq_gemm takes float16 or bfloat16 activations (or float32)"
        )
    for name, packed in (("qweight", qweight), ("qzeros", qzeros)):
        if packed.dtype != torch.int32:
            raise DTypeError(
                f"{name} has dtype {packed.dtype}; AWQ GEMM packs eight 4-bit values per int32 word "
                "(pass the checkpoint's int32 tensor; a GEMV/Marlin/exllama layout needs repacking)"
            )
    if scales.dtype not in _X_DTYPES:
        raise DTypeError(f"scales has dtype {scales.dtype}; pass them as float16, bfloat16 or float32")
    if x.dim() != 2:
        raise ShapeError(f"x must be [tokens, in], got shape {tuple(x.shape)}; reshape(-1, in) first")
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if tensor.dim() != 2:
            raise ShapeError(f"{name} must be 2-D (AWQ GEMM layout), got shape {tuple(tensor.shape)}")
    in_features = x.shape[1]
    if qweight.shape[0] != in_features:
        raise ShapeError(
            f"qweight has {qweight.shape[0]} rows but x has in_features={in_features}; qweight must be "
            "[in, out / 8] (AWQ GEMM stores the weight input-major; do not transpose it)"
        )
    if not is_int(group_size) or group_size < 1:
        raise ShapeError(
            f"group_size must be a positive int (the checkpoint's q_group_size), got {group_size!r}"
        )
    group_size = int(group_size)
    if in_features < group_size or in_features % group_size:
        raise ShapeError(
            f"group_size={group_size} must divide in_features={in_features} (x.shape[1]); pass the "
            "checkpoint's q_group_size"
        )
    out_features = scales.shape[1]
    groups = in_features // group_size
    if out_features % _PACK or qweight.shape[1] * _PACK != out_features:
        raise ShapeError(
            f"scales has out_features={out_features} columns, so qweight must be [in, {out_features / _PACK:g}] "
            f"(8 columns per int32, out a multiple of 8); got qweight {tuple(qweight.shape)}"
        )
    for name, tensor, want in (
        ("scales", scales, (groups, out_features)),
        ("qzeros", qzeros, (groups, out_features // _PACK)),
    ):
        if tuple(tensor.shape) != want:
            raise ShapeError(
                f"{name} must be {list(want)} ([in / group_size, ...] with group_size={group_size}), got "
                f"{list(tensor.shape)}; check group_size against the checkpoint"
            )
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if tensor.device != x.device:
            raise DeviceError(f"{name} is on {tensor.device} but x is on {x.device}; move both to one device")
    if torch.is_grad_enabled() and (x.requires_grad or scales.requires_grad):
        # The output would carry no grad_fn: a training step would silently give x / scales no gradient.
        raise GradientError(
            "x or scales requires grad, but awq_gemm is forward-only (no backward): call it under "
            "torch.no_grad() or torch.inference_mode()"
        )


def _launch(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    from kvb_kernels.backend import autotune_enabled
    from kvb_kernels.launch import bucket, input_precision
    from kvb_kernels.triton.awq_gemm import DECODE_TOKENS_MAX, tuned_awq_gemm

    tokens, in_features = x.shape
    out_features = scales.shape[1]
    y = torch.empty(tokens, out_features, device=x.device, dtype=x.dtype)
    if tokens == 0:
        return y
    interpret = interpreter_enabled()
    kernel = tuned_awq_gemm(tokens <= DECODE_TOKENS_MAX, interpret, autotune_enabled())

    def grid(meta: dict) -> tuple[int, int]:
        return (math.ceil(tokens / meta["BLOCK_M"]), math.ceil(out_features / meta["BLOCK_N"]))

    kernel[grid](
        x,
        qweight,
        qzeros,
        scales,
        y,
        tokens,
        in_features,
        out_features,
        *x.stride(),
        *qweight.stride(),
        *qzeros.stride(),
        *scales.stride(),
        *y.stride(),
        bucket(tokens),
        GROUP_SIZE=group_size,
        EMULATE_BF16=interpret and x.dtype == torch.bfloat16,
        INPUT_PRECISION=input_precision(x.dtype),
    )
    return y
