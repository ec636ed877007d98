"""Operational routes: ``/health``, ``/metrics``, ``/v1/stats`` and ``/v1/warm``."""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import InvalidParameterError, ServerError
from kvb_server.gate import RequestGate
from kvb_server.metrics import ServerMetrics
from kvb_server.request_plan import parse_body
from kvb_server.schemas import WarmRequest
from kvb_server.service import engine_error
from kvb_server.stats import ThroughputMeter, engine_cache_stats, json_safe, stats_snapshot
from kvb_server.worker import EngineWorker

#: ``/v1/stats`` waits at most this long for the engine thread to finish its step and read the cache.
STATS_TIMEOUT_S = 10.0


def admin_router(
    *,
    engine: ServingEngine,
    config: ServerConfig,
    worker: EngineWorker,
    metrics: ServerMetrics,
    throughput: ThroughputMeter,
    gate: RequestGate | None = None,
) -> tuple[APIRouter, APIRouter]:
    """Returns ``(open_router, v1_router)``: the second is mounted under ``/v1`` behind the API key."""
    open_router = APIRouter()
    v1 = APIRouter(prefix="/v1")

    @open_router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_names[0], "queue_depth": worker.depth}

    @open_router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @v1.get("/stats")
    async def stats() -> dict[str, Any]:
        cache = await engine_cache_stats(engine, worker, min(STATS_TIMEOUT_S, config.request_timeout_s))
        return stats_snapshot(engine=engine, cache=cache, worker=worker, throughput=throughput, gate=gate)

    @v1.post("/warm")
    async def warm(request: Request) -> dict[str, Any]:
        """Prefill texts (a shared system prompt, a document) so later prompts starting with them hit."""
        req = parse_body(await request.body(), WarmRequest)
        texts = ([req.text] if req.text is not None else []) + list(req.texts or [])
        if not texts or any(not t for t in texts):
            raise InvalidParameterError(
                "Give 'text' (a string) or 'texts' (a list of non-empty strings).", param="text"
            )
        started = time.monotonic()
        results = []
        for text in texts:
            try:
                call = functools.partial(engine.warm, text)
                results.append(await worker.call(call, timeout_s=config.request_timeout_s))
            except ServerError:
                raise
            except Exception as exc:
                raise engine_error(exc) from exc
        return {
            "object": "warm",
            "results": [json_safe(r) for r in results],
            "elapsed_ms": round((time.monotonic() - started) * 1e3, 3),
        }

    return open_router, v1
