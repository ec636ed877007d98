"""kvb-kernels: FA2-style Triton attention for Hugging Face transformers.

``attn_implementation="kvb_attention"`` after :func:`register_kvb_attention` (or :func:`install_flash_attention`
on a loaded model); direct entry points for dense, block-table (paged) and int8 KIVI K/V; and
:func:`awq_gemm`, an int4 GEMM over AutoAWQ GEMM tensors.
"""

from kvb_kernels._version import __version__
from kvb_kernels.attention import flash_attention
from kvb_kernels.awq import awq_gemm
from kvb_kernels.errors import (
    DeviceError,
    DTypeError,
    GradientError,
    KernelError,
    KernelUnavailableError,
    ShapeError,
)
from kvb_kernels.hf_attention import (
    ATTN_IMPLEMENTATION,
    install_flash_attention,
    kvb_attention_forward,
    register_kvb_attention,
    uninstall_flash_attention,
)
from kvb_kernels.kivi import KiviKV, kivi_attention, kivi_quantize
from kvb_kernels.paged import PagedKV, paged_attention
from kvb_kernels.tier import FlashAttnTier, flash_attention_available, get_flash_attn_tier

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DTypeError",
    "DeviceError",
    "FlashAttnTier",
    "GradientError",
    "KernelError",
    "KernelUnavailableError",
    "KiviKV",
    "PagedKV",
    "ShapeError",
    "__version__",
    "awq_gemm",
    "flash_attention",
    "flash_attention_available",
    "get_flash_attn_tier",
    "install_flash_attention",
    "kivi_attention",
    "kivi_quantize",
    "kvb_attention_forward",
    "paged_attention",
    "register_kvb_attention",
    "uninstall_flash_attention",
]
