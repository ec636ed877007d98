from __future__ import annotations

import pytest
import torch

from kvb_streaming.awq_format import dequantize, quantize
from kvb_streaming.errors import KernelUnavailableError
from kvb_streaming.kernels.base import KernelContext, LinearShape
from kvb_streaming.kernels.int4pack import SPEC, Int4PackKernel, inner_k_tiles

CPU_OP = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def context(device: str = "cpu", dtype: torch.dtype = torch.float32, group_size: int = 32) -> KernelContext:
    return KernelContext(
        device=torch.device(device), dtype=dtype, group_size=group_size, dequant_chunk_bytes=1 << 20
    )


def test_inner_k_tiles() -> None:
    assert inner_k_tiles(128) == 8 and inner_k_tiles(64) == 4 and inner_k_tiles(96) == 2
    assert inner_k_tiles(48) is None


def test_availability_checks_shapes_and_group_size() -> None:
    assert SPEC.unavailable_reason(context(group_size=48), [LinearShape(96, 16)]) is not None
    assert "needs in_features % 32" in (SPEC.unavailable_reason(context(), [LinearShape(48, 16)]) or "")


@pytest.mark.skipif(not CPU_OP, reason="torch build without the CPU tinygemm op")
def test_cpu_needs_out_features_divisible_by_16_and_auto_falls_back() -> None:
    """The CPU packing op refuses N % 16 != 0 (e.g. an MQA k_proj of 8 outputs): the availability check said
    yes, so quant_kernel='auto' picked int4pack on CPU and the load crashed with torch's RuntimeError."""
    from kvb_streaming.kernels.registry import resolve_kernel

    shapes = [LinearShape(64, 8), LinearShape(64, 64)]
    assert "out_features % 16" in (SPEC.unavailable_reason(context(), shapes) or "")
    assert SPEC.unavailable_reason(context(), [LinearShape(64, 16)]) is None
    kernel = resolve_kernel("auto", context(), shapes)
    assert kernel.name == "torch"
    awq = quantize(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(kernel.linear(x, kernel.prepare(awq)), x @ dequantize(awq, 32, torch.float32))


@pytest.mark.skipif(not CPU_OP, reason="torch build without the CPU tinygemm op")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_awq_dequant_reference_on_cpu(dtype: torch.dtype) -> None:
    awq = quantize(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), 32)
    kernel = Int4PackKernel(context(dtype=dtype))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    expected = x @ dequantize(awq, 32, torch.float32)
    got = kernel.linear(x.to(dtype), kernel.prepare(awq))
    assert got.dtype == dtype and got.shape == (5, 64)
    # The float zero (8 - z) * s is exact in fp32; bf16 rounds the scale/zero pairs and activations.
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance * 10)
    # A wrong zero-point conversion (AWQ zero used as tinygemm's float zero) is far off: the test can fail.
    assert float((got.float() - x @ (dequantize(awq, 32, torch.float32) + 1e-2)).abs().max()) > tolerance


@pytest.mark.skipif(not CPU_OP, reason="torch build without the CPU tinygemm op")
def test_rejects_unsupported_in_features() -> None:
    with pytest.raises(KernelUnavailableError, match="multiple of 32"):
        Int4PackKernel(context()).prepare(quantize(torch.randn(16, 48), 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tinygemm_matches_reference() -> None:
    awq = quantize(torch.randn(256, 512, generator=torch.Generator().manual_seed(0)), 128)
    kernel = Int4PackKernel(context("cuda", torch.float16, 128))
    payload = {k: v.cuda() for k, v in kernel.prepare(awq).items()}
    x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
    expected = x.float() @ dequantize(awq, 128, torch.float32).cuda()
    torch.testing.assert_close(kernel.linear(x, payload).float(), expected, rtol=0.05, atol=0.5)


def test_reads_the_packed_payload_with_no_weight_transient() -> None:
    assert Int4PackKernel(context()).transient_bytes(LinearShape(4096, 4096)) == 0
