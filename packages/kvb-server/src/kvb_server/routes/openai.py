"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import ModelNotFoundError
from kvb_server.openapi import json_body, responses
from kvb_server.request_body import off_loop, parse_request
from kvb_server.request_plan import GenerationPlan, chat_plan, completion_plan
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest
from kvb_server.schemas.generation_responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)
from kvb_server.service import ClientDisconnected, GenerationService
from kvb_server.streaming import EventStreamResponse
from kvb_server.tenancy import ApiKeys, Caller
from kvb_server.truncation import Truncation

#: Status logged for a client that hung up before its response (nginx's convention; never sent).
CLIENT_CLOSED = 499

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: Statuses a generation route answers besides 200 (documented in the OpenAPI document).
GENERATION_ERRORS = (400, 401, 404, 413, 503, 504)


def openai_router(
    *, engine: ServingEngine, config: ServerConfig, service: GenerationService, keys: ApiKeys, created: int
) -> APIRouter:
    """The ``/v1`` OpenAI routes; ``keys`` authenticates callers (their key salts the prefix cache)."""
    router = APIRouter(prefix="/v1")

    def model_card(name: str) -> dict[str, Any]:
        # vLLM's card adds the context length; clients size prompts from it.
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kvboost",
            "max_model_len": engine.context_length,
        }

    @router.get("/models", responses=responses(errors=(401,)))
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in config.model_names]}

    @router.get("/models/{model:path}", responses=responses(errors=(401, 404)))
    async def get_model(model: str) -> dict[str, Any]:
        if model not in config.model_names:
            raise ModelNotFoundError(model, config.model_names)
        return model_card(model)

    async def serve(plan: GenerationPlan, request: Request) -> Response:
        try:
            if plan.stream:
                # Admission (and a planner's 413) happens before the first byte: a refusal is a plain JSON
                # error response, never a stream.
                stream = await service.open_stream(plan, request.is_disconnected)
                headers = {**SSE_HEADERS, **(stream.truncation.headers() if stream.truncation else {})}
                return EventStreamResponse(stream.sse(), stream, headers)
            body = await service.complete(plan, request.is_disconnected)
            truncation = body.get("prompt_truncation")
            headers = Truncation.header_for(truncation["dropped_tokens"]) if truncation else None
            # NOTE: serialized here, on the event loop, even for a body of tens of MB: json.dumps' C encoder
            # holds the GIL throughout, so a worker thread would not let the loop run meanwhile (measured:
            # 0.45 s to render, a 0.43 s pause of the loop either way). Building it is Python: off the loop.
            return JSONResponse(body, headers=headers)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    # The router-level dependency is the same callable: FastAPI runs it once per request.
    authenticated = Depends(keys)

    @router.post(
        "/completions",
        openapi_extra=json_body(CompletionRequest),
        responses=responses(CompletionResponse, stream=CompletionChunk, errors=GENERATION_ERRORS),
    )
    async def completions(request: Request, caller: Caller = authenticated) -> Response:
        """OpenAI's legacy completions (``stream: true`` for Server-Sent Events)."""
        req = await parse_request(request, CompletionRequest, config)
        plan = await off_loop(request, completion_plan, req, engine, config, key_salt=caller.key_salt)
        return await serve(plan, request)

    @router.post(
        "/chat/completions",
        openapi_extra=json_body(ChatCompletionRequest),
        responses=responses(ChatCompletionResponse, stream=ChatCompletionChunk, errors=GENERATION_ERRORS),
    )
    async def chat_completions(request: Request, caller: Caller = authenticated) -> Response:
        """OpenAI's chat completions (``stream: true`` for Server-Sent Events)."""
        req = await parse_request(request, ChatCompletionRequest, config)
        plan = await off_loop(request, chat_plan, req, engine, config, key_salt=caller.key_salt)
        return await serve(plan, request)

    return router
