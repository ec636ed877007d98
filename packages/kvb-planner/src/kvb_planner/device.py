"""What the planner knows about a device: memory now free, bandwidths, and decode speed."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvb_planner.errors import PlannerConfigError, UnsupportedDeviceError, check_int
from kvb_planner.host_memory import CGROUP_ROOT, PROC_CGROUP, read_host_memory
from kvb_planner.probes import (
    FALLBACK_CPU_MEMORY_GBPS,
    FALLBACK_DEVICE_COPY_GBPS,
    ProbeResult,
    ProbeSettings,
    copy_bandwidth,
    decode_step_latency,
    host_to_device_bandwidth,
)
from kvb_planner.units import to_mb

logger = logging.getLogger(__name__)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """A device's capacity as measured by :meth:`probe` (or written by hand for tests and what-ifs).

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        total_bytes: Memory capacity (cgroup-limited RAM on CPU).
        free_bytes: Memory a new request may use now (see :meth:`probe`).
        memory_bandwidth_gbps: Same-device copy bandwidth, read + write bytes per second / 1e9.
        host_to_device_gbps: Pinned host-to-device bandwidth (CUDA only).
        decode_step_ms: Median single-token forward latency of the model given to :meth:`probe`.
        cpu_threads: torch's intra-op threads on a CPU device (``torch.get_num_threads()`` when probed): its
            CPU attention kernel allocates a score tile per thread. None (a profile written by hand, or CUDA):
            that term is not charged.
        fallbacks: Names of the fields that hold a pessimistic fallback instead of a measurement.
    """

    device: str
    total_bytes: int
    free_bytes: int
    memory_bandwidth_gbps: float | None = None
    host_to_device_gbps: float | None = None
    decode_step_ms: float | None = None
    cpu_threads: int | None = None
    fallbacks: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # Any string was taken, and one torch does not parse ("gpu", "CUDA:0") was planned by the CPU's
        # cheaper rules; a torch.device is kept as its string.
        try:
            device = str(torch.device(self.device))
        except (RuntimeError, TypeError, ValueError):
            raise PlannerConfigError(
                f"device must be a torch device such as 'cpu', 'cuda' or 'cuda:0' (got {self.device!r})"
            ) from None
        if device != self.device:
            object.__setattr__(self, "device", device)
        check_int("total_bytes", self.total_bytes, minimum=0)
        check_int("free_bytes", self.free_bytes, minimum=0)
        if self.total_bytes < 0 or self.free_bytes < 0:
            raise PlannerConfigError(
                f"total_bytes and free_bytes must be >= 0 (got {self.total_bytes}, {self.free_bytes})"
            )
        if self.free_bytes > self.total_bytes:
            raise PlannerConfigError(
                f"free_bytes ({self.free_bytes}) cannot exceed total_bytes ({self.total_bytes})"
            )
        threads = self.cpu_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise PlannerConfigError(f"cpu_threads must be an int >= 1 or None (got {threads!r})")
        for name in ("memory_bandwidth_gbps", "host_to_device_gbps", "decode_step_ms"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value > 0
            ):
                raise PlannerConfigError(f"{name} must be a finite number > 0 or None (got {value})")

    @classmethod
    def probe(
        cls,
        device: str | torch.device = "cpu",
        *,
        model: Any | None = None,
        settings: ProbeSettings | None = None,
        cgroup_root: Path = CGROUP_ROOT,
        proc_cgroup: Path = PROC_CGROUP,
    ) -> DeviceProfile:
        """Measure ``device`` now. Every timed probe is bounded by ``settings`` and falls back pessimistically.

        Free memory: on CUDA, the driver's free memory plus what PyTorch's caching allocator holds reserved
        but unused (a new request reuses it first); on CPU, ``min(psutil available, cgroup headroom)``
        (see :mod:`kvb_planner.host_memory`).

        Args:
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
            model: Optional Hugging Face causal LM on ``device``; when given, ``decode_step_ms`` is measured.
            settings: Probe time/size bounds.
            cgroup_root: cgroup mount (CPU only; tests point it at a fake tree).
            proc_cgroup: ``/proc/self/cgroup`` equivalent (CPU only).

        Raises:
            UnsupportedDeviceError: not a CPU/CUDA device, or CUDA asked for where it is unavailable.
        """
        settings = settings or ProbeSettings()
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):  # "tpu", "cuda:x", None: torch's own untyped errors
            raise UnsupportedDeviceError(
                f"cannot probe device {device!r}: not a device name torch parses; use 'cpu', 'cuda' or 'cuda:N'"
            ) from None
        results: dict[str, ProbeResult] = {}
        if dev.type == "cpu":
            ram = read_host_memory(cgroup_root=cgroup_root, proc_cgroup=proc_cgroup)
            total, free = ram.total_bytes, ram.available_bytes
            results["memory_bandwidth_gbps"] = copy_bandwidth(
                dev, settings=settings, fallback=FALLBACK_CPU_MEMORY_GBPS
            )
        elif dev.type == "cuda":
            if not torch.cuda.is_available():
                raise UnsupportedDeviceError(
                    "CUDA is not available here; probe DeviceProfile.probe('cpu') instead"
                )
            dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
            driver_free, total = torch.cuda.mem_get_info(dev)
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
            free = min(total, driver_free + cached)
            results["memory_bandwidth_gbps"] = copy_bandwidth(
                dev, settings=settings, fallback=FALLBACK_DEVICE_COPY_GBPS
            )
            results["host_to_device_gbps"] = host_to_device_bandwidth(dev, settings=settings)
        else:
            raise UnsupportedDeviceError(f"cannot probe a {dev.type!r} device; use 'cpu' or 'cuda[:N]'")
        if model is not None:
            results["decode_step_ms"] = decode_step_latency(model, settings=settings)

        def value(name: str) -> float | None:
            return results[name].value if name in results else None

        profile = cls(
            device=str(dev),
            total_bytes=int(total),
            free_bytes=int(free),
            memory_bandwidth_gbps=value("memory_bandwidth_gbps"),
            host_to_device_gbps=value("host_to_device_gbps"),
            decode_step_ms=value("decode_step_ms"),
            cpu_threads=torch.get_num_threads() if dev.type == "cpu" else None,
            fallbacks=tuple(name for name, result in results.items() if not result.measured),
        )
        logger.info("Probed %s: %s", dev, profile.to_dict())
        return profile

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe view (MB and rounded floats, no NaN/inf)."""
        return {
            "device": self.device,
            "total_mb": to_mb(self.total_bytes),
            "free_mb": to_mb(self.free_bytes),
            "memory_bandwidth_gbps": _rounded(self.memory_bandwidth_gbps),
            "host_to_device_gbps": _rounded(self.host_to_device_gbps),
            "decode_step_ms": _rounded(self.decode_step_ms),
            "cpu_threads": self.cpu_threads,
            "fallbacks": list(self.fallbacks),
        }
