from __future__ import annotations

import pytest
import torch

from kvb_streaming.awq_format import dequantize, quantize
from kvb_streaming.errors import WeightsNotStagedError
from kvb_streaming.kernels.base import KernelContext
from kvb_streaming.kernels.torch_dequant import TorchDequantKernel
from kvb_streaming.qlinear import StreamingQLinear


def make_kernel() -> TorchDequantKernel:
    context = KernelContext(
        device=torch.device("cpu"), dtype=torch.float32, group_size=16, dequant_chunk_bytes=1 << 20
    )
    return TorchDequantKernel(context)


def test_bound_layer_computes_x_times_dequantized_weight_plus_bias() -> None:
    kernel = make_kernel()
    awq = quantize(torch.randn(24, 32), 16)
    layer = StreamingQLinear(32, 24, kernel=kernel, bias=True)
    layer.bias = torch.randn(24)
    layer.bind(kernel.prepare(awq))
    x = torch.randn(2, 3, 32)
    expected = x @ dequantize(awq, 16, torch.float32) + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert set(dict(layer.named_buffers())) == {"qweight", "qzeros", "scales", "bias"}


def test_unbound_layer_refuses_to_run() -> None:
    layer = StreamingQLinear(32, 24, kernel=make_kernel(), bias=False)
    with pytest.raises(WeightsNotStagedError, match="full_resident"):
        layer(torch.randn(1, 32))
    layer.bind(make_kernel().prepare(quantize(torch.randn(24, 32), 16)))
    assert layer.is_bound
    layer.unbind()
    assert not layer.is_bound and layer.qweight is None
