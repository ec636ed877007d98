"""Measuring the peak memory one request added, as kvb-planner's benchmark does (for calibration).

- CPU: the kernel's peak-RSS counter (``VmHWM``) is reset by writing ``5`` to ``/proc/self/clear_refs``
  right before the request; the peak is ``VmHWM - VmRSS(before)``. That is what the OOM killer sees:
  it includes allocator fragmentation and library scratch (noisy by a few MiB) and, in a server process,
  anything another thread allocates meanwhile (the HTTP loop's allocations are small). Linux only.
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the allocation
  before the request (PyTorch's allocator only; unverified here, no GPU was available).

Where neither works (no ``/proc``, a read-only ``clear_refs``), nothing is measured: an RSS *delta* after
the request would miss the peak and teach the planner too small a margin.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

PROC_SELF = Path("/proc/self")


class PeakMeter(Protocol):
    """Measures the peak memory growth between :meth:`start` and :meth:`peak_bytes` (one thread at a time)."""

    @property
    def name(self) -> str: ...

    def start(self) -> None: ...

    def peak_bytes(self) -> int:
        """Peak bytes above the level at :meth:`start` (>= 0)."""
        ...


def _status_bytes(proc: Path, field: str) -> int:
    for line in (proc / "status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in {proc / 'status'}")


class RssPeakMeter:
    """Peak RSS growth of this process (Linux ``/proc/self/clear_refs`` + ``VmHWM``)."""

    name = "rss_peak"

    def __init__(self, proc: Path = PROC_SELF) -> None:
        self._proc = proc
        self._before = 0

    @classmethod
    def available(cls, proc: Path = PROC_SELF) -> bool:
        """Whether the peak counter can be reset and read here (tries it once)."""
        try:
            (proc / "clear_refs").write_text("5")
            _status_bytes(proc, "VmHWM")
        except OSError:
            return False
        return True

    def start(self) -> None:
        (self._proc / "clear_refs").write_text("5")
        self._before = _status_bytes(self._proc, "VmRSS")

    def peak_bytes(self) -> int:
        return max(0, _status_bytes(self._proc, "VmHWM") - self._before)


class CudaPeakMeter:
    """Peak bytes PyTorch's CUDA allocator handed out above the level at :meth:`start` (GPU only)."""

    name = "cuda_max_memory_allocated"

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._before = 0

    def start(self) -> None:
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._before = torch.cuda.memory_allocated(self._device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self._device)
        return max(0, torch.cuda.max_memory_allocated(self._device) - self._before)


def peak_meter_for(device: torch.device | str) -> PeakMeter | None:
    """The meter for ``device``, or None when peaks cannot be measured there (calibration is then off)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaPeakMeter(dev)
    if dev.type == "cpu" and RssPeakMeter.available():
        return RssPeakMeter()
    logger.warning("cannot measure peak memory on %s; planner calibration is off", dev)
    return None
