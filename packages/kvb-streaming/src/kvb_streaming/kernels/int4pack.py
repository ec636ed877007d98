"""Backend on torch's own tinygemm int4 kernels (``aten._weight_int4pack_mm`` and its CPU variant).

tinygemm dequantizes ``w = (q - 8) * scale + zero`` with a *float* zero, while AWQ uses
``w = (q - z) * s``; both agree when ``zero = (8 - z) * s``, so the AWQ tensors are converted once at load.
The packed weight layout is device specific (the CUDA one is built by a CUDA op), so conversion runs on the
compute device and the result is brought back to the host to be kept resident or streamed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvb_streaming.awq_format import AWQTensors, unpack_int4
from kvb_streaming.errors import KernelUnavailableError
from kvb_streaming.kernels.base import KernelContext, KernelSpec, LinearShape

_GROUP_SIZES = (32, 64, 128, 256)
_K_TILE = 16
_N_TILE = 8
# The CPU packing op (_convert_weight_to_int4pack_for_cpu) needs out_features divisible by 16, not 8.
_N_TILE_CPU = 16
# torch 2.5 changed the CUDA packing op's input from int32 [n, k] to two nibbles per uint8 [n, k / 2].
_CUDA_TAKES_UINT8 = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def inner_k_tiles(in_features: int) -> int | None:
    """The largest tinygemm ``innerKTiles`` (8, 4 or 2) dividing ``in_features / 16``, or None."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * _K_TILE) == 0:
            return tiles
    return None


class Int4PackKernel:
    """tinygemm int4 GEMM. On CUDA it computes in bf16 (the op's only activation dtype) and casts back."""

    name = "int4pack"
    payload_names = ("weight_int4pack", "scales_and_zeros")

    def __init__(self, context: KernelContext) -> None:
        self._group_size = context.group_size
        self._device = context.device
        self._cuda = context.device.type == "cuda"
        self._compute_dtype = torch.bfloat16 if self._cuda else context.dtype

    def prepare(self, awq: AWQTensors) -> dict[str, torch.Tensor]:
        q = unpack_int4(awq.qweight).t().contiguous()  # [n, k] int32
        tiles = inner_k_tiles(q.shape[1])
        if tiles is None:
            raise KernelUnavailableError(
                f"in_features={q.shape[1]} is not a multiple of 32; use quant_kernel='torch'"
            )
        if self._cuda:
            src = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8) if _CUDA_TAKES_UINT8 else q
            packed = torch.ops.aten._convert_weight_to_int4pack(src.to(self._device), tiles).cpu()
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
        scales = awq.scales.to(torch.float32)  # [k/g, n]
        zeros = unpack_int4(awq.qzeros).to(torch.float32)  # [k/g, n]
        # [k/g, n, 2]: tinygemm's (scale, float zero) pairs.
        scales_and_zeros = torch.stack([scales, (8 - zeros) * scales], dim=-1).to(self._compute_dtype)
        return {"weight_int4pack": packed, "scales_and_zeros": scales_and_zeros.contiguous()}

    def linear(self, x: torch.Tensor, payload: Mapping[str, torch.Tensor]) -> torch.Tensor:
        packed, scales_and_zeros = payload["weight_int4pack"], payload["scales_and_zeros"]
        out_features = scales_and_zeros.shape[1]
        x2 = x.reshape(-1, x.shape[-1]).to(self._compute_dtype).contiguous()  # [tokens, in]
        if self._cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, packed, self._group_size, scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self._group_size, scales_and_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)

    def transient_bytes(self, shape: LinearShape) -> int:
        """0: the GEMM reads the packed int4 payload directly (no dequantized weight)."""
        return 0


def _unavailable_reason(context: KernelContext, shapes: Sequence[LinearShape]) -> str | None:
    if context.device.type == "cuda":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return "this torch build has no aten._weight_int4pack_mm"
        if torch.cuda.get_device_capability(context.device) < (8, 0):
            return "tinygemm needs a CUDA GPU of compute capability 8.0 or newer"
    elif context.device.type == "cpu":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return "this torch build has no aten._weight_int4pack_mm_for_cpu (torch >= 2.6 has it)"
        if context.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"dtype {context.dtype} is not supported by the CPU kernel"
    else:
        return f"no tinygemm kernel for device type {context.device.type!r}"
    if context.group_size not in _GROUP_SIZES:
        return f"group_size {context.group_size} is not one of {_GROUP_SIZES}"
    n_tile = _N_TILE_CPU if context.device.type == "cpu" else _N_TILE
    for shape in shapes:
        if inner_k_tiles(shape.in_features) is None or shape.out_features % n_tile:
            return f"layer shape {tuple(shape)} needs in_features % 32 == 0 and out_features % {n_tile} == 0"
    return None


SPEC = KernelSpec(name="int4pack", unavailable_reason=_unavailable_reason, build=Int4PackKernel)
