"""Requests a web page sends on its own are refused unless its origin was allowed (``--allowed-origins``).

Leaving out CORS headers only stops a page from *reading* replies. A page can still *send* a "simple"
request (``fetch(url, {mode: "no-cors", method: "POST", body})``, an HTML form) with no preflight, and a
server that runs it has generated, warmed or wiped its cache for any site its user visits. Browsers send
an ``Origin`` header with every such request (and non-browser clients, the SDKs and curl, send none), so a
request whose ``Origin`` is neither the server's own origin nor one ``--allowed-origins`` lets in is
answered 403 before it reaches a route. Only methods that change something (``POST``, ``DELETE``, ...):
``GET`` / ``HEAD`` read, and without CORS headers the page cannot read the reply; preflights (``OPTIONS``)
are left to the CORS middleware.

Not covered: a page that makes its own host name resolve to this machine (DNS rebinding) is same-origin
as far as the browser knows; ``--api-key`` covers that (a page cannot know the key).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvb_server.errors import PermissionDeniedError

_DEFAULT_PORTS = {"http": 80, "https": 443}
#: Methods a page may send from anywhere: they change nothing, and the browser keeps the reply from it.
_READS = frozenset({"GET", "HEAD", "OPTIONS"})


def _host_port(netloc: str, scheme: str) -> tuple[str, int | None]:
    parts = urlsplit(f"//{netloc}")
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: no match
        return netloc.lower(), -1
    return (parts.hostname or "").lower(), port if port is not None else _DEFAULT_PORTS.get(scheme)


def is_same_origin(origin: str, host: str, scheme: str) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) names the server the request reached (``Host``
    header ``host``, over ``scheme``). The scheme itself is not compared: behind a TLS-terminating proxy
    the server sees ``http`` for an ``https`` page."""
    parts = urlsplit(origin)
    if not parts.scheme or not parts.netloc:
        return False  # "null" (a sandboxed frame, a file: page) or garbage
    return _host_port(parts.netloc, parts.scheme) in {
        _host_port(host, parts.scheme),
        _host_port(host, scheme),
    }


class CrossOriginGuard:
    """Pure ASGI middleware: 403 for a request that changes something (not ``GET`` / ``HEAD`` /
    ``OPTIONS``) from another origin than ``allowed_origins`` (``"*"``: any)."""

    def __init__(self, app: ASGIApp, *, allowed_origins: tuple[str, ...]) -> None:
        self._app = app
        self._any = "*" in allowed_origins
        self._allowed = {o.rstrip("/").lower() for o in allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._any or scope["method"] in _READS:
            await self._app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        origin = headers.get(b"origin")
        if origin is None:
            await self._app(scope, receive, send)
            return
        text = origin.decode("latin-1").strip()
        host = headers.get(b"host", b"").decode("latin-1")
        if text.rstrip("/").lower() in self._allowed or is_same_origin(
            text, host, scope.get("scheme", "http")
        ):
            await self._app(scope, receive, send)
            return
        error = PermissionDeniedError(
            f"Requests from the web page origin {text!r} are refused: start the server with "
            f"--allowed-origins '[\"{text}\"]' to let pages from it use this server."
        )
        error.code = "cross_origin_refused"
        response = JSONResponse(error.body(), status_code=error.status_code)
        await response(scope, receive, send)
