"""Reading a request body and validating it against its pydantic model, every failure an OpenAI-style error.

The size limit (413) and the JSON nesting limit (400) are checked by :mod:`kvb_server.limits`; a validation
error becomes the one 400 that :func:`kvb_server.validation.invalid_parameter` words.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvb_server.config import ServerConfig
from kvb_server.errors import InvalidParameterError
from kvb_server.limits import DEFAULT_MAX_JSON_DEPTH, check_content_headers, decode_json, read_body
from kvb_server.validation import invalid_parameter

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")

#: Bodies larger than this are decoded on a worker thread.
OFFLOAD_PARSE_BYTES = 256 * 2**10
#: Requests whose body is larger than this are tokenized (their plan built) on a worker thread.
OFFLOAD_PLAN_BYTES = 64 * 2**10


def parse_body(raw: bytes, schema: type[ModelT], *, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> ModelT:
    """Decode JSON and validate it against ``schema``, mapping every failure to a 400 naming the parameter.

    The nesting limit is checked before ``json.loads`` runs (see :func:`kvb_server.limits.decode_json`).
    """
    data = decode_json(raw, max_depth=max_depth)
    if not isinstance(data, dict):
        raise InvalidParameterError("The request body must be a JSON object.")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise invalid_parameter(exc, schema) from None


async def parse_request(request: Request, schema: type[ModelT], config: ServerConfig) -> ModelT:
    """Check its headers (415 unless JSON, uncompressed), read the body under ``config``'s size limit, then
    :func:`parse_body` it (413 / 400 on failure)."""
    check_content_headers(request)
    raw = await read_body(request, config.max_body_bytes)
    request.state.body_bytes = len(raw)  # read by off_loop
    if len(raw) > OFFLOAD_PARSE_BYTES:
        # Scanning and decoding a few MiB takes up to ~1 s of CPU: keep it off the event loop.
        return await asyncio.to_thread(parse_body, raw, schema, max_depth=config.max_json_depth)
    return parse_body(raw, schema, max_depth=config.max_json_depth)


async def off_loop(request: Request, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)``, on a worker thread when ``request``'s body was large.

    For the work done before a request is queued (tokenizing a prompt, rendering a chat): a few MiB of
    prompt take seconds to tokenize, and on the event loop that froze every stream, ``/health`` and
    ``/metrics`` meanwhile (fast tokenizers release the GIL while they encode).
    """
    if getattr(request.state, "body_bytes", 0) > OFFLOAD_PLAN_BYTES:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)
