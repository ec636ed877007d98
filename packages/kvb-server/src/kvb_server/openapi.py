"""The OpenAPI document: request bodies the routes parse themselves, response and stream-chunk schemas.

The generation routes read their bodies through :mod:`kvb_server.limits` before pydantic sees them, so
FastAPI cannot infer their request bodies. Each such route declares its body with :func:`json_body` (an
``openapi_extra`` referencing a component) and :func:`install_openapi` adds the models as components, so
``/docs`` shows them and schema-driven fuzzers (schemathesis) generate them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvb_server.schemas.errors import ErrorResponse

_REF = "#/components/schemas/{model}"


def ref(model: type[BaseModel]) -> dict[str, str]:
    """A JSON-schema reference to ``model``'s component (registered by :func:`install_openapi`)."""
    return {"$ref": _REF.format(model=model.__name__)}


def json_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body ``model`` describes."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": ref(model)}}}}


def responses(
    ok: type[BaseModel] | None = None, *, stream: type[BaseModel] | None = None, errors: Sequence[int] = ()
) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses``: 200 as ``ok`` (and ``text/event-stream`` events as ``stream``), and the
    error statuses it can answer, all with OpenAI's error body."""
    out: dict[int | str, dict[str, Any]] = {}
    content: dict[str, Any] = {}
    if ok is not None:
        content["application/json"] = {"schema": ref(ok)}
    if stream is not None:
        # One Server-Sent Event (OpenAPI 3.2's generic SSE item; 3.1 tools such as schemathesis read
        # ``schema`` per event): its ``data`` is a chunk as JSON, an error object, or the final "[DONE]".
        content["text/event-stream"] = {
            "schema": {
                "type": "object",
                "required": ["data"],
                "properties": {
                    "event": {"type": "string"},
                    "data": {
                        "anyOf": [
                            {
                                "type": "string",
                                "contentMediaType": "application/json",
                                "contentSchema": {"anyOf": [ref(stream), ref(ErrorResponse)]},
                            },
                            {"const": "[DONE]"},
                        ],
                        "description": f"a {stream.__name__} as JSON; an ErrorResponse if the request "
                        "fails after the stream started; [DONE] last",
                    },
                },
            }
        }
    if content:
        out[200] = {"content": content}
    for status in errors:
        out[status] = {
            "description": _ERROR_DESCRIPTIONS.get(status, "error"),
            "content": {"application/json": {"schema": ref(ErrorResponse)}},
        }
    return out


_ERROR_DESCRIPTIONS = {
    400: "invalid body or parameter (also: invalid UTF-8, JSON nested deeper than --max-json-depth)",
    401: "missing or wrong API key",
    403: "the API key may not use this route",
    404: "unknown model (or, on /v1/responses/{id}, unknown or expired response id)",
    409: "the cache cannot be reset while requests are running or waiting; retry when idle",
    413: "body larger than --max-body-bytes, or refused by the memory planner",
    503: "queue full or shutting down",
    504: "not finished within --request-timeout",
}


def install_openapi(
    app: FastAPI,
    models: Sequence[type[BaseModel]],
    *,
    model_names: Sequence[str] = (),
    max_n: int | None = None,
    max_logprobs: int | None = None,
) -> None:
    """Make ``app.openapi()`` (``/openapi.json``, ``/docs``) include ``models`` and the models they use as
    components, next to what FastAPI generates from the routes.

    ``model_names`` become the ``enum`` of every ``model`` string property of those components: this
    server answers any other name with 404, and fuzzers then reach past that check. ``max_n`` (the
    server's cap on ``n``) becomes the ``maximum`` of every integer ``n``, ``max_logprobs``
    (``--max-logprobs``; None: no cap) that of completions' ``logprobs`` and chat's ``top_logprobs``.
    """
    caps = {"n": max_n, "top_logprobs": max_logprobs}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            _, defs = models_json_schema(
                [(m, "validation") for m in (*models, ErrorResponse)], ref_template=_REF
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
                properties = definition.get("properties", {})
                model = properties.get("model")
                if model_names and model is not None and model.get("type") == "string":
                    model["enum"] = list(model_names)
                # Completions' logprobs is a count; chat's (and the Responses API's) a boolean.
                fields = {**caps, "logprobs": max_logprobs if name == "CompletionRequest" else None}
                for field, cap in fields.items():
                    for branch in properties.get(field, {}).get("anyOf", ()):
                        if cap is not None and branch.get("type") == "integer":
                            branch["maximum"] = cap
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
