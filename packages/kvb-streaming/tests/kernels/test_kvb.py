from __future__ import annotations

import sys
import types

import pytest
import torch

from kvb_streaming.awq_format import dequantize, quantize
from kvb_streaming.errors import KernelUnavailableError
from kvb_streaming.kernels import kvb
from kvb_streaming.kernels.base import KernelContext, LinearShape


def context(device: str = "cuda") -> KernelContext:
    return KernelContext(
        device=torch.device(device), dtype=torch.float16, group_size=32, dequant_chunk_bytes=1 << 20
    )


def test_missing_package_is_reported_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvb_kernels", None)  # import raises ImportError
    assert kvb.find_awq_gemm() is None
    reason = kvb.SPEC.unavailable_reason(context(), [LinearShape(64, 64)])
    assert reason is not None and "kvb-streaming[kernels]" in reason
    with pytest.raises(ImportError, match=r"kvb-streaming\[kernels\]"):
        kvb.KvbKernelsKernel(context())


def test_calls_the_packages_awq_gemm_with_the_awq_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def awq_gemm(x, qweight, qzeros, scales, group_size):  # a reference implementation of the contract
        calls.append(group_size)
        from kvb_streaming.awq_format import AWQTensors

        return x @ dequantize(AWQTensors(qweight, qzeros, scales), group_size, x.dtype)

    monkeypatch.setitem(sys.modules, "kvb_kernels", types.SimpleNamespace(awq_gemm=awq_gemm))
    assert kvb.SPEC.unavailable_reason(context("cpu"), []) == "the Triton kernel runs on CUDA only"
    kernel = kvb.KvbKernelsKernel(context("cpu"))
    awq = quantize(torch.randn(16, 64), 32)
    x = torch.randn(2, 3, 64)
    y = kernel.linear(x, kernel.prepare(awq))
    assert y.shape == (2, 3, 16) and calls == [32]
    torch.testing.assert_close(y, x @ dequantize(awq, 32, torch.float32))


def test_module_without_the_function_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kvb-kernels older than awq_gemm: the message told users to install kvb-kernels, which they had; it
    says to upgrade instead."""
    monkeypatch.setitem(sys.modules, "kvb_kernels", types.SimpleNamespace())
    reason = kvb.SPEC.unavailable_reason(context(), [LinearShape(64, 64)])
    assert reason is not None and "does not provide awq_gemm" in reason and "pip install" not in reason
    assert "upgrade" in reason
    with pytest.raises(KernelUnavailableError, match="does not provide awq_gemm"):
        kvb.KvbKernelsKernel(context())


def test_kvb_kernels_without_triton_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvb-kernels installed without its Triton extra: awq_gemm exists but raises on its first call, so the
    backend must report itself unavailable ("auto" then picks another) instead of failing mid-forward."""
    monkeypatch.setitem(sys.modules, "kvb_kernels", types.SimpleNamespace(awq_gemm=lambda *args: None))
    monkeypatch.setattr(kvb, "triton_installed", lambda: False)
    reason = kvb.SPEC.unavailable_reason(context(), [LinearShape(64, 64)])
    assert reason is not None and "kvb-kernels[triton]" in reason
    monkeypatch.setattr(kvb, "triton_installed", lambda: True)
    assert kvb.SPEC.unavailable_reason(context(), [LinearShape(64, 64)]) is None
