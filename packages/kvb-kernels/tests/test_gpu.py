"""Checks only a CUDA GPU can run (compiled Triton, bf16, realistic sizes). Skipped without one."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_attention

from kvb_kernels import flash_attention, kivi_attention, kivi_quantize

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize(("q_len", "kv_len"), [(1000, 1000), (1, 4097), (300, 2048)])
def test_compiled_kernel_matches_sdpa(q_len, kv_len, head_dim, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, q_len, head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(2, 2, kv_len, head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(2, 2, kv_len, head_dim, device="cuda", dtype=dtype, generator=gen)
    out = flash_attention(q, k, v)
    atol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out.float(), reference_attention(q, k, v), atol=atol, rtol=0)


def test_compiled_kivi_decode_matches_unfused():
    key = torch.randn(1, 8, 8192, 128, device="cuda")
    value = torch.randn(1, 8, 8192, 128, device="cuda")
    coded = kivi_quantize(key, value, group_size=64, scale_dtype=torch.float16)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    k_hat, v_hat = coded.dequantize(torch.float16)
    torch.testing.assert_close(kivi_attention(q, coded), flash_attention(q, k_hat, v_hat), atol=2e-3, rtol=0)
