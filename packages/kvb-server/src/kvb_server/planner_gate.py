"""The memory planner as the server's admission gate (``pip install kvb-server[planner]``).

:class:`PlannerGate` asks :func:`kvb_planner.plan` about every request before it is queued:

- it fits (possibly only with prefill slices or quantized KV): admitted, and the chosen
  ``prefill_chunk_size`` / ``kv_cache_bits`` go to the engine for that request only;
- it does not fit and auto-truncation is on: admitted with each prompt cut to its last
  ``suggested_max_tokens`` tokens;
- otherwise: refused, HTTP 413 with the planner's numbers in OpenAI's error object.

Requests that run alone are measured (:mod:`kvb_server.peak_memory`) and the actual peak is fed to a
:class:`kvb_planner.CalibrationTracker`, whose suggested margin is the default safety margin.

kvb-planner is an optional dependency: it is imported when a gate is built, never at module import.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvb_cache.core.paged_attention import NAME as PAGED_ATTENTION
from kvb_server.gate import AdmissionDecision, AdmissionRequest, EngineSettings
from kvb_server.peak_memory import PeakMeter, peak_meter_for

if TYPE_CHECKING:
    from kvb_planner import (
        CalibrationTracker,
        DeviceProfile,
        Ladder,
        LadderStep,
        ModelShape,
        PagedLoop,
        RequestPlan,
    )

logger = logging.getLogger(__name__)

PLANNER_EXTRA = "pip install kvb-server[planner]"
MIB = 1 << 20  # kvb-planner reports "MB" as MiB


def require_planner() -> ModuleType:
    """``kvb_planner``, or an ImportError that names the extra to install."""
    try:
        import kvb_planner
    except ImportError as exc:
        raise ImportError(
            f"OOM planning needs the kvb-planner package: {PLANNER_EXTRA} (or start the server with "
            "--no-oom-planning)"
        ) from exc
    return kvb_planner


def planner_available() -> bool:
    try:
        require_planner()
    except ImportError:
        return False
    return True


def warm_up(model: Any) -> None:
    """Make the loaded model's memory resident before the probe and the first measured request.

    safetensors weights are memory-mapped: their pages become resident on first use, so without this the
    probe over-states free memory by the weights' size and the first request's peak RSS includes them
    (measured: a 2.5 MB prediction against ~350 MB of RSS growth on SmolLM2-135M). One short forward also
    starts the thread pools and lazy kernels, as kvb-planner's benchmark does before it measures.
    """
    import torch

    with torch.no_grad():
        for param in model.parameters():
            param.sum()
        ids = torch.zeros((1, 4), dtype=torch.long, device=model.device)
        model(input_ids=ids, use_cache=True)


def shape_for_engine(shape: Any, engine: Any) -> Any:
    """``shape`` (a ``kvb_planner.ModelShape``) describing what ``engine``'s loop really runs.

    - KV per token: what the pool keeps per layer holding keys/values of its own (``kv_layer_shapes``:
      ``kv_heads x key_dim`` and ``kv_heads x value_dim`` channels; Gemma 4's global layers are wider, Gemma
      3n's shared layers hold none), and the attention phase sized by the widest head.
    - Attention: the engine loop's paged attention (``kvb_paged``) runs SDPA over the gathered context with a
      mask built per block of query rows, so it is planned as ``sdpa``. The planner charges an implementation
      it does not know as eager (score matrices materialised): a 4000-token SmolLM2 prefill was predicted
      at 1354 MiB against a profiled tensor peak of 136 MiB (288 MiB as ``sdpa``, its KV included).

    - Weights: a kvb-streaming model whose int4 kernel dequantizes blocks of a linear's weight per call
      (``"torch"``) holds that block on top of the activations: ``weight_transient_bytes`` (measured: a
      SmolLM2-shaped AWQ model's 16-token request peaked at 10.5 MiB against 0.94 MiB predicted without it).

    The KV is left as the config says for an engine without ``kv_layer_shapes`` (not a ``kvb_cache.KVBoost``).
    """
    if shape.attn_implementation == PAGED_ATTENTION:
        shape = replace(shape, attn_implementation="sdpa")
    transient = _weight_transient_bytes(getattr(engine, "model", None))
    if transient:
        shape = replace(shape, weight_transient_bytes=transient)
    layers = getattr(engine, "kv_layer_shapes", None)
    if not layers:
        return shape
    channels = tuple((s.kv_heads * s.key_dim, s.kv_heads * s.value_dim) for s in layers)
    widest = max(max(s.key_dim, s.value_dim) for s in layers)
    return replace(shape, kv_layer_channels=channels, head_dim=max(shape.head_dim, widest))


def _weight_transient_bytes(model: Any) -> int:
    """A kvb-streaming model's ``StreamingRuntime.transient_bytes``, else 0. kvb-streaming is not a
    dependency of this package: a model it loaded means it is already imported, so it is only looked up."""
    streaming = sys.modules.get("kvb_streaming")
    if streaming is None or model is None:
        return 0
    try:
        return int(streaming.get_runtime(model).transient_bytes)
    except streaming.NotAStreamingModelError:
        return 0


def loop_for_engine(engine: Any) -> PagedLoop | None:
    """kvb-planner's :class:`~kvb_planner.PagedLoop` for an engine serving from a preallocated paged KV pool
    (one with ``step_limits``, as ``kvb_cache.KVBoost``), else None (each request planned on a cache of its
    own).

    Without it every request was planned as ``model.generate`` runs one: its whole KV charged (it goes into
    the pool, allocated before the probe), a prefill as long as the prompt (the loop feeds at most
    ``max_num_batched_tokens`` per step) and nothing for the loop's own attention (gathered context,
    per-block masks) nor for other requests sharing the step; and its 8/4-bit fallbacks moved a request out
    of the pool onto a quantized cache of its own, which adds memory instead of saving it.
    """
    limits = getattr(engine, "step_limits", None)
    if limits is None:
        return None
    return require_planner().PagedLoop(**dataclasses.asdict(limits))


def cache_growth(engine: Any) -> Callable[[], int]:
    """What the gate subtracts from the free memory it probed: bytes ``engine``'s caches have taken since this
    call that the probe counted as free.

    For a ``kvb_cache.KVBoost`` that is its chunk store (``engine.store``: the content-indexed chunks
    stitching keeps, outside the KV pool), not the pool: the engine loop allocates its pool when it is built,
    before the probe (on the CPU ``torch.zeros`` writes every page, so it is resident too). Subtracting the
    blocks that fill the pool (``cache_stats()["bytes"]``, as this gate did) counted it twice and, once it had
    filled with cached blocks (a server's steady state), could leave no memory for any request. An engine
    without a store is taken at its ``cache_stats()["bytes"]``.
    """
    stats = getattr(getattr(engine, "store", None), "stats", None)
    if callable(stats):

        def cached() -> int:
            return int(stats().bytes)

    else:

        def cached() -> int:
            return int(engine.cache_stats().get("bytes", 0) or 0)

    baseline = cached()
    return lambda: max(0, cached() - baseline)


class _PeakProbe:
    """Measures one request's run and records it against the planner's prediction."""

    def __init__(self, gate: PlannerGate, meter: PeakMeter, predicted_bytes: int, step: LadderStep) -> None:
        self._gate = gate
        self._meter = meter
        self._predicted = predicted_bytes
        self._step = step

    def start(self) -> None:
        self._meter.start()

    def finish(self) -> None:
        self._gate.record(
            predicted_bytes=self._predicted, actual_bytes=self._meter.peak_bytes(), step=self._step
        )


class PlannerGate:
    """A :class:`kvb_server.RequestGate` backed by kvb-planner.

    Args:
        shape: the served model's dimensions. Its ``context_length`` is not planned against: the server checks
            the context itself before the gate (against the engine's limit, which the KV pool may lower),
            and lets a prompt that is only scored fill the whole context while the gate is asked about one
            new token, which the planner's own context rule would refuse.
        profile: the device's memory, probed once (at start-up by :meth:`for_engine`; injected in tests).
        auto_truncate: cut prompts that do not fit to their last tokens instead of refusing them.
        safety_margin: fixed fraction of free memory kept back, in ``[0, 1)``; None: the calibration
            tracker's suggested margin, re-read for every request.
        tracker: predicted-vs-actual residuals (a fresh tracker when None).
        ladder: settings the planner may pick (default: kvb-planner's, single shot then slices, 16/8/4 bits).
        meter: measures each solo run's peak for calibration; None: no calibration.
        used_bytes: memory taken since the probe by things the planner does not model, read per request
            (the engine's chunk store grows as it caches); subtracted from the probed free memory.
        loop: the engine serves from a preallocated paged KV pool in steps of bounded size
            (:func:`loop_for_engine`); None: each request is planned on a cache of its own.
    """

    def __init__(
        self,
        *,
        shape: ModelShape,
        profile: DeviceProfile,
        auto_truncate: bool = False,
        safety_margin: float | None = None,
        tracker: CalibrationTracker | None = None,
        ladder: Ladder | None = None,
        meter: PeakMeter | None = None,
        used_bytes: Callable[[], int] | None = None,
        loop: PagedLoop | None = None,
    ) -> None:
        self._planner = require_planner()
        if safety_margin is not None and not 0.0 <= safety_margin < 1.0:
            raise ValueError(
                f"safety_margin must be in [0, 1) (e.g. 0.1 keeps 10% back), got {safety_margin}"
            )
        self.shape = shape
        self._plan_shape = replace(shape, context_length=None)
        self.profile = profile
        self.auto_truncate = auto_truncate
        self.safety_margin = safety_margin
        self.tracker = tracker or self._planner.CalibrationTracker()
        self.ladder = ladder or self._planner.Ladder.default()
        self._meter = meter
        self._used_bytes = used_bytes
        self.loop = loop
        self._lock = threading.Lock()
        self._decisions: Counter[str] = Counter()
        self._last_plan: RequestPlan | None = None
        self._last_measurement: dict[str, Any] | None = None

    @classmethod
    def for_engine(
        cls, engine: Any, *, auto_truncate: bool = False, safety_margin: float | None = None
    ) -> PlannerGate:
        """Probe ``engine``'s device once (its model already loaded) and plan for its model.

        ``engine`` needs ``model`` (a Hugging Face model), ``device`` and ``cache_stats()["bytes"]``
        (``kvb_cache.KVBoost`` has all three); its ``kv_layer_shapes``, when it has them, replace the config's
        uniform-layer KV figure and its attention is planned as the SDPA the engine runs
        (:func:`shape_for_engine`); its ``step_limits``, when it has them, plan the engine loop's steps
        (:func:`loop_for_engine`).
        """
        planner = require_planner()
        model = engine.model
        shape = shape_for_engine(planner.ModelShape.from_config(model.config, dtype=model.dtype), engine)
        warm_up(model)
        profile = planner.DeviceProfile.probe(engine.device)

        return cls(
            shape=shape,
            profile=profile,
            auto_truncate=auto_truncate,
            safety_margin=safety_margin,
            meter=peak_meter_for(engine.device),
            used_bytes=cache_growth(engine),
            loop=loop_for_engine(engine),
        )

    def warn_if_no_step_fits(self) -> bool:
        """Log a warning, at start-up, when one step of the engine loop does not fit the budget: every request
        would then be refused (413), whatever its length. Returns whether a step fits (True without a loop)."""
        if self.loop is None:
            return True
        p = self._planner
        floor = p.estimate_memory(
            p.PlanRequest(prompt_tokens=1, max_new_tokens=1),
            p.LadderStep(prefill_chunk_size=None),
            self._plan_shape,
            device=self.profile.device,
            loop=self.loop,
            cpu_threads=self.profile.cpu_threads,
        ).peak_bytes
        budget = int(self.free_bytes() * (1.0 - self.margin()))
        if floor <= budget:
            logger.info(
                "OOM planning: one engine step needs about %.1f MiB beside the KV pool; %.1f MiB may be used",
                floor / MIB,
                budget / MIB,
            )
            return True
        # Name the knobs that apply here: the margin when the operator set it (0.995 keeps almost everything
        # back), --gpu-memory-utilization only on CUDA (it is refused elsewhere).
        on_cuda = str(self.profile.device).startswith("cuda")
        pool = "--gpu-memory-utilization, --max-cache-bytes" if on_cuda else "--max-cache-bytes"
        margin = (
            f", lower --planner-safety-margin ({self.safety_margin:g} of free memory is kept back)"
            if self.safety_margin is not None
            else ""
        )
        logger.warning(
            "OOM planning: one engine step needs about %.1f MiB beside the KV pool but only %.1f MiB may be "
            "used, so every request will be refused (413): lower --max-num-batched-tokens or --max-num-seqs, "
            "leave more memory outside the pool (%s)%s, or start with --no-oom-planning",
            floor / MIB,
            budget / MIB,
            pool,
            margin,
        )
        return False

    # ------------------------------------------------------------------------------------------- gate
    def free_bytes(self) -> int:
        """The probed free memory minus what ``used_bytes`` reports taken since."""
        used = self._used_bytes() if self._used_bytes is not None else 0
        return max(0, self.profile.free_bytes - used)

    def margin(self) -> float:
        return self.safety_margin if self.safety_margin is not None else self.tracker.suggested_margin()

    def admit(self, request: AdmissionRequest) -> AdmissionDecision:
        p = self._planner
        sequences = len(request.prompt_tokens) * request.n
        plan_request = p.PlanRequest(
            prompt_tokens=max(request.prompt_tokens),
            max_new_tokens=request.max_new_tokens,
            batch_size=sequences,
            auto_truncate=self.auto_truncate,
            prompt_logprobs=request.prompt_logprobs,
        )
        profile = replace(self.profile, free_bytes=self.free_bytes())
        ladder = self.ladder
        if request.constrained or self.loop is not None:
            # Grammar-constrained requests cannot take a quantized KV: plan with full-precision steps only
            # (slicing the prefill is still fine), so such a request is sliced or refused, never quantized.
            # Nor is any request of an engine loop: a quantized one runs on a cache of its own beside the
            # loop's steps, adding to them, so where a full step does not fit it does not make room.
            exact = tuple(s for s in ladder.steps if s.kv_bits == 16)
            ladder = p.Ladder(steps=exact) if exact else ladder
        result = p.plan(
            plan_request,
            profile,
            self._plan_shape,
            p.PlannerPolicy(safety_margin=self.margin(), ladder=ladder, loop=self.loop),
        )
        with self._lock:
            self._decisions[result.verdict.value] += 1
            self._last_plan = result
        if result.refusal is not None:
            error = result.refusal.to_dict()["error"]
            return AdmissionDecision(
                admitted=False,
                message=error["message"],
                error_fields=error,
                param="prompt" if request.endpoint == "completions" else "messages",
            )
        step = result.step
        bits = step.kv_bits if step.kv_bits != 16 else None
        probe = None
        if self._meter is not None and sequences == 1:
            probe = _PeakProbe(self, self._meter, result.estimate.peak_bytes, step)
        return AdmissionDecision(
            admitted=True,
            settings=EngineSettings(prefill_chunk_size=step.prefill_chunk_size, kv_cache_bits=bits),
            keep_last_tokens=result.prompt_tokens if result.dropped_tokens else None,
            probe=probe,
        )

    # ------------------------------------------------------------------------------------ calibration
    def record(self, *, predicted_bytes: int, actual_bytes: int, step: LadderStep) -> float:
        """Feed one measured run to the tracker; returns its residual ``(actual - predicted) / predicted``."""
        residual = self.tracker.record(predicted_bytes=predicted_bytes, actual_bytes=actual_bytes, step=step)
        with self._lock:
            self._last_measurement = {
                "predicted_mb": round(predicted_bytes / MIB, 3),
                "actual_mb": round(actual_bytes / MIB, 3),
                "residual": round(residual, 4),
                "prefill_chunk_size": step.prefill_chunk_size,
                "kv_bits": step.kv_bits,
            }
        logger.debug(
            "planner calibration: predicted %d B, measured %d B (residual %+.3f)",
            predicted_bytes,
            actual_bytes,
            residual,
        )
        return residual

    def stats(self) -> Mapping[str, Any]:
        """``/v1/stats["planner"]``: JSON-safe (finite numbers, None for unknowns)."""
        with self._lock:
            decisions = dict(self._decisions)
            last_plan = self._last_plan.to_dict() if self._last_plan is not None else None
            last_measurement = dict(self._last_measurement) if self._last_measurement else None
        calibration = self.tracker.stats().to_dict()
        calibration["samples"] = calibration["overall"]["count"]
        return {
            "enabled": True,
            "auto_truncate": self.auto_truncate,
            "device": self.profile.to_dict(),
            "free_mb_now": round(self.free_bytes() / MIB, 3),
            "safety_margin": {"fixed": self.safety_margin, "in_use": round(self.margin(), 4)},
            "measurement": self._meter.name if self._meter is not None else None,
            "loop": dataclasses.asdict(self.loop) if self.loop is not None else None,
            "decisions": {v: decisions.get(v, 0) for v in ("run", "truncate", "refuse")},
            "calibration": calibration,
            "last_plan": last_plan,
            "last_measurement": last_measurement,
        }
