"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{response_id}``,
``GET /v1/responses/{response_id}/input_items`` and ``POST /v1/responses/input_tokens``.

A translator over the chat route: the request becomes a chat request (:mod:`kvb_server.responses_api.convert`)
served by the same plan and service; its chat completion (or chunks) becomes a response object (or the
Responses stream events, :mod:`kvb_server.responses_api.events`). Stored responses
(:mod:`kvb_server.responses_api.store`) let a request continue one with ``previous_response_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import InvalidParameterError, ServerError, UnsupportedFeatureError
from kvb_server.openapi import json_body, responses
from kvb_server.request_body import off_loop, parse_request
from kvb_server.request_plan import GenerationPlan, chat_plan, chat_prompt_tokens
from kvb_server.responses_api.build import (
    ResponseEnvelope,
    assistant_message,
    output_items,
    status_of,
    usage,
)
from kvb_server.responses_api.convert import (
    INCLUDABLE,
    ChatTranslation,
    responses_error,
    to_chat,
    unknown_includes,
    wants_logprobs,
)
from kvb_server.responses_api.events import StreamTranslator, sse
from kvb_server.responses_api.items import DEFAULT_LIMIT, MAX_LIMIT, Item, page, resolve_references
from kvb_server.responses_api.objects import (
    DeletedResponse,
    InputItemList,
    InputTokenCount,
    ResponseObject,
    ResponseStreamEvent,
)
from kvb_server.responses_api.schemas import InputTokensRequest, ResponsesRequest
from kvb_server.responses_api.store import ResponseNotFoundError, ResponseStore
from kvb_server.responses_api.truncation import fitting_plan
from kvb_server.routes.openai import CLIENT_CLOSED, GENERATION_ERRORS, SSE_HEADERS
from kvb_server.service import ClientDisconnected, GenerationService
from kvb_server.streaming import EventStreamResponse
from kvb_server.tenancy import ApiKeys, Caller
from kvb_server.truncation import Truncation

T = TypeVar("T")


async def _off_loop(
    request: Request, previous_response_id: str | None, fn: Callable[..., T], *args: object, **kwargs: object
) -> T:
    """:func:`~kvb_server.request_body.off_loop` by the conversation's size, not only the body's: a
    follow-up's body is small while the stored conversation it continues may be long (an audit, 2026-12-02:
    a 157-byte follow-up rendered 1,500 stored messages on the event loop, ``/health`` blocked meanwhile)."""
    if previous_response_id is not None:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return await off_loop(request, fn, *args, **kwargs)


def refuse_retrieve_options(query: Mapping[str, str]) -> None:
    """Refuse, by name, what ``GET /v1/responses/{id}`` cannot do. The openai SDK's
    ``responses.retrieve(id, stream=True)`` sent ``?stream=true`` and got the stored JSON, which it read as an
    empty stream (no events, no error); ``include[]`` was ignored likewise."""
    if query.get("stream", "false").lower() not in ("false", "0", ""):
        raise UnsupportedFeatureError(
            "stream: resuming a response's stream is not supported; GET without stream returns the stored "
            "response.",
            param="stream",
        )
    if "starting_after" in query:
        raise UnsupportedFeatureError(
            "starting_after: resuming a response's stream is not supported.", param="starting_after"
        )
    # A repeated ``include[]`` (the SDK's list encoding) gives every value through getlist.
    values = [
        v
        for name in ("include", "include[]")
        for v in (query.getlist(name) if hasattr(query, "getlist") else [query.get(name)])
        if v
    ]
    unknown = unknown_includes(values)
    if unknown:  # the others change nothing here: a stored response holds the logprobs it was created with
        raise UnsupportedFeatureError(
            f"include: {', '.join(map(repr, unknown))} not supported; this server adds "
            f"{' and '.join(map(repr, INCLUDABLE))} only (at creation).",
            param="include",
        )


def responses_router(
    *,
    engine: ServingEngine,
    config: ServerConfig,
    service: GenerationService,
    keys: ApiKeys,
    store: ResponseStore | None = None,
) -> APIRouter:
    """The ``/v1/responses`` routes; stored responses live in ``store`` (a new one by default)."""
    router = APIRouter(prefix="/v1")
    store = store if store is not None else ResponseStore()
    authenticated = Depends(keys)

    def default_model(previous_response_id: str | None, caller: Caller) -> str:
        """The model a request that leaves ``model`` out is served by (and echoes): a follow-up's, its
        previous response's served name; otherwise the first served model, as on the chat route."""
        previous = (
            store.get(caller.key_salt, previous_response_id) if previous_response_id is not None else None
        )
        name = previous.response.get("model") if previous is not None else None
        return name if name in config.model_names else config.model_names[0]

    def translate(req: ResponsesRequest, caller: Caller) -> tuple[ChatTranslation, tuple[Item, ...]]:
        """The chat request serving ``req``, and the input items its stored response keeps (the
        inherited ones, then its own, references resolved)."""
        inherited: tuple[dict[str, Any], ...] = ()
        inherited_items: tuple[Item, ...] = ()
        if req.previous_response_id is not None:
            previous = store.get(caller.key_salt, req.previous_response_id)
            if previous is None:
                # 400, not 404: the route exists; a parameter of the body names nothing (OpenAI's choice too).
                raise InvalidParameterError(
                    f"Previous response with id '{req.previous_response_id}' not found. This server keeps "
                    "responses in memory (not across restarts, only the most recent ones, never with "
                    "store: false), per API key.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            inherited, inherited_items = previous.conversation, previous.history()
        req, own = resolve_references(req, lambda i: store.item(caller.key_salt, i), inherited_items)
        if config.reasoning_parser is not None and wants_logprobs(req):
            raise UnsupportedFeatureError(
                "include: message.output_text.logprobs (or top_logprobs) is not supported with "
                "--reasoning-parser: the thinking's tokens would be mixed into the message's.",
                param="include" if req.include else "top_logprobs",
            )
        return to_chat(req, inherited), (*inherited_items, *own)

    def keep(
        caller: Caller,
        req: ResponsesRequest,
        response: dict[str, Any],
        t: ChatTranslation,
        items: tuple[Item, ...],
    ) -> None:
        if req.store is not False:
            conversation = (*t.conversation, assistant_message(response["output"]))
            store.put(caller.key_salt, response, conversation, items)

    async def stream_events(
        plan: GenerationPlan,
        request: Request,
        req: ResponsesRequest,
        caller: Caller,
        t: ChatTranslation,
        items: tuple[Item, ...],
        envelope: ResponseEnvelope,
    ) -> Response:
        # Admission errors and failures before the first token are still plain HTTP errors.
        stream = await service.open_stream(plan, request.is_disconnected)
        translator = StreamTranslator(envelope)

        async def events() -> AsyncIterator[bytes]:
            # aclosing: a client that hangs up cancels this generator, and the chat stream's cleanup
            # (cancelling its engine job) runs at once rather than at garbage collection.
            async with contextlib.aclosing(stream.chunks()) as chunks:
                for event in translator.start():
                    yield sse(event)
                async for payload in chunks:
                    if isinstance(payload, str):  # "[DONE]"
                        break
                    for event in translator.feed(payload):
                        yield sse(event)
                    if translator.failed:
                        return
            end = translator.final()
            keep(
                caller, req, end.response, t, items
            )  # before the last event: a follow-up may come right after it
            for event in end.events:
                yield sse(event)

        headers = {**SSE_HEADERS, **(stream.truncation.headers() if stream.truncation else {})}
        return EventStreamResponse(events(), stream, headers)

    @router.post(
        "/responses",
        openapi_extra=json_body(ResponsesRequest),
        responses=responses(ResponseObject, stream=ResponseStreamEvent, errors=GENERATION_ERRORS),
    )
    async def create_response(request: Request, caller: Caller = authenticated) -> Response:
        """OpenAI's Responses API over the chat machinery (``stream: true`` for its Server-Sent Events)."""
        req = await parse_request(request, ResponsesRequest, config)
        if req.model is None:
            req = req.model_copy(update={"model": default_model(req.previous_response_id, caller)})
        try:
            t, items = translate(req, caller)
            plan = await _off_loop(
                request,
                req.previous_response_id,
                fitting_plan,
                t.request,
                lambda chat: chat_plan(chat, engine, config, key_salt=caller.key_salt),
                truncate=req.truncation == "auto",
            )
            envelope = ResponseEnvelope.new(req, config.sampling_defaults)
            if plan.stream:
                return await stream_events(plan, request, req, caller, t, items, envelope)
            body = await service.complete(plan, request.is_disconnected)
        except ServerError as exc:
            raise responses_error(exc) from None
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        choice = body["choices"][0]
        output = output_items(choice["message"], choice["finish_reason"], choice.get("logprobs"))
        status = status_of(choice["finish_reason"])
        response = envelope.object(status, output, usage=usage(body["usage"]))
        keep(caller, req, response, t, items)
        truncation = body.get("prompt_truncation")
        headers = Truncation.header_for(truncation["dropped_tokens"]) if truncation else None
        return JSONResponse(response, headers=headers)

    @router.post(
        "/responses/input_tokens",
        openapi_extra=json_body(InputTokensRequest),
        responses=responses(InputTokenCount, errors=(400, 401, 404, 413)),
    )
    async def count_input_tokens(request: Request, caller: Caller = authenticated) -> dict[str, Any]:
        """The prompt tokens ``POST /v1/responses`` would queue for this input (rendered by the same chat
        template, tools included), as OpenAI's input-token count; nothing is generated or stored."""
        body = await parse_request(request, InputTokensRequest, config)
        if body.personality is not None:
            raise UnsupportedFeatureError(
                "personality: personality presets are not supported.", param="personality"
            )
        if body.truncation == "auto":  # the count is the whole input's: a client asks to know whether it fits
            raise UnsupportedFeatureError(
                "truncation: 'auto' is not supported when counting input tokens; the count is of the whole "
                "input (POST /v1/responses with truncation 'auto' drops the oldest items that do not fit).",
                param="truncation",
            )
        try:
            t, _ = translate(body.as_request(default_model(body.previous_response_id, caller)), caller)
            tokens = await _off_loop(
                request, body.previous_response_id, chat_prompt_tokens, t.request, engine, config
            )
        except ServerError as exc:
            raise responses_error(exc) from None
        return {"object": "response.input_tokens", "input_tokens": len(tokens)}

    @router.get("/responses/{response_id}", responses=responses(ResponseObject, errors=(400, 401, 404)))
    async def get_response(
        response_id: str, request: Request, caller: Caller = authenticated
    ) -> dict[str, Any]:
        """A stored response (this server's lifetime, the most recent ones, per API key)."""
        refuse_retrieve_options(request.query_params)
        stored = store.get(caller.key_salt, response_id)
        if stored is None:
            raise ResponseNotFoundError(response_id)
        return stored.response

    @router.get(
        "/responses/{response_id}/input_items", responses=responses(InputItemList, errors=(400, 401, 404))
    )
    async def list_input_items(
        response_id: str,
        request: Request,
        caller: Caller = authenticated,
        limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        """The input items of a stored response: the whole conversation it continued (inherited input and
        output items), then its own input, as a cursor page (newest first unless ``order=asc``)."""
        if any(request.query_params.get(name) for name in ("include", "include[]")):
            raise UnsupportedFeatureError(
                "include: include is not supported (no images, logprobs or tool outputs to add).",
                param="include",
            )
        stored = store.get(caller.key_salt, response_id)
        if stored is None:
            raise ResponseNotFoundError(response_id)
        return page(stored.items, limit=limit, order=order, after=after)

    @router.delete("/responses/{response_id}", responses=responses(DeletedResponse, errors=(401, 404)))
    async def delete_response(response_id: str, caller: Caller = authenticated) -> dict[str, Any]:
        """Forget a stored response (it can no longer be continued or read)."""
        if not store.delete(caller.key_salt, response_id):
            raise ResponseNotFoundError(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
