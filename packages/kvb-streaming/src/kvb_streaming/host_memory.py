"""Host-side storage of streamed layers: one contiguous (ideally pinned) buffer per layer."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

# Every tensor starts on a 256-byte boundary so uint8 slices can be viewed as any dtype and DMA stays aligned.
ALIGNMENT = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSlice:
    """One tensor inside a flat byte buffer."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor as a view of ``buffer`` (uint8 ``[>= offset + nbytes]``, host or device)."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedLayer:
    """A decoder layer's streamed tensors, packed into one host buffer so it moves in a single copy.

    Attributes:
        buffer: uint8 ``[nbytes]`` on the host, pinned when ``pinned``.
        slices: tensor key (``"<module>.<payload name>"``, e.g. ``"mlp.up_proj.qweight"``) -> its slice.
        pinned: whether ``buffer`` is page-locked (asynchronous DMA) or pageable.
    """

    buffer: torch.Tensor
    slices: Mapping[str, TensorSlice]
    pinned: bool

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class HostBuffer(NamedTuple):
    """A host byte buffer and whether it is page-locked."""

    tensor: torch.Tensor
    pinned: bool


class HostAllocator:
    """Allocates host byte buffers, pinned when asked and possible.

    Pinning can fail (``ulimit -l`` memlock limits in containers, no accelerator runtime); the allocator then
    falls back to pageable memory and logs one warning, since copies still work, only synchronously.
    """

    def __init__(self, *, pin: bool) -> None:
        self.pin_requested = pin
        self.pin_failures = 0

    def allocate(self, nbytes: int) -> HostBuffer:
        """Returns a uint8 ``[nbytes]`` host buffer, pinned when possible."""
        if self.pin_requested:
            try:
                return HostBuffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True)
            except RuntimeError as exc:
                if self.pin_failures == 0:
                    logger.warning(
                        "pinning %d bytes of host memory failed (%s); falling back to pageable memory, so "
                        "host-to-device copies will not overlap compute. Raise the memlock limit (ulimit -l) "
                        "to fix this.",
                        nbytes,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    )
                self.pin_failures += 1
        return HostBuffer(torch.empty(nbytes, dtype=torch.uint8), False)


def pack_layer(tensors: Mapping[str, torch.Tensor], allocator: HostAllocator) -> PackedLayer:
    """Copies ``tensors`` (CPU) into one freshly allocated host buffer at aligned offsets."""
    slices: dict[str, TensorSlice] = {}
    offset = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        slices[key] = TensorSlice(offset=offset, nbytes=nbytes, shape=tuple(tensor.shape), dtype=tensor.dtype)
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    buffer, pinned = allocator.allocate(max(offset, ALIGNMENT))
    for key, tensor in tensors.items():
        slices[key].view(buffer).copy_(tensor.detach().to("cpu"))
    return PackedLayer(buffer=buffer, slices=slices, pinned=pinned)
