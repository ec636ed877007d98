"""``GET /v1/stats``: queue and engine loop, block pool, cache, throughput and tiers, always JSON-serialisable.

kvboost 0.9.0 returned 500 here on CPU machines (it queried CUDA unconditionally) and whenever a stat
was not JSON-native. Every source below is read defensively: a failing source becomes an ``error``
entry, never a failed response, and every value goes through :func:`json_safe`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvb_server.engine import ServingEngine
from kvb_server.worker import EngineWorker

logger = logging.getLogger(__name__)

_MAX_DEPTH = 8


def json_safe(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain JSON types: NaN/inf become None, enums their value, tensors lists or scalars,
    dataclasses dicts, mapping keys strings; anything else its ``str``."""
    if _depth > _MAX_DEPTH:
        return str(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return json_safe(value.value, _depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe(dataclasses.asdict(value), _depth + 1)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(v, _depth + 1) for v in value]
    tolist = getattr(value, "tolist", None)  # torch tensors and numpy arrays/scalars
    if callable(tolist):
        try:
            return json_safe(tolist(), _depth + 1)
        except Exception:  # a meta or otherwise unreadable tensor: fall back to its repr
            return str(value)
    return str(value)


def _guarded(name: str, read: Callable[[], Any]) -> Any:
    try:
        return json_safe(read())
    except Exception as exc:
        logger.warning("stats source %s failed: %r", name, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


class ThroughputMeter:
    """Tokens generated since start, and over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 60.0) -> None:
        self._window_s = window_s
        self._started = time.monotonic()
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0
        self._requests = 0

    def add(self, completion_tokens: int) -> None:
        now = time.monotonic()
        self._total += completion_tokens
        self._requests += 1
        self._events.append((now, completion_tokens))
        cutoff = now - self._window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        uptime = now - self._started
        recent = sum(n for t, n in self._events if t >= now - self._window_s)
        window = min(self._window_s, uptime) or 1e-9
        return {
            "uptime_s": round(uptime, 3),
            "completed_choices": self._requests,
            "completion_tokens": self._total,
            "tokens_per_s_recent": round(recent / window, 3),
            "tokens_per_s_lifetime": round(self._total / (uptime or 1e-9), 3),
            "window_s": self._window_s,
        }


def device_info() -> dict[str, Any]:
    """Accelerator memory only where an accelerator exists (the 0.9.0 bug was asking CUDA on CPU)."""
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        info["cuda_memory_allocated_bytes"] = torch.cuda.memory_allocated()
        info["cuda_memory_reserved_bytes"] = torch.cuda.memory_reserved()
    return info


def planner_info(gate: object) -> Any:
    """The admission gate's own report (the planner's calibration), or ``{"enabled": False}``."""
    stats = getattr(gate, "stats", None)
    return _guarded("planner", stats) if callable(stats) else {"enabled": False}


async def engine_cache_stats(engine: ServingEngine, worker: EngineWorker, timeout_s: float) -> Any:
    """``engine.cache_stats()``, run on the engine thread between steps (the engine is not thread-safe).

    Not bounded by the queue limit, so stats stay readable under overload; a failure or a timeout becomes
    an ``error`` entry.
    """
    try:
        return json_safe(await worker.call(engine.cache_stats, timeout_s=timeout_s, bounded=False))
    except Exception as exc:
        logger.warning("stats source cache failed: %r", exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def paged_info(worker: EngineWorker) -> Any:
    """The engine's block-pool counters as of its last step (``PagedStats.as_dict()``); None before any."""
    paged = worker.paged_stats()
    return None if paged is None else _guarded("paged", paged.as_dict)


#: Sections of ``engine.cache_stats()`` that composed parts add and ``/v1/stats`` shows at its top level.
COMPOSED_PARTS = ("speculative", "streaming")


def stats_snapshot(
    *,
    engine: ServingEngine,
    cache: Any,
    worker: EngineWorker,
    throughput: ThroughputMeter,
    gate: object = None,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``/v1/stats``; ``cache`` is what :func:`engine_cache_stats` returned; ``sampling`` the request
    sampling defaults in effect (``--generation-config``).

    Its ``tiers`` move up a level, and so do the parts a composed engine reports there when they are on
    (``speculative``: ``speculative_stats()``, ``streaming``: ``streaming_stats()``).
    """
    parts = {}
    if isinstance(cache, dict):
        parts = {name: cache.pop(name) for name in COMPOSED_PARTS if name in cache}
    tiers = cache.pop("tiers", None) if isinstance(cache, dict) else None
    return {
        **parts,
        "planner": planner_info(gate),
        "model": _guarded("model", lambda: engine.model_name),
        "sampling_defaults": sampling,
        "queue": _guarded("queue", worker.stats),
        "paged": paged_info(worker),
        "cache": cache,
        "tiers": tiers,
        "throughput": _guarded("throughput", throughput.snapshot),
        "device": _guarded("device", device_info),
    }
