"""Byte/megabyte conversion for JSON payloads: finite, rounded numbers only."""

from __future__ import annotations

import math

MIB = 1 << 20


def to_mb(num_bytes: float, *, digits: int = 1) -> float:
    """Bytes to MiB rounded to ``digits``; raises on NaN/inf so a payload can never carry them.

    Raises:
        ValueError: ``num_bytes`` is not finite (an internal bug: every byte count here is computed from ints).
    """
    if not math.isfinite(num_bytes):
        raise ValueError(f"byte count must be finite, got {num_bytes!r}")
    return round(num_bytes / MIB, digits)
