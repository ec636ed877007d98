"""Portable backend: dequantize a column block of the weight, matmul, repeat (plain torch, any device)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvb_streaming.awq_format import AWQTensors, dequantize
from kvb_streaming.kernels.base import KernelContext, KernelSpec, LinearShape

PAYLOAD = ("qweight", "qzeros", "scales")


class TorchDequantKernel:
    """``y = x @ dequantize(W)``, dequantizing at most ``dequant_chunk_bytes`` of weight at a time.

    The payload is the AWQ GEMM tensors themselves. Chunks are output-column blocks, so every output is one
    full-length dot product (no split-K accumulation), and peak memory is bounded by the chunk budget instead
    of the full dequantized ``[in, out]`` matrix.
    """

    name = "torch"
    payload_names = PAYLOAD

    def __init__(self, context: KernelContext) -> None:
        self._group_size = context.group_size
        self._chunk_bytes = context.dequant_chunk_bytes
        self._element_size = context.dtype.itemsize

    def prepare(self, awq: AWQTensors) -> dict[str, torch.Tensor]:
        return {"qweight": awq.qweight, "qzeros": awq.qzeros, "scales": awq.scales}

    def linear(self, x: torch.Tensor, payload: Mapping[str, torch.Tensor]) -> torch.Tensor:
        qweight, qzeros, scales = (payload[key] for key in PAYLOAD)
        in_features, out_features = qweight.shape[0], scales.shape[1]
        x2 = x.reshape(-1, in_features)  # [tokens, in]
        cols = self.chunk_columns(in_features, x.element_size())
        if cols >= out_features:
            w = dequantize(AWQTensors(qweight, qzeros, scales), self._group_size, x.dtype)  # [in, out]
            return (x2 @ w).reshape(*x.shape[:-1], out_features)
        y = x2.new_empty(x2.shape[0], out_features)
        for c0 in range(0, out_features, cols):
            c1 = min(c0 + cols, out_features)
            block = AWQTensors(qweight[:, c0 // 8 : c1 // 8], qzeros[:, c0 // 8 : c1 // 8], scales[:, c0:c1])
            y[:, c0:c1] = x2 @ dequantize(block, self._group_size, x.dtype)
        return y.reshape(*x.shape[:-1], out_features)

    def chunk_columns(self, in_features: int, element_size: int) -> int:
        """Output columns per block (a multiple of 8) so one block's temporaries fit the byte budget."""
        return max(8, self._chunk_bytes // _bytes_per_column(in_features, element_size) // 8 * 8)

    def transient_bytes(self, shape: LinearShape) -> int:
        """One block's dequantization temporaries: ``dequant_chunk_bytes`` at most, less for a linear whose
        whole ``[in, out]`` weight fits it (and more only when 8 columns alone exceed it)."""
        columns = min(self.chunk_columns(shape.in_features, self._element_size), shape.out_features)
        return columns * _bytes_per_column(shape.in_features, self._element_size)


def _bytes_per_column(in_features: int, element_size: int) -> int:
    """Temporaries per dequantized output column: per weight element, the unpacked int32 nibbles, their
    int32 difference with the zeros, and the product in the activation dtype (+ its input)."""
    return in_features * (4 + 4 + 2 * element_size)


def _always_available(context: KernelContext, shapes: Sequence[LinearShape]) -> str | None:
    return None


SPEC = KernelSpec(name="torch", unavailable_reason=_always_available, build=TorchDequantKernel)
