"""Operational routes: ``/health``, ``/metrics``, ``/v1/stats`` and ``/v1/warm``."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from fastapi import APIRouter, Request, Response

from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import InvalidParameterError, RequestTimeoutError
from kvb_server.gate import RequestGate
from kvb_server.jobs import CallJob, JobIds
from kvb_server.metrics import ServerMetrics
from kvb_server.request_plan import parse_body
from kvb_server.schemas import WarmRequest
from kvb_server.service import engine_error
from kvb_server.stats import ThroughputMeter, json_safe, stats_snapshot
from kvb_server.worker import EngineWorker


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
    ids = JobIds()

    @open_router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_names[0], "queue_depth": worker.depth}

    @open_router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @v1.get("/stats")
    async def stats() -> dict[str, Any]:
        return stats_snapshot(engine, worker, throughput, gate)

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
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            job = CallJob(
                id=ids.next(),
                fn=functools.partial(engine.warm, text),
                future=future,
                deadline=started + config.request_timeout_s,
            )
            worker.submit([job])
            try:
                results.append(await asyncio.wait_for(future, config.request_timeout_s))
            except TimeoutError:
                job.cancelled.set()
                raise RequestTimeoutError(config.request_timeout_s) from None
            except Exception as exc:
                raise engine_error(exc) from exc
        return {
            "object": "warm",
            "results": [json_safe(r) for r in results],
            "elapsed_ms": round((time.monotonic() - started) * 1e3, 3),
        }

    return open_router, v1
