"""The exceptions kvb-planner raises. Every one derives from :class:`PlannerError`.

User mistakes also subclass ``ValueError`` so callers that only know the builtins still catch them; each
message says what to change.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error raised by kvb-planner."""


class PlannerConfigError(PlannerError, ValueError):
    """A request, shape, profile, ladder or tracker value is out of range (the message names the fix)."""


class UnsupportedDeviceError(PlannerError, ValueError):
    """The device cannot be probed (unknown type, or CUDA asked for where none is available)."""


def check_int(name: str, value: object, *, minimum: int) -> int:
    """``value`` when it is an int (not a bool) ``>= minimum``; else a :class:`PlannerConfigError` naming it.

    NaN, infinities, floats and strings are counts of nothing: they were accepted and gave NaN or fractional
    byte estimates, or failed later as bare ``ValueError`` / ``OverflowError``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlannerConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value
