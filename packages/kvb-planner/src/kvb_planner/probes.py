"""Small timed measurements (bandwidth, decode latency), each bounded in time with a pessimistic fallback.

A probe runs one untimed warm-up, then timed repetitions until its time budget or sample cap is spent,
and reports the median. If the warm-up alone overruns the budget, or the measurement raises (e.g. the
buffer does not fit), the probe returns its fallback and says so. The deadline is checked between
repetitions: a single repetition is not interrupted, which is why buffers are kept small.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvb_planner.errors import PlannerConfigError

logger = logging.getLogger(__name__)

# Pessimistic fallbacks: low enough that a scheduler using them never over-commits (a PCIe gen1-x4-class
# link, an old DDR channel, a second per token).
FALLBACK_HOST_TO_DEVICE_GBPS = 1.0
FALLBACK_DEVICE_COPY_GBPS = 50.0
FALLBACK_CPU_MEMORY_GBPS = 1.0
FALLBACK_DECODE_STEP_MS = 1000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSettings:
    """Time and size bounds of each probe.

    Attributes:
        budget_s: Wall-clock budget of one probe, warm-up included.
        max_samples: Timed repetitions at most.
        buffer_bytes: Size of the buffers copied by bandwidth probes.
        decode_context_tokens: Context length the decode-latency probe prefills before timing steps.
    """

    budget_s: float = 0.5
    max_samples: int = 10
    buffer_bytes: int = 64 << 20
    decode_context_tokens: int = 128

    def __post_init__(self) -> None:
        if not self.budget_s > 0:
            raise PlannerConfigError(f"budget_s must be > 0 seconds (got {self.budget_s})")
        if self.max_samples < 1:
            raise PlannerConfigError(f"max_samples must be >= 1 (got {self.max_samples})")
        if self.buffer_bytes < 1:
            raise PlannerConfigError(f"buffer_bytes must be >= 1 (got {self.buffer_bytes})")
        if self.decode_context_tokens < 1:
            raise PlannerConfigError(f"decode_context_tokens must be >= 1 (got {self.decode_context_tokens})")


class ProbeResult(NamedTuple):
    """A measured value, or the fallback (``measured=False``) when the probe failed or overran."""

    value: float
    measured: bool
    samples: int


def run_bounded(
    sample: Callable[[], float],
    *,
    settings: ProbeSettings,
    fallback: float,
    clock: Callable[[], float] = time.perf_counter,
) -> ProbeResult:
    """Median of ``sample()`` over repetitions within ``settings.budget_s`` (first call is a warm-up)."""
    deadline = clock() + settings.budget_s
    values: list[float] = []
    try:
        sample()
        while len(values) < settings.max_samples and clock() < deadline:
            values.append(sample())
    except (RuntimeError, MemoryError) as exc:  # torch raises OOM and device errors as RuntimeError
        logger.warning("Probe failed (%s); using the fallback %s", exc, fallback)
        return ProbeResult(value=fallback, measured=False, samples=0)
    if not values:
        logger.warning(
            "Probe warm-up overran its %.2f s budget; using the fallback %s", settings.budget_s, fallback
        )
        return ProbeResult(value=fallback, measured=False, samples=0)
    return ProbeResult(value=statistics.median(values), measured=True, samples=len(values))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, *, settings: ProbeSettings, fallback: float) -> ProbeResult:
    """Memory bandwidth in GB/s of a same-device copy, counting bytes read plus bytes written."""

    def sample() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        return 2 * settings.buffer_bytes / (time.perf_counter() - start) / 1e9

    try:
        src = torch.ones(settings.buffer_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    except (RuntimeError, MemoryError) as exc:
        logger.warning("Cannot allocate the bandwidth probe buffers (%s); using the fallback", exc)
        return ProbeResult(value=fallback, measured=False, samples=0)
    return run_bounded(sample, settings=settings, fallback=fallback)


def host_to_device_bandwidth(device: torch.device, *, settings: ProbeSettings) -> ProbeResult:
    """Pinned host-to-device copy bandwidth in GB/s (CUDA only)."""

    def sample() -> float:
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _synchronize(device)
        return settings.buffer_bytes / (time.perf_counter() - start) / 1e9

    fallback = FALLBACK_HOST_TO_DEVICE_GBPS
    try:
        src = torch.ones(settings.buffer_bytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(settings.buffer_bytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:
        logger.warning("Cannot allocate the host-to-device probe buffers (%s); using the fallback", exc)
        return ProbeResult(value=fallback, measured=False, samples=0)
    return run_bounded(sample, settings=settings, fallback=fallback)


def cache_keyword(model: Any) -> str:
    """``"cache"`` where ``model``'s forward takes its KV cache under that name (transformers >= 5.24, in the
    forward and its output; the old name warns on every use until 5.40), else ``"past_key_values"``."""
    # The class's forward, not the instance's: a wrapper patched onto one instance takes **kwargs.
    forward = getattr(type(model), "forward", None) or model.forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@torch.no_grad()
def decode_step_latency(model: Any, *, settings: ProbeSettings) -> ProbeResult:
    """Median milliseconds of one single-token forward after ``decode_context_tokens`` of context.

    Args:
        model: A Hugging Face causal LM (called as ``model(input_ids=..., cache=..., use_cache=True)``, or
            ``past_key_values=`` when its forward takes that: transformers < 5.24) already on its device. Its outputs are discarded; its weights are not modified.
    """
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, settings.decode_context_tokens), generator=generator).to(device)
    step_ids = torch.randint(0, vocab, (1, 1), generator=generator).to(device)
    cache = None
    keyword = cache_keyword(model)

    def sample() -> float:
        nonlocal cache
        if cache is None:  # the untimed warm-up call prefills the context
            cache = getattr(model(input_ids=context, use_cache=True), keyword)
        start = time.perf_counter()
        model(input_ids=step_ids, use_cache=True, **{keyword: cache})
        _synchronize(device)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        # Keep every step at the same context length. crop(-1) drops the newest token both in the
        # transformers 5.0 API (negative = remove) and in later ones (only negative accepted).
        if hasattr(cache, "crop"):
            cache.crop(-1)
        return elapsed_ms

    was_training = model.training
    model.eval()
    try:
        return run_bounded(sample, settings=settings, fallback=FALLBACK_DECODE_STEP_MS)
    finally:
        model.train(was_training)
