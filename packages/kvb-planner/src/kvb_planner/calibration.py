"""Predicted-vs-actual peak memory residuals, and the safety margin they suggest.

A residual is ``(actual - predicted) / predicted``: positive when the memory model under-predicted (the
dangerous side). The tracker keeps a rolling window overall and per ``(prefill_chunk_size, kv_bits)``
cohort, and reports p50/p95 by linear interpolation between order statistics (NumPy's default method).
The suggested margin is the p95 residual clamped to ``[floor, cap]``: with ``free * (1 - p95)`` as the
budget, a prediction that is p95-too-low still fits, because ``(1 + r)(1 - r) <= 1``. Until
``min_samples`` residuals are in, the default margin is returned.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvb_planner.errors import PlannerConfigError
from kvb_planner.ladder import LadderStep


class Cohort(NamedTuple):
    """Residuals are grouped by the engine setting that produced them."""

    prefill_chunk_size: int | None
    kv_bits: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationSettings:
    """Window and margin policy of a :class:`CalibrationTracker`."""

    window: int = 256
    min_samples: int = 16
    default_margin: float = 0.10
    margin_floor: float = 0.05
    margin_cap: float = 0.50

    def __post_init__(self) -> None:
        if self.window < 1:
            raise PlannerConfigError(f"window must be >= 1 (got {self.window})")
        if not 1 <= self.min_samples <= self.window:
            raise PlannerConfigError(
                f"min_samples must be in [1, window={self.window}] (got {self.min_samples})"
            )
        if not 0.0 <= self.margin_floor <= self.margin_cap < 1.0:
            raise PlannerConfigError(
                f"need 0 <= margin_floor <= margin_cap < 1 (got {self.margin_floor}, {self.margin_cap})"
            )
        if not self.margin_floor <= self.default_margin <= self.margin_cap:
            raise PlannerConfigError(
                f"default_margin ({self.default_margin}) must lie in [margin_floor, margin_cap]"
            )


def percentile(values: list[float], q: float) -> float:
    """``q``-th percentile (0..100) of non-empty ``values``, linear interpolation between order statistics."""
    ordered = sorted(values)
    h = (len(ordered) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidualStats:
    """Summary of one window of residuals (``p50``/``p95``/``mean_abs`` are ``None`` when empty)."""

    count: int
    p50: float | None
    p95: float | None
    mean_abs: float | None

    @classmethod
    def of(cls, residuals: list[float]) -> ResidualStats:
        if not residuals:
            return cls(count=0, p50=None, p95=None, mean_abs=None)
        return cls(
            count=len(residuals),
            p50=percentile(residuals, 50),
            p95=percentile(residuals, 95),
            mean_abs=sum(abs(r) for r in residuals) / len(residuals),
        )

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {"count": self.count, "p50": r(self.p50), "p95": r(self.p95), "mean_abs": r(self.mean_abs)}


@dataclass(frozen=True, slots=True, kw_only=True)
class CohortStats:
    """Residual summary of one ``(prefill_chunk_size, kv_bits)`` cohort."""

    cohort: Cohort
    residuals: ResidualStats

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_chunk_size": self.cohort.prefill_chunk_size,
            "kv_bits": self.cohort.kv_bits,
            **self.residuals.to_dict(),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationStats:
    """A snapshot for ``/v1/stats``: overall and per-cohort residuals, and the suggested margin."""

    overall: ResidualStats
    cohorts: tuple[CohortStats, ...]
    suggested_margin: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (``None`` for empty windows, never NaN or inf)."""
        return {
            "overall": self.overall.to_dict(),
            "cohorts": [c.to_dict() for c in self.cohorts],
            "suggested_margin": round(self.suggested_margin, 4),
        }


class CalibrationTracker:
    """Rolling record of predicted vs actual peaks. Thread-safe: an engine thread records while an HTTP
    thread reads :meth:`stats`."""

    def __init__(self, settings: CalibrationSettings | None = None) -> None:
        self._settings = settings or CalibrationSettings()
        self._lock = threading.Lock()
        self._overall: deque[float] = deque(maxlen=self._settings.window)
        self._cohorts: dict[Cohort, deque[float]] = {}

    def record(self, *, predicted_bytes: int, actual_bytes: int, step: LadderStep) -> float:
        """Add one observation and return its residual ``(actual - predicted) / predicted``.

        Raises:
            PlannerConfigError: ``predicted_bytes <= 0`` or ``actual_bytes < 0``, or either is not a finite
                number.
        """
        # NOTE: a NaN passed both comparisons below and stayed in the window: mean_abs turned NaN (and
        # to_dict() emitted it, invalid JSON for /v1/stats) until it rolled out; inf alike.
        for name, value in (("predicted_bytes", predicted_bytes), ("actual_bytes", actual_bytes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PlannerConfigError(f"{name} must be a finite number of bytes (got {value!r})")
        if predicted_bytes <= 0:
            raise PlannerConfigError(f"predicted_bytes must be > 0 (got {predicted_bytes})")
        if actual_bytes < 0:
            raise PlannerConfigError(f"actual_bytes must be >= 0 (got {actual_bytes})")
        residual = (actual_bytes - predicted_bytes) / predicted_bytes
        cohort = Cohort(step.prefill_chunk_size, step.kv_bits)
        with self._lock:
            self._overall.append(residual)
            self._cohorts.setdefault(cohort, deque(maxlen=self._settings.window)).append(residual)
        return residual

    def _margin_of(self, residuals: list[float]) -> float:
        s = self._settings
        if len(residuals) < s.min_samples:
            return s.default_margin
        return min(s.margin_cap, max(s.margin_floor, percentile(residuals, 95)))

    def suggested_margin(self, step: LadderStep | None = None) -> float:
        """Safety margin for :class:`~kvb_planner.planner.PlannerPolicy`: the p95 residual of ``step``'s
        cohort when it has ``min_samples``, else of all residuals; clamped to ``[floor, cap]``."""
        with self._lock:
            overall = list(self._overall)
            cohort = (
                list(self._cohorts.get(Cohort(step.prefill_chunk_size, step.kv_bits), ())) if step else []
            )
        if len(cohort) >= self._settings.min_samples:
            return self._margin_of(cohort)
        return self._margin_of(overall)

    def stats(self) -> CalibrationStats:
        """A consistent snapshot of every window."""
        with self._lock:
            overall = list(self._overall)
            cohorts = {c: list(window) for c, window in self._cohorts.items()}
        ordered = sorted(cohorts, key=lambda c: (-c.kv_bits, c.prefill_chunk_size or 0))
        return CalibrationStats(
            overall=ResidualStats.of(overall),
            cohorts=tuple(CohortStats(cohort=c, residuals=ResidualStats.of(cohorts[c])) for c in ordered),
            suggested_margin=self._margin_of(overall),
        )
