"""int4 GEMM backends for AWQ GEMM weights."""

from kvb_streaming.kernels.base import KernelContext, KernelSpec, LinearShape, QuantKernel
from kvb_streaming.kernels.registry import KERNELS, resolve_kernel

__all__ = ["KERNELS", "KernelContext", "KernelSpec", "LinearShape", "QuantKernel", "resolve_kernel"]
