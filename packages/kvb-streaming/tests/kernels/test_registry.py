from __future__ import annotations

import sys

import pytest
import torch

from kvb_streaming.errors import KernelUnavailableError, StreamingConfigError
from kvb_streaming.kernels import KERNELS, KernelContext, LinearShape, resolve_kernel

CPU = KernelContext(
    device=torch.device("cpu"), dtype=torch.float32, group_size=32, dequant_chunk_bytes=1 << 20
)


def test_auto_prefers_in_registry_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvb_kernels", None)
    assert [spec.name for spec in KERNELS] == ["int4pack", "kvb_kernels", "torch"]
    expected = "int4pack" if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") else "torch"
    assert resolve_kernel("auto", CPU, [LinearShape(64, 128)]).name == expected
    # A shape tinygemm cannot take falls through to the portable kernel.
    assert resolve_kernel("auto", CPU, [LinearShape(48, 128)]).name == "torch"


def test_named_kernel_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvb_kernels", None)
    assert resolve_kernel("torch", CPU, []).name == "torch"
    with pytest.raises(KernelUnavailableError, match="quant_kernel='kvb_kernels' is unavailable"):
        resolve_kernel("kvb_kernels", CPU, [])
    with pytest.raises(StreamingConfigError, match="unknown quant_kernel"):
        resolve_kernel("marlin", CPU, [])
