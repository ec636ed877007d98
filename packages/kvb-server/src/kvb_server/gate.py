"""Admission: the seam where a planner can refuse (413), reshape or measure a request before it is queued.

A gate sees each generation request after validation and tokenization, and before it takes a place in
the queue. :class:`kvb_server.planner_gate.PlannerGate` (``pip install kvb-server[planner]``) is one that
knows whether the request fits in memory; any object with an ``admit`` method of this shape works.
An admitting decision may carry per-request engine settings (prefill slices, KV bits), a truncation
(keep the last tokens of each prompt) and a :class:`RunProbe` the worker calls around the engine run.
"""

from __future__ import annotations

from collections.abc import Mapping
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
        queue_depth: requests not running yet (submitted to the engine thread or waiting inside the engine).
        constrained: the reply is grammar-constrained (``response_format`` / tools): such requests decode in
            the engine's batched loop, where a quantized private KV (``kv_cache_bits``) is not available.
        prompt_logprobs: each prompt is scored too (echo with logprobs): the engine's prompt scorer runs
            beside the steps on a cache of its own.
    """

    endpoint: str
    model: str
    prompt_tokens: tuple[int, ...]
    max_new_tokens: int
    n: int
    queue_depth: int
    constrained: bool = False
    prompt_logprobs: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Per-request engine overrides (``add_request`` keywords); None leaves the engine's default.

    Attributes:
        prefill_chunk_size: prefill the uncached prompt suffix in slices of this many tokens.
        kv_cache_bits: 8 or 4 hold the request's live KV quantized; 16 or None keep it as computed.
    """

    prefill_chunk_size: int | None = None
    kv_cache_bits: int | None = None

    def __post_init__(self) -> None:
        if self.prefill_chunk_size is not None and (
            isinstance(self.prefill_chunk_size, bool)
            or not isinstance(self.prefill_chunk_size, int)
            or self.prefill_chunk_size < 1
        ):
            raise ValueError(
                f"prefill_chunk_size must be an int >= 1 or None, got {self.prefill_chunk_size!r}"
            )
        if self.kv_cache_bits not in (None, 16, 8, 4):
            raise ValueError(f"kv_cache_bits must be 16, 8, 4 or None, got {self.kv_cache_bits!r}")

    @property
    def is_default(self) -> bool:
        return self.prefill_chunk_size is None and self.kv_cache_bits in (None, 16)


@runtime_checkable
class RunProbe(Protocol):
    """Called by the engine worker around one request's engine run (on the engine thread).

    Only a request that runs alone is measured, so a measurement belongs to one request: :meth:`start` is
    called when it enters an idle engine, :meth:`finish` when it completes and no other request joined a
    step meanwhile (otherwise the measurement is dropped without a call).
    """

    def start(self) -> None:
        """Right before the request is handed to the engine."""
        ...

    def finish(self) -> None:
        """Right after the request completed normally (not when cancelled or failed)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionDecision:
    """A gate's answer. Refusals become HTTP 413 with ``message`` and ``details`` in the error body.

    Attributes:
        admitted: queue the request (possibly reshaped) or refuse it.
        message: for refusals, what the client should change.
        details: for refusals, put under ``error.details``.
        error_fields: for refusals, extra fields placed directly in the ``error`` object (e.g. the
            planner's ``prompt_tokens``, ``predicted_peak_mb``, ``free_mb``, ``suggested_max_tokens``).
        param: for refusals, the OpenAI ``param`` at fault (``"prompt"`` or ``"messages"``).
        settings: engine overrides for every choice of the request.
        keep_last_tokens: serve only the last this-many tokens of each longer prompt (auto-truncation).
        probe: measures the run (calibration); None: not measured.
    """

    admitted: bool
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    error_fields: Mapping[str, Any] = field(default_factory=dict)
    param: str | None = None
    settings: EngineSettings = field(default_factory=EngineSettings)
    keep_last_tokens: int | None = None
    probe: RunProbe | None = None

    def __post_init__(self) -> None:
        if not self.admitted and not self.message:
            raise ValueError("a refusing AdmissionDecision needs a message telling the client what to change")
        if self.keep_last_tokens is not None and self.keep_last_tokens < 1:
            raise ValueError(f"keep_last_tokens must be >= 1 or None, got {self.keep_last_tokens}")


@runtime_checkable
class RequestGate(Protocol):
    """Decides whether a request may be queued. Called on the event loop: keep it fast and non-blocking."""

    def admit(self, request: AdmissionRequest) -> AdmissionDecision: ...


@runtime_checkable
class ReportingGate(Protocol):
    """A gate that also reports its state under ``"planner"`` in ``/v1/stats``."""

    def stats(self) -> Mapping[str, Any]: ...


class AdmitAll:
    """The default gate: every valid request is queued (the queue bound still applies)."""

    def admit(self, request: AdmissionRequest) -> AdmissionDecision:
        return AdmissionDecision(admitted=True)
