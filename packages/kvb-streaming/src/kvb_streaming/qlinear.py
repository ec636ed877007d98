"""``StreamingQLinear``: an int4 linear layer whose weights may live in a staging slot."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kvb_streaming.errors import WeightsNotStagedError
from kvb_streaming.kernels.base import QuantKernel


class StreamingQLinear(nn.Module):
    """Drop-in replacement of ``nn.Linear`` computing with int4 weights through a :class:`QuantKernel`.

    The weight *payload* (the kernel's tensors, e.g. AWQ ``qweight``/``qzeros``/``scales``) is registered as
    buffers. Resident layers bind it once; streamed layers are bound to views of a staging slot right before
    their decoder layer runs and unbound right after, so a stale slot can never be read by mistake.
    The bias, when present, is always resident.

    Args:
        in_features: input width.
        out_features: output width.
        kernel: the int4 GEMM backend shared by the whole model.
        bias: whether the layer has a bias (filled in by the loader).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        kernel: QuantKernel,
        bias: bool,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.kernel = kernel
        self.payload_names = kernel.payload_names
        for name in self.payload_names:
            self.register_buffer(name, None)
        # Meta until the loader assigns the real values (like a module built under init_empty_weights).
        self.register_buffer("bias", torch.empty(out_features, device="meta") if bias else None)

    @property
    def is_bound(self) -> bool:
        return all(self._buffers[name] is not None for name in self.payload_names)

    def bind(self, payload: Mapping[str, torch.Tensor]) -> None:
        """Points the payload buffers at ``payload`` (resident tensors or staging-slot views)."""
        for name in self.payload_names:
            self._buffers[name] = payload[name]

    def unbind(self) -> None:
        for name in self.payload_names:
            self._buffers[name] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]``."""
        if not self.is_bound:
            raise WeightsNotStagedError(
                "this streamed linear layer's weights are not staged; call the whole model (its decoder-layer "
                "hooks stage them) or load with residency_mode='full_resident'"
            )
        payload = {name: self._buffers[name] for name in self.payload_names}
        y = self.kernel.linear(x, payload)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel.name}, "
            f"bias={self.bias is not None}"
        )
