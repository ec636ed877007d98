"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import ModelNotFoundError
from kvb_server.request_plan import GenerationPlan, chat_plan, completion_plan, parse_body
from kvb_server.schemas import ChatCompletionRequest, CompletionRequest
from kvb_server.service import ClientDisconnected, GenerationService, Truncation

#: Status logged for a client that hung up before its response (nginx's convention; never sent).
CLIENT_CLOSED = 499

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def openai_router(
    *, engine: ServingEngine, config: ServerConfig, service: GenerationService, created: int
) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvboost"}

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in config.model_names]}

    @router.get("/models/{model:path}")
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
                return StreamingResponse(stream.sse(), media_type="text/event-stream", headers=headers)
            body = await service.complete(plan, request.is_disconnected)
            truncation = body.get("prompt_truncation")
            headers = Truncation.header_for(truncation["dropped_tokens"]) if truncation else None
            return JSONResponse(body, headers=headers)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(await request.body(), CompletionRequest)
        return await serve(completion_plan(req, engine, config), request)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(await request.body(), ChatCompletionRequest)
        return await serve(chat_plan(req, engine, config), request)

    return router
