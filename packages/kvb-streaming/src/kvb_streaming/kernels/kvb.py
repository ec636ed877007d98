"""Backend on the Triton AWQ GEMM of the optional ``kvb-kernels`` distribution.

kvb-kernels is a sibling leaf package; it is used only when installed (``pip install kvb-streaming[kernels]``)
and only if it exports the function this module expects (:class:`AWQGemm`): the contract is defined here,
by the consumer, and satisfied structurally.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from kvb_streaming.awq_format import AWQTensors
from kvb_streaming.errors import KernelUnavailableError
from kvb_streaming.kernels.base import KernelContext, KernelSpec, LinearShape

MODULE = "kvb_kernels"
FUNCTION = "awq_gemm"
INSTALL_HINT = "pip install 'kvb-streaming[kernels]' (installs kvb-kernels with its Triton extra)"


class AWQGemm(Protocol):
    """``kvb_kernels.awq_gemm``: int4 GEMM straight from AWQ GEMM tensors.

    Args:
        x: ``[tokens, in]`` fp16/bf16 on CUDA.
        qweight: int32 ``[in, out / 8]``; qzeros: int32 ``[in / g, out / 8]``; scales: ``[in / g, out]``.
        group_size: ``g``.

    Returns:
        ``[tokens, out]`` in ``x``'s dtype.
    """

    def __call__(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        qzeros: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
    ) -> torch.Tensor: ...


def find_awq_gemm() -> AWQGemm | None:
    """``kvb_kernels.awq_gemm`` if the package is installed and provides it, else None."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return None
    return getattr(module, FUNCTION, None)


def missing_reason() -> str:
    """Why :func:`find_awq_gemm` found nothing: the package is absent, or it does not provide the function."""
    try:
        importlib.import_module(MODULE)
    except ImportError:
        return f"{MODULE} is not installed; {INSTALL_HINT}"
    # NOTE: installing the extra cannot help here: kvb-kernels is installed, but a release older than its int4
    # GEMM; only an upgrade does.
    return (
        f"the installed {MODULE} does not provide {FUNCTION} (an older kvb-kernels without awq_gemm; upgrade "
        "kvb-kernels)"
    )


def triton_installed() -> bool:
    """Whether ``triton`` can be imported: kvb-kernels installs without it, and its ``awq_gemm`` then raises."""
    return importlib.util.find_spec("triton") is not None


class KvbKernelsKernel:
    """Calls ``kvb_kernels.awq_gemm`` on the AWQ tensors as stored (no conversion)."""

    name = "kvb_kernels"
    payload_names = ("qweight", "qzeros", "scales")

    def __init__(self, context: KernelContext) -> None:
        gemm = find_awq_gemm()
        if gemm is None:
            raise KernelUnavailableError(f"{missing_reason()}; use quant_kernel='auto' or 'torch'")
        self._gemm = gemm
        self._group_size = context.group_size

    def prepare(self, awq: AWQTensors) -> dict[str, torch.Tensor]:
        return {"qweight": awq.qweight, "qzeros": awq.qzeros, "scales": awq.scales}

    def linear(self, x: torch.Tensor, payload: Mapping[str, torch.Tensor]) -> torch.Tensor:
        out_features = payload["scales"].shape[1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = self._gemm(x2, payload["qweight"], payload["qzeros"], payload["scales"], self._group_size)
        return y.reshape(*x.shape[:-1], out_features)

    def transient_bytes(self, shape: LinearShape) -> int:
        """0: the GEMM reads the packed int4 payload directly (no dequantized weight)."""
        return 0


def _unavailable_reason(context: KernelContext, shapes: Sequence[LinearShape]) -> str | None:
    if find_awq_gemm() is None:
        return missing_reason()
    if context.device.type != "cuda":
        return "the Triton kernel runs on CUDA only"
    if context.dtype not in (torch.float16, torch.bfloat16):
        return f"the Triton kernel takes fp16/bf16 activations, not {context.dtype}"
    if not triton_installed():
        # NOTE: awq_gemm exists but would raise KernelUnavailableError on its first call; "auto" must skip it.
        return f"{MODULE} is installed without Triton; pip install 'kvb-kernels[triton]'"
    return None


SPEC = KernelSpec(name="kvb_kernels", unavailable_reason=_unavailable_reason, build=KvbKernelsKernel)
