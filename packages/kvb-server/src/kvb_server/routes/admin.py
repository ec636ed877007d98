"""Operational routes: ``/health``, ``/version``, ``/metrics``, ``/v1/stats``, ``/v1/warm`` and the cache reset."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from kvb_server._version import __version__
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine, encode_text
from kvb_server.engine_errors import engine_error
from kvb_server.errors import EngineDeadError, InvalidParameterError, ServerError
from kvb_server.gate import RequestGate
from kvb_server.jobs import ClientDisconnected
from kvb_server.limits import check_content_headers, read_body
from kvb_server.metrics import ServerMetrics
from kvb_server.openapi import json_body, responses
from kvb_server.request_body import off_loop, parse_body, parse_request
from kvb_server.routes.openai import CLIENT_CLOSED
from kvb_server.schemas.admin import CacheResetRequest, WarmRequest
from kvb_server.service import GenerationService
from kvb_server.stats import ThroughputMeter, engine_cache_stats, json_safe, stats_snapshot
from kvb_server.tenancy import ApiKeys, Caller, request_salt
from kvb_server.worker import EngineWorker

logger = logging.getLogger(__name__)

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
    keys: ApiKeys,
    service: GenerationService,
) -> tuple[APIRouter, APIRouter]:
    """Returns ``(open_router, v1_router)``: the second is mounted under ``/v1`` behind the API key.

    The cache reset is on both (``/v1/cache/reset``, and vLLM's ``/reset_prefix_cache`` at the root);
    both need the operator's ``--api-key`` when one is set.
    """
    open_router = APIRouter()
    # The router-level dependency is the same callable: FastAPI runs it once per request.
    authenticated = Depends(keys)
    v1 = APIRouter(prefix="/v1")

    @open_router.get("/health")
    async def health() -> Any:
        if worker.dead is not None:
            # vLLM's /health fails once its engine is dead: probes restart the process instead of sending it
            # requests that can only be refused.
            return JSONResponse(EngineDeadError(worker.dead).body(), status_code=503)
        return {"status": "ok", "model": config.model_names[0], "queue_depth": worker.depth}

    @open_router.get("/version")
    async def version() -> dict[str, str]:
        # vLLM's route (clients and dashboards probe it to tell servers apart); never requires a key.
        return {"version": __version__}

    @open_router.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    # NOTE: the operator's, as the reset is: the stats carry every tenant's traffic (the planner's last plan
    # names the last request's prompt length, the cache counters move by another tenant's cached tokens).
    @v1.get("/stats", responses=responses(errors=(401, 403)), dependencies=[Depends(keys.operator)])
    async def stats() -> dict[str, Any]:
        cache = await engine_cache_stats(engine, worker, min(STATS_TIMEOUT_S, config.request_timeout_s))
        sampling = {
            "generation_config": config.generation_config,
            "override_generation_config": dict(config.override_generation_config),
            "overrides": config.sampling_defaults.as_dict(),
        }
        return stats_snapshot(
            engine=engine, cache=cache, worker=worker, throughput=throughput, gate=gate, sampling=sampling
        )

    @v1.post(
        "/warm", openapi_extra=json_body(WarmRequest), responses=responses(errors=(400, 401, 413, 503, 504))
    )
    async def warm(request: Request, caller: Caller = authenticated) -> Any:
        """Prefill texts (a shared system prompt, a document) so later prompts starting with them hit.

        The KV lands in the caller's namespace (its key's salt and the body's ``cache_salt``): only
        requests of that namespace hit it.
        """
        req = await parse_request(request, WarmRequest, config)
        salt = request_salt(caller.key_salt, req.cache_salt)
        texts = ([req.text] if req.text is not None else []) + list(req.texts or [])
        if not texts or any(not t for t in texts):
            raise InvalidParameterError(
                "Give 'text' (a string) or 'texts' (a list of non-empty strings).", param="text"
            )
        started = time.monotonic()
        results = []
        for text in texts:
            # Tokenized here (a large text on a worker thread), not on the engine thread: a 3.9 MiB text
            # stalled every stream for 5 s before the engine refused it as too long.
            ids = await off_loop(request, encode_text, engine, text)
            try:
                results.append(await _warm_one(request, ids, salt))
            except ClientDisconnected:
                return Response(status_code=CLIENT_CLOSED)  # nobody reads it: logged and counted only
        return {
            "object": "warm",
            "results": [json_safe(r) for r in results],
            "elapsed_ms": round((time.monotonic() - started) * 1e3, 3),
        }

    async def _warm_one(request: Request, ids: list[int], salt: str | None) -> Any:
        started = time.monotonic()
        result = await service.warm(ids, cache_salt=salt, is_disconnected=request.is_disconnected)
        summary = functools.partial(
            engine.warm_result,
            ids,
            cache_salt=salt,
            already_cached_tokens=result.cached_tokens,
            elapsed_ms=(time.monotonic() - started) * 1e3,
        )
        return await worker.call(summary, timeout_s=config.request_timeout_s, bounded=False)

    async def reset(request: Request) -> dict[str, Any]:
        # An empty body means the defaults (vLLM's route takes none), however it is framed: no length,
        # Content-Length 0 or an empty chunked body (the last was a 400).
        raw = await read_body(request, config.max_body_bytes)
        if raw.strip():
            check_content_headers(request)
            req = parse_body(raw, CacheResetRequest, max_depth=config.max_json_depth)
        else:
            req = CacheResetRequest()
        call = functools.partial(engine.reset_cache, lower_tiers=req.lower_tiers)
        try:
            # On the engine thread, between steps (the engine is not thread-safe); not bounded by the
            # queue, so an operator can reset an overloaded server.
            result = await worker.call(call, timeout_s=config.request_timeout_s, bounded=False)
        except ServerError:
            raise
        except Exception as exc:
            raise engine_error(exc) from exc
        logger.info("cache reset (lower_tiers=%s): %s", req.lower_tiers, result)
        return {"object": "cache.reset", "lower_tiers": req.lower_tiers, **json_safe(result)}

    reset_doc: dict[str, Any] = {
        "openapi_extra": json_body(CacheResetRequest, required=False),
        "responses": responses(errors=(400, 401, 403, 409, 413, 503, 504)),
        "summary": "Reset the prefix cache",
        "description": "Forget every cached prefix (RAM; with lower_tiers, disk and Redis records too). "
        "Needs the operator's --api-key when one is set; tenant keys get 403.",
    }
    operator = [Depends(keys.operator)]
    v1.post("/cache/reset", dependencies=operator, **reset_doc)(reset)
    open_router.post("/reset_prefix_cache", dependencies=operator, **reset_doc)(reset)

    return open_router, v1
