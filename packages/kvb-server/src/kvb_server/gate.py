"""Admission: the seam where a planner can refuse a request (413) before it is queued.

A gate sees each generation request after validation and tokenization, and before it takes a place in
the queue. ``kvb-planner`` (optional) provides one that knows whether the request's KV fits in memory;
any object with an ``admit`` method of this shape works (structural typing: the provider does not import
kvb_server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionRequest:
    """What a gate may base its decision on.

    Attributes:
        endpoint: ``"completions"`` or ``"chat.completions"``.
        model: the model the request names.
        prompt_tokens: token count of each prompt (one entry per prompt; a choice of ``n`` shares its prompt).
        max_new_tokens: generated-token budget of each choice.
        n: choices per prompt.
        queue_depth: jobs already waiting for the engine.
    """

    endpoint: str
    model: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    n: int
    queue_depth: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionDecision:
    """A gate's answer. Refusals become HTTP 413 with ``message`` and ``details`` in the error body."""

    admitted: bool
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.admitted and not self.message:
            raise ValueError("a refusing AdmissionDecision needs a message telling the client what to change")


@runtime_checkable
class RequestGate(Protocol):
    """Decides whether a request may be queued. Called on the event loop: keep it fast and non-blocking."""

    def admit(self, request: AdmissionRequest) -> AdmissionDecision: ...


class AdmitAll:
    """The default gate: every valid request is queued (the queue bound still applies)."""

    def admit(self, request: AdmissionRequest) -> AdmissionDecision:
        return AdmissionDecision(admitted=True)
