"""``plan()``: pick the cheapest ladder step whose predicted peak fits, else truncate or refuse."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvb_planner.device import DeviceProfile
from kvb_planner.errors import PlannerConfigError
from kvb_planner.kv_layout import KVQuantLayout
from kvb_planner.ladder import Ladder, LadderStep
from kvb_planner.memory_model import MemoryEstimate, estimate_memory
from kvb_planner.paged_loop import PagedLoop
from kvb_planner.refusal import PlanRefusal
from kvb_planner.request import PlanRequest
from kvb_planner.shape import ModelShape
from kvb_planner.units import to_mb

logger = logging.getLogger(__name__)

DEFAULT_SAFETY_MARGIN = 0.10


class Verdict(str, enum.Enum):
    """What the engine should do with a request."""

    #: Run as asked, with the plan's chunk size and KV bits.
    RUN = "run"
    #: Run with the prompt cut to its last ``RequestPlan.prompt_tokens`` tokens (``auto_truncate`` asked), to
    #: fit memory and/or the model's context length.
    TRUNCATE = "truncate"
    #: Do not run; ``RequestPlan.refusal`` says why and what would fit.
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerPolicy:
    """How cautious the planner is and which settings it may choose.

    Attributes:
        safety_margin: Fraction of free memory kept back, in ``[0, 1)``; a
            :class:`~kvb_planner.calibration.CalibrationTracker` suggests one from observed residuals.
        ladder: Settings in preference order (default: every chunk size at 16 bits, then 8, then 4).
        kv_layout: Quantized KV layout, used for steps with ``kv_bits < 16``.
        loop: The engine serves 16-bit requests from a preallocated paged KV pool in steps of bounded size
            (:class:`~kvb_planner.paged_loop.PagedLoop`); None: each request runs on a cache of its own.
    """

    safety_margin: float = DEFAULT_SAFETY_MARGIN
    ladder: Ladder = field(default_factory=Ladder.default)
    kv_layout: KVQuantLayout = field(default_factory=KVQuantLayout)
    loop: PagedLoop | None = None

    def __post_init__(self) -> None:
        margin = self.safety_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
            raise PlannerConfigError(
                f"safety_margin must be a number in [0, 1) (got {margin!r}); 0.1 keeps 10% back"
            )
        if self.loop is not None and not isinstance(self.loop, PagedLoop):
            raise PlannerConfigError(f"loop must be a PagedLoop or None, got {type(self.loop).__name__}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestPlan:
    """The planner's answer for one request.

    Attributes:
        verdict: Run, run truncated, or refuse.
        step: The chosen ladder step (``None`` when refused).
        prompt_tokens: Prompt tokens to prefill (the last ones of the prompt when truncated).
        dropped_tokens: Leading prompt tokens to drop (``TRUNCATE`` only, else 0).
        estimate: Predicted memory at ``step`` (``None`` when refused).
        free_bytes: Free memory the profile reported.
        budget_bytes: ``free * (1 - safety_margin)``.
        refusal: Payload for the client (``REFUSE`` only); its ``code`` is ``context_length_exceeded`` when
            the request is longer than ``ModelShape.context_length``.
    """

    verdict: Verdict
    step: LadderStep | None
    prompt_tokens: int
    dropped_tokens: int
    estimate: MemoryEstimate | None
    free_bytes: int
    budget_bytes: int
    refusal: PlanRefusal | None = None

    @property
    def admitted(self) -> bool:
        """Whether the engine should run the request (possibly truncated)."""
        return self.verdict is not Verdict.REFUSE

    @property
    def prefill_chunk_size(self) -> int | None:
        """Per-request engine override: prompt tokens per prefill forward (``None`` = single shot)."""
        return self.step.prefill_chunk_size if self.step else None

    @property
    def kv_bits(self) -> int | None:
        """Per-request engine override: KV cache precision (16, 8 or 4; ``None`` when refused)."""
        return self.step.kv_bits if self.step else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary (logs, ``/v1/stats``); a refusal's client body is ``refusal.to_dict()``."""
        return {
            "verdict": self.verdict.value,
            "prefill_chunk_size": self.prefill_chunk_size,
            "kv_bits": self.kv_bits,
            "prompt_tokens": self.prompt_tokens,
            "dropped_tokens": self.dropped_tokens,
            "predicted_peak_mb": to_mb(self.estimate.peak_bytes) if self.estimate else None,
            "free_mb": to_mb(self.free_bytes),
            "budget_mb": to_mb(self.budget_bytes),
            "refusal": self.refusal.to_dict()["error"] if self.refusal else None,
        }


def _largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int:
    """Largest ``n`` in ``[lo, hi]`` with ``fits(n)`` for a monotone (true-then-false) ``fits``; ``lo - 1`` if none."""
    best = lo - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


class _Fit(NamedTuple):
    step: LadderStep
    estimate: MemoryEstimate


def _estimate(
    request: PlanRequest, step: LadderStep, shape: ModelShape, policy: PlannerPolicy, profile: DeviceProfile
) -> MemoryEstimate:
    """:func:`estimate_memory` with everything the policy and the device profile decide."""
    return estimate_memory(
        request,
        step,
        shape,
        layout=policy.kv_layout,
        device=profile.device,
        loop=policy.loop,
        cpu_threads=profile.cpu_threads,
    )


def _first_fit(
    request: PlanRequest, shape: ModelShape, policy: PlannerPolicy, budget: int, profile: DeviceProfile
) -> _Fit | None:
    for step in policy.ladder.steps:
        estimate = _estimate(request, step, shape, policy, profile)
        if estimate.peak_bytes <= budget:
            return _Fit(step, estimate)
    return None


def plan(
    request: PlanRequest, profile: DeviceProfile, shape: ModelShape, policy: PlannerPolicy | None = None
) -> RequestPlan:
    """Walk ``policy.ladder`` and return the first step whose predicted peak fits ``free * (1 - margin)``.

    Pure: the result depends only on the arguments. When no step fits, the answer is a ``TRUNCATE`` plan
    if ``request.auto_truncate`` is set and a shorter prompt fits, else a ``REFUSE`` plan whose
    :class:`PlanRefusal` carries the binary-searched ``suggested_max_tokens``.

    When ``shape.context_length`` is known, a request whose ``prompt_tokens + max_new_tokens`` exceeds it
    never runs as asked: it is truncated to at most ``context_length - max_new_tokens`` prompt tokens (if
    ``auto_truncate`` and that is >= 1; the memory limit may cut it further), else refused with code
    ``context_length_exceeded``. Suggestions never exceed what the context allows.
    """
    # Checked here because they are positional and easy to swap or pass as names (plan(req, "cpu", shape)):
    # the mistake surfaced as an AttributeError deep inside the ladder walk.
    for name, value, cls in (
        ("request", request, PlanRequest),
        ("profile", profile, DeviceProfile),
        ("shape", shape, ModelShape),
        ("policy", policy if policy is not None else PlannerPolicy(), PlannerPolicy),
    ):
        if not isinstance(value, cls):
            hint = " (DeviceProfile.probe(device) builds one)" if cls is DeviceProfile else ""
            raise PlannerConfigError(f"{name} must be a {cls.__name__}{hint}, got {type(value).__name__}")
    policy = policy or PlannerPolicy()
    free = profile.free_bytes
    budget = int(free * (1.0 - policy.safety_margin))
    context = shape.context_length
    over_context = context is not None and request.total_tokens > context
    found = None if over_context else _first_fit(request, shape, policy, budget, profile)
    if found is not None:
        step, estimate = found
        return RequestPlan(
            verdict=Verdict.RUN,
            step=step,
            prompt_tokens=request.prompt_tokens,
            dropped_tokens=0,
            estimate=estimate,
            free_bytes=free,
            budget_bytes=budget,
        )

    def peak(req: PlanRequest, step: LadderStep) -> int:
        return _estimate(req, step, shape, policy, profile).peak_bytes

    # Longest prompt / largest max_new_tokens worth searching: shorter than asked (the request as asked
    # does not fit), and within the context: prompt <= context - max_new_tokens, new <= context - prompt.
    prompt_cap = request.prompt_tokens - 1
    new_cap = request.max_new_tokens - 1
    if context is not None:
        prompt_cap = min(prompt_cap, context - request.max_new_tokens)
        new_cap = min(new_cap, context - request.prompt_tokens)
    steps = policy.ladder.steps
    max_prompt = max(
        _largest_fitting(1, prompt_cap, lambda n, s=s: peak(replace(request, prompt_tokens=n), s) <= budget)
        for s in steps
    )
    if request.auto_truncate and max_prompt >= 1:
        shorter = replace(request, prompt_tokens=max_prompt)
        fit = _first_fit(shorter, shape, policy, budget, profile)
        assert fit is not None, "binary search found a length that no step fits"
        step, estimate = fit
        logger.info(
            "Truncating a %d-token prompt to %d tokens to fit %d bytes (context length: %s tokens)",
            request.prompt_tokens,
            max_prompt,
            budget,
            context,
        )
        return RequestPlan(
            verdict=Verdict.TRUNCATE,
            step=step,
            prompt_tokens=max_prompt,
            dropped_tokens=request.prompt_tokens - max_prompt,
            estimate=estimate,
            free_bytes=free,
            budget_bytes=budget,
        )
    max_new = max(
        _largest_fitting(1, new_cap, lambda n, s=s: peak(replace(request, max_new_tokens=n), s) <= budget)
        for s in steps
    )
    refusal = PlanRefusal(
        prompt_tokens=request.prompt_tokens,
        max_new_tokens=request.max_new_tokens,
        predicted_peak_bytes=min(peak(request, s) for s in steps),
        free_bytes=free,
        budget_bytes=budget,
        suggested_max_tokens=max_prompt,
        suggested_max_new_tokens=max_new,
        context_length=context,
        step_bound=policy.loop is not None and max_prompt < 1 and max_new < 1,
    )
    return RequestPlan(
        verdict=Verdict.REFUSE,
        step=None,
        prompt_tokens=request.prompt_tokens,
        dropped_tokens=0,
        estimate=None,
        free_bytes=free,
        budget_bytes=budget,
        refusal=refusal,
    )
