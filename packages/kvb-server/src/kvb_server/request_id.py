"""An ``x-request-id`` header on every HTTP response, as OpenAI sends one (and vLLM with
``--enable-request-id-headers``): the openai SDKs expose it as ``request_id`` (``withResponse()`` in Node,
``response._request_id`` in Python) for support tickets and log correlation.

A client's own ``X-Request-Id`` is echoed back when it is a short printable token (a proxy or a gateway
sets one to follow a request through several services); otherwise one is made up.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
#: An incoming id is echoed only if it is this (header-safe, log-safe: no spaces or control characters).
_ACCEPTED = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id(scope: Scope) -> str:
    """The request's id: the client's ``X-Request-Id`` when acceptable, else ``req-<32 hex digits>``."""
    for name, value in scope.get("headers", ()):
        if name == HEADER and _ACCEPTED.fullmatch(value):
            return value.decode("ascii")
    return f"req-{uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Pure ASGI (a ``BaseHTTPMiddleware`` would buffer the streaming responses' cancellation path): adds
    ``x-request-id`` to the response's headers, replacing one a route set."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        rid = request_id(scope).encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid)]}
            await send(message)

        await self._app(scope, receive, send_with_id)
