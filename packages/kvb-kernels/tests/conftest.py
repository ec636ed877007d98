"""Shared fixtures. Kernel tests run on CUDA, or on CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
which the nox session sets); otherwise they are skipped with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvb_kernels.backend import interpreter_enabled, triton_installed


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    """Where kernels run in this session: CUDA, else CPU under the interpreter, else the test is skipped."""
    if not triton_installed():
        pytest.skip("Triton is not installed (pip install 'kvb-kernels[triton]')")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if interpreter_enabled():
        return torch.device("cpu")
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not 1")


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """fp32 SDPA with an explicit bottom-right causal / window / user mask; rows with no key give 0.

    Shapes: query ``[B, H, Lq, D]``, key/value ``[B, Hkv, Lk, D]`` -> ``[B, H, Lq, D]`` fp32.
    """
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    group = heads // key.shape[1]
    key = key.float().repeat_interleave(group, dim=1)
    value = value.float().repeat_interleave(group, dim=1)
    q_abs = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
    k_pos = torch.arange(kv_len, device=query.device)[None, :]
    keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
    if causal:
        keep &= k_pos <= q_abs
    if window is not None:
        keep &= q_abs - k_pos < window
    keep = keep.expand(batch, heads, q_len, kv_len)
    if mask is not None:
        keep = keep & mask
    out = F.scaled_dot_product_attention(query.float(), key, value, attn_mask=keep, scale=scale)
    return torch.where(keep.any(-1, keepdim=True), out, torch.zeros_like(out))


def tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed against the fp32 reference (unit-variance random inputs)."""
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
