"""Connects a streamed layer's packed host bytes to the ``StreamingQLinear`` modules that read them."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvb_streaming.host_memory import PackedLayer
from kvb_streaming.qlinear import StreamingQLinear


class LayerBinding:
    """One streamed decoder layer: its packed host buffer and the linears bound to slot views of it.

    Args:
        packed: the layer's streamed payload tensors, keyed ``"<linear name>.<payload name>"``.
        modules: linear name (relative to the decoder layer) -> module.
    """

    def __init__(self, packed: PackedLayer, modules: Mapping[str, StreamingQLinear]) -> None:
        self.packed = packed
        self.modules = dict(modules)

    @property
    def host_buffer(self) -> torch.Tensor:
        return self.packed.buffer

    def bind(self, device_buffer: torch.Tensor) -> None:
        slices = self.packed.slices
        for name, module in self.modules.items():
            module.bind({p: slices[f"{name}.{p}"].view(device_buffer) for p in module.payload_names})

    def unbind(self) -> None:
        for module in self.modules.values():
            module.unbind()
