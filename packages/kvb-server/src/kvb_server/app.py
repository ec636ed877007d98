"""``create_app``: the FastAPI application serving one engine."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvb_server._version import __version__
from kvb_server.config import ServerConfig
from kvb_server.cross_origin import CrossOriginGuard
from kvb_server.engine import ServingEngine
from kvb_server.errors import AuthenticationError, InvalidParameterError, ServerError
from kvb_server.gate import AdmitAll, RequestGate
from kvb_server.metrics import ServerMetrics
from kvb_server.openapi import install_openapi
from kvb_server.request_id import RequestIdMiddleware
from kvb_server.responses_api.objects import (
    DeletedResponse,
    InputItemList,
    InputTokenCount,
    ResponseObject,
    ResponseStreamEvent,
)
from kvb_server.responses_api.schemas import InputTokensRequest, ResponsesRequest
from kvb_server.routes import admin_router, openai_router, tokenize_router
from kvb_server.routes.openai import CLIENT_CLOSED
from kvb_server.routes.responses import responses_router
from kvb_server.schemas.admin import CacheResetRequest, WarmRequest
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest
from kvb_server.schemas.generation_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)
from kvb_server.schemas.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from kvb_server.service import GenerationService
from kvb_server.stats import ThroughputMeter
from kvb_server.tenancy import ApiKeys
from kvb_server.unread_body import CloseOnUnreadBody
from kvb_server.unserved_routes import method_not_allowed_message, not_found_message
from kvb_server.worker import EngineWorker

logger = logging.getLogger(__name__)

#: Routes whose latency is a generation's latency (the histogram is per route).
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
KNOWN_ROUTES = GENERATION_ROUTES | {
    "/health",
    "/version",
    "/metrics",
    "/v1/models",
    "/v1/stats",
    "/v1/warm",
    "/v1/cache/reset",
    "/reset_prefix_cache",
    "/tokenize",
    "/detokenize",
}


def _cache_config(engine: ServingEngine) -> Mapping[str, Any] | None:
    """The engine's cache settings for ``vllm:cache_config_info``; None (no such metric) when its stats
    cannot be read: a failing stats source must not keep the server from starting (``/v1/stats`` reports
    the error)."""
    try:
        return engine.cache_stats()
    except Exception as exc:
        logger.warning("vllm:cache_config_info left out: the engine's cache_stats() failed (%r)", exc)
        return None


class _RequestMetrics:
    """ASGI middleware counting responses by route and status, and timing generations to their last byte."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.monotonic()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        path = route_path(scope)
        # Bounded label values: unknown paths (scanners, typos) share one label.
        route = (
            path
            if path in KNOWN_ROUTES
            else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        )
        try:
            await self._app(scope, receive, send_wrapper)
        finally:
            self._metrics.requests.labels(route=route, status=str(status["code"])).inc()
            if route in GENERATION_ROUTES and status["code"] == 200:
                self._metrics.latency.labels(route=route).observe(time.monotonic() - started)


def route_path(scope: Scope) -> str:
    """The path the routes match: uvicorn puts ``--root-path`` in front of ``scope["path"]`` (Starlette
    takes it off again to route), so counting by ``scope["path"]`` put every request under ``other``."""
    path, root = scope["path"], scope.get("root_path", "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def _error_response(exc: ServerError) -> JSONResponse:
    headers = dict(exc.headers or {})
    if isinstance(exc, AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers or None)


def create_app(engine: ServingEngine, config: ServerConfig, *, gate: RequestGate | None = None) -> FastAPI:
    """Build the server application for ``engine``.

    Args:
        engine: what generates (``kvb_cache.KVBoost``, or anything with :class:`ServingEngine`'s methods).
        config: queueing, caps, input limits, API keys, shutdown, sampling defaults and the chat template
            (a ``chat_template`` is installed on ``engine.tokenizer``).
        gate: admission hook consulted before a request is queued (e.g.
            :class:`kvb_server.planner_gate.PlannerGate`); default admits all. A gate with a ``stats()``
            method is reported under ``"planner"`` in ``/v1/stats``.
    """
    if config.chat_template is not None:
        # NOTE: set on the tokenizer, as vLLM's server did: every route rendering chat messages
        # (engine.chat_prompt), tool-syntax detection and /tokenizer_info read the template from there.
        engine.tokenizer.chat_template = config.chat_template
    worker = EngineWorker(engine, config)
    metrics = ServerMetrics(
        worker_stats=worker.stats,
        paged_stats=worker.paged_stats,
        model_name=config.model_names[0],
        max_model_len=engine.context_length,
        speculative_stats=worker.speculative_stats,
        cache_config=_cache_config(engine),
    )
    throughput = ThroughputMeter()
    gate = gate or AdmitAll()
    service = GenerationService(
        config=config, worker=worker, metrics=metrics, gate=gate, throughput=throughput, engine=engine
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        logger.info("serving %s (queue %d)", ", ".join(config.model_names), config.max_queue_size)
        try:
            yield
        finally:
            # New work gets 503 from here on; the engine thread closes the engine (flushing queued tier
            # writes) after its last step, within the timeout.
            await worker.stop(close_engine=config.close_engine, timeout_s=config.shutdown_timeout_s)

    keys = ApiKeys(config)

    docs = {} if config.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="KVBoost OpenAI-compatible server", version=__version__, lifespan=lifespan, **docs)
    app.add_middleware(CrossOriginGuard, allowed_origins=config.cors.allowed_origins)
    app.add_middleware(_RequestMetrics, metrics=metrics)
    app.add_middleware(CloseOnUnreadBody)
    app.add_middleware(RequestIdMiddleware)
    config.cors.install(app)  # added last: outermost
    open_routes, admin_v1 = admin_router(
        engine=engine,
        config=config,
        worker=worker,
        metrics=metrics,
        throughput=throughput,
        gate=gate,
        keys=keys,
        service=service,
    )
    app.include_router(open_routes)
    auth = [Depends(keys)]
    app.include_router(admin_v1, dependencies=auth)
    app.include_router(
        openai_router(engine=engine, config=config, service=service, keys=keys, created=int(time.time())),
        dependencies=auth,
    )
    app.include_router(
        responses_router(engine=engine, config=config, service=service, keys=keys), dependencies=auth
    )
    app.include_router(tokenize_router(engine=engine, config=config), dependencies=auth)
    install_openapi(
        app,
        models=(
            CompletionRequest,
            ChatCompletionRequest,
            CompletionResponse,
            ChatCompletionResponse,
            CompletionChunk,
            ChatCompletionChunk,
            WarmRequest,
            CacheResetRequest,
            TokenizeRequest,
            TokenizeResponse,
            DetokenizeRequest,
            DetokenizeResponse,
            TokenizerInfoResponse,
            ResponsesRequest,
            ResponseObject,
            ResponseStreamEvent,
            DeletedResponse,
            InputItemList,
            InputTokensRequest,
            InputTokenCount,
        ),
        model_names=config.model_names,
        max_n=config.max_n,
        max_logprobs=None if config.max_logprobs == -1 else config.max_logprobs,
    )

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
        loc = [p for p in first.get("loc", ()) if p != "body"]
        return _error_response(
            InvalidParameterError(
                str(first.get("msg", "invalid request")), param=str(loc[0]) if loc else None
            )
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ServerError(str(exc.detail), code=None)
        body = err.body()
        body["error"]["type"] = "invalid_request_error" if exc.status_code < 500 else "server_error"
        if exc.status_code == 404:
            # A route OpenAI has but this server does not (/v1/embeddings, ...) says so by name.
            # scope["path"] is the path as the client sent it (--root-path included once; request.url
            # put the root path in front of it a second time).
            body["error"]["message"] = not_found_message(request.method, request.scope["path"])
        elif exc.status_code == 405:  # e.g. GET /v1/chat/completions: OpenAI's stored completions list
            body["error"]["message"] = method_not_allowed_message(request.method, request.scope["path"])
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client hung up while sending its body: nobody reads this, it is only logged and counted.
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        # %r: the path is URL-decoded, so a %0a in it would have started a forged log line.
        logger.exception("unhandled error on %r (x-request-id %s)", request.scope["path"], rid)
        return JSONResponse(
            ServerError(f"Internal server error: {type(exc).__name__}").body(),
            status_code=500,
            headers={"x-request-id": rid} if rid else None,
        )

    return app
