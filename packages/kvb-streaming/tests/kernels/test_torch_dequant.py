from __future__ import annotations

import torch

from kvb_streaming.awq_format import dequantize, quantize
from kvb_streaming.kernels.base import KernelContext
from kvb_streaming.kernels.torch_dequant import TorchDequantKernel

MiB = 1 << 20


def kernel(chunk_bytes: int, dtype: torch.dtype = torch.float32) -> TorchDequantKernel:
    return TorchDequantKernel(
        KernelContext(device=torch.device("cpu"), dtype=dtype, group_size=32, dequant_chunk_bytes=chunk_bytes)
    )


def test_chunk_columns_respect_the_budget() -> None:
    k = kernel(1 * MiB)
    cols = k.chunk_columns(4096, 4)
    assert cols % 8 == 0 and cols * 4096 * (8 + 8) <= MiB and (cols + 8) * 4096 * (8 + 8) > MiB
    assert kernel(1 * MiB).chunk_columns(1 << 24, 2) == 8  # never below one packed word


def test_chunked_equals_unchunked_reference() -> None:
    awq = quantize(
        torch.randn(1000, 2048, generator=torch.Generator().manual_seed(0)), 32
    )  # out=1000, in=2048
    x = torch.randn(3, 2048)
    small = kernel(1 * MiB)
    assert small.chunk_columns(2048, 4) < 1000  # really chunked
    expected = x @ dequantize(awq, 32, torch.float32)
    torch.testing.assert_close(small.linear(x, small.prepare(awq)), expected, rtol=1e-5, atol=1e-4)
    big = kernel(256 * MiB)
    torch.testing.assert_close(big.linear(x, big.prepare(awq)), expected, rtol=1e-5, atol=1e-4)


def test_payload_is_the_awq_tensors() -> None:
    awq = quantize(torch.randn(16, 64), 32)
    payload = kernel(MiB).prepare(awq)
    assert payload["qweight"] is awq.qweight and payload["scales"] is awq.scales


def test_transient_bytes_is_one_blocks_temporaries() -> None:
    """``transient_bytes`` (what a memory planner adds for the kernel; measured against a call's allocations
    in kvboost's tests, which have kvb-planner's tensor_peak): one chunk's temporaries within the budget,
    the whole ``[in, out]`` block's when that fits."""
    from kvb_streaming.kernels.base import LinearShape

    small = kernel(1 * MiB)
    assert small.transient_bytes(LinearShape(2048, 1000)) == small.chunk_columns(2048, 4) * 2048 * 16 <= MiB
    assert kernel(256 * MiB).transient_bytes(LinearShape(2048, 1000)) == 2048 * 1000 * (8 + 2 * 4)
    assert kernel(MiB, torch.bfloat16).transient_bytes(LinearShape(64, 16)) == 64 * 16 * (8 + 2 * 2)
