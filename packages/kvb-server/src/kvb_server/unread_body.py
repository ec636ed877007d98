"""``Connection: close`` on a response sent before the request's body was read.

A route, a dependency or the router may answer before reading the body: a wrong key (401), a tenant key on
an operator route (403), an unknown route (404) or method (405), a body refused on its headers (413, 415),
a web page of another origin (403). A client that sent ``Expect: 100-continue`` withholds its body until it
sees ``100 Continue``; on a connection kept open the server then waits for that body and reads the client's
*next* request as its bytes, and both hang. So whenever the response starts while a declared body is still
unread, the connection is closed after it (RFC 9110 section 10.1.1: the server should say whether it will).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def _declares_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            return True
    return False


class CloseOnUnreadBody:
    """Pure ASGI middleware: ``Connection: close`` when a response starts before the body's last byte."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _declares_body(scope):
            await self._app(scope, receive, send)
            return
        read = False

        async def tracking_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                read = True
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not read:
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self._app(scope, tracking_receive, closing_send)
