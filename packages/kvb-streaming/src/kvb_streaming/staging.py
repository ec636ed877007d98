"""Staging slots (device buffers at constant addresses) and the copy engines that fill them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvb_streaming.errors import StreamingError
from kvb_streaming.residency import LayerIndex


@dataclass(slots=True)
class StagingSlot:
    """One device buffer that streamed layers take turns in.

    The buffer is allocated once, so its address never changes (a prerequisite for CUDA graphs and for the
    views bound to the linears). Internal, mutable scheduler state.

    Attributes:
        index: slot number.
        buffer: uint8 ``[capacity]`` on the compute device.
        layer: the layer whose bytes the slot holds (or is receiving), if any.
        ready: CUDA event recorded on the copy stream when the copy into the slot completes.
        released: CUDA event recorded on the compute stream after the slot's last reader ran.
    """

    index: int
    buffer: torch.Tensor
    layer: LayerIndex | None = None
    ready: Any = None
    released: Any = None


class Transfer(Protocol):
    """Moves a host buffer into a slot and orders the copy against compute."""

    #: True when ``copy`` completes before returning (no copy/compute overlap).
    synchronous: bool

    def make_slot(self, index: int, capacity: int) -> StagingSlot: ...

    def copy(self, slot: StagingSlot, host: torch.Tensor) -> None:
        """Starts copying ``host`` (uint8 ``[n]``, ``n <= capacity``) into ``slot.buffer[:n]``."""
        ...

    def wait_ready(self, slot: StagingSlot) -> None:
        """Makes the compute stream wait for the slot's pending copy."""
        ...

    def release(self, slot: StagingSlot) -> None:
        """Marks the slot free once the compute stream's work queued so far has run."""
        ...

    def in_flight(self, slot: StagingSlot) -> bool:
        """Whether the slot's copy is still running (a prefetch that is late)."""
        ...


class SyncTransfer:
    """Copy engine for devices that share host memory (CPU, MPS): plain blocking copies.

    Streaming brings no speed there; this exists so the same scheduler (and its bookkeeping) runs in tests.
    """

    synchronous = True

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def make_slot(self, index: int, capacity: int) -> StagingSlot:
        return StagingSlot(index=index, buffer=torch.empty(capacity, dtype=torch.uint8, device=self._device))

    def copy(self, slot: StagingSlot, host: torch.Tensor) -> None:
        slot.buffer[: host.numel()].copy_(host)

    def wait_ready(self, slot: StagingSlot) -> None:
        return None

    def release(self, slot: StagingSlot) -> None:
        return None

    def in_flight(self, slot: StagingSlot) -> bool:
        return False


class CudaTransfer:
    """Copy engine on a dedicated CUDA stream, ordered against the compute stream by per-slot events.

    Copy of layer B into a slot last used by layer A: the copy stream first waits for A's ``released`` event
    (A's kernels have run), copies asynchronously from pinned memory, then records ``ready``; the compute
    stream waits on ``ready`` before B's kernels. The host thread never blocks.
    """

    synchronous = False

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise StreamingError(f"CudaTransfer needs a CUDA device, got {device}; use SyncTransfer")
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def make_slot(self, index: int, capacity: int) -> StagingSlot:
        return StagingSlot(
            index=index,
            buffer=torch.empty(capacity, dtype=torch.uint8, device=self._device),
            ready=torch.cuda.Event(),
            released=torch.cuda.Event(),
        )

    def copy(self, slot: StagingSlot, host: torch.Tensor) -> None:
        # Waiting on a never-recorded event is a no-op, so the first copy into a slot starts at once.
        self._stream.wait_event(slot.released)
        with torch.cuda.stream(self._stream):
            slot.buffer[: host.numel()].copy_(host, non_blocking=True)
        slot.ready.record(self._stream)

    def wait_ready(self, slot: StagingSlot) -> None:
        torch.cuda.current_stream(self._device).wait_event(slot.ready)

    def release(self, slot: StagingSlot) -> None:
        slot.released.record(torch.cuda.current_stream(self._device))

    def in_flight(self, slot: StagingSlot) -> bool:
        return not slot.ready.query()


def make_transfer(device: torch.device) -> Transfer:
    """The copy engine for ``device``."""
    return CudaTransfer(device) if device.type == "cuda" else SyncTransfer(device)
