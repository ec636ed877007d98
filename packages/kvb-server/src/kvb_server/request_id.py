"""An ``x-request-id`` header on every HTTP response, as OpenAI sends one (and vLLM with
``--enable-request-id-headers``): the openai SDKs expose it as ``request_id`` (``withResponse()`` in Node,
``response._request_id`` in Python) for support tickets and log correlation.

A client's own ``X-Request-Id`` is echoed back when it is a short printable token (a proxy or a gateway
sets one to follow a request through several services); otherwise one is made up. While the request is
handled, :data:`CURRENT` holds it, so the server's log lines about the request (``--enable-log-requests``,
an unexpected error) carry the id a client or gateway can search for.
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
#: The id of the request being handled (None outside one); set by :class:`RequestIdMiddleware`.
CURRENT: ContextVar[str | None] = ContextVar("kvb_request_id", default=None)
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
        text = request_id(scope)
        rid = text.encode("ascii")
        token = CURRENT.set(text)
        # Also on the scope's state (``request.state.request_id``): an unexpected error is answered by
        # Starlette's outermost error middleware, outside this one, after CURRENT is reset.
        scope.setdefault("state", {})["request_id"] = text

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid)]}
            await send(message)

        try:
            await self._app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)
