"""Pick an int4 GEMM backend by name, or the best available one for ``"auto"``."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvb_streaming.errors import KernelUnavailableError, StreamingConfigError
from kvb_streaming.kernels import int4pack, kvb, torch_dequant
from kvb_streaming.kernels.base import KernelContext, KernelSpec, LinearShape, QuantKernel

logger = logging.getLogger(__name__)

#: Registered backends, in ``"auto"`` preference order (the portable one last). ``int4pack`` comes first: it
#: is the one measured on a GPU (an H100, docs/streaming.md); kvb-kernels' Triton GEMM is checked on Triton's
#: CPU interpreter only, so "auto" takes it only where int4pack cannot run, until a GPU run times it.
KERNELS: tuple[KernelSpec, ...] = (int4pack.SPEC, kvb.SPEC, torch_dequant.SPEC)


def resolve_kernel(
    name: str,
    context: KernelContext,
    shapes: Sequence[LinearShape],
    kernels: Sequence[KernelSpec] = KERNELS,
) -> QuantKernel:
    """Builds the backend ``name`` (or the first available one for ``"auto"``) for these layer shapes.

    Raises:
        KernelUnavailableError: the named backend cannot run here (the message says why and what to do).
        StreamingConfigError: unknown name.
    """
    if name == "auto":
        for spec in kernels:
            reason = spec.unavailable_reason(context, shapes)
            if reason is None:
                logger.info(
                    "quant_kernel='auto' picked %r for %s %s", spec.name, context.device, context.dtype
                )
                return spec.build(context)
            logger.debug("quant_kernel %r skipped: %s", spec.name, reason)
        raise KernelUnavailableError(f"no int4 GEMM backend can run on {context.device} in {context.dtype}")
    for spec in kernels:
        if spec.name == name:
            reason = spec.unavailable_reason(context, shapes)
            if reason is not None:
                raise KernelUnavailableError(
                    f"quant_kernel={name!r} is unavailable: {reason}. Use quant_kernel='auto' or 'torch'."
                )
            return spec.build(context)
    raise StreamingConfigError(f"unknown quant_kernel {name!r}; choose one of {[s.name for s in kernels]}")
