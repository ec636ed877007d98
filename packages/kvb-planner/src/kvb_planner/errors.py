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
