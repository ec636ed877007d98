"""The contract every int4 GEMM backend satisfies, and what it is told about the model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kvb_streaming.awq_format import AWQTensors


class LinearShape(NamedTuple):
    """``in_features`` and ``out_features`` of one quantized linear layer."""

    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelContext:
    """Where and how the kernel computes.

    Attributes:
        device: compute device of the model.
        dtype: activation dtype (``x``); outputs have this dtype too.
        group_size: AWQ group size of the checkpoint.
        dequant_chunk_bytes: peak bytes of dequantized weight a dequantizing kernel may materialize.
    """

    device: torch.device
    dtype: torch.dtype
    group_size: int
    dequant_chunk_bytes: int


class QuantKernel(Protocol):
    """An int4 GEMM backend.

    ``prepare`` turns AWQ GEMM tensors into the backend's own layout once, at load time, on the host: that
    *payload* is what is kept resident or streamed. ``linear`` computes ``x @ W`` from a payload that lives
    on the compute device (possibly as views into a staging slot).
    """

    name: str
    #: Names of the payload tensors ``prepare`` returns and ``linear`` reads.
    payload_names: tuple[str, ...]

    def prepare(self, awq: AWQTensors) -> dict[str, torch.Tensor]:
        """Returns the payload (CPU tensors) for one linear layer."""
        ...

    def linear(self, x: torch.Tensor, payload: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` (no bias)."""
        ...

    def transient_bytes(self, shape: LinearShape) -> int:
        """Most bytes of weight-side temporaries one ``linear`` call of this shape holds at once (beyond its
        input, output and payload): 0 for a kernel that reads the payload directly; what a memory planner
        must add to a forward's peak."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSpec:
    """A registered backend.

    Attributes:
        name: the ``quant_kernel`` value selecting it.
        unavailable_reason: returns why the backend cannot serve this model here, or None if it can.
        build: creates the backend.
    """

    name: str
    unavailable_reason: Callable[[KernelContext, Sequence[LinearShape]], str | None]
    build: Callable[[KernelContext], QuantKernel]
