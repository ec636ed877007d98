"""vLLM's HTTP flags: CORS (``--allowed-origins`` ...), ``--root-path``, TLS (``--ssl-certfile``,
``--ssl-keyfile``), ``--disable-uvicorn-access-log`` and ``--disable-fastapi-docs``.

CORS is off unless ``--allowed-origins`` is given. vLLM answers every origin by default (``["*"]``); here a
browser page on another site cannot call a server on this machine unless the operator says so (the server
binds 127.0.0.1 by default, and a page the user merely visits could otherwise drive it): no CORS headers
(the page cannot read replies) and, since requests that need no preflight would still run, a 403 for a
request from another origin (:mod:`kvb_server.cross_origin`). The headers themselves come from Starlette's
``CORSMiddleware``, preflight requests included.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from kvb_cache.options import positive_int

#: vLLM's variable for the keep-alive timeout (it has no flag); ``--timeout-keep-alive`` wins over it.
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"


@dataclass(frozen=True, slots=True, kw_only=True)
class CorsPolicy:
    """Which browser origins may call the server (Starlette's ``CORSMiddleware`` settings).

    Attributes:
        allowed_origins: origins answered with CORS headers (``"*"``: any); empty: no CORS headers at all.
        allowed_methods: methods a preflight may ask for (``"*"``: any).
        allowed_headers: request headers a preflight may ask for (``"*"``: any), e.g. ``Authorization``.
        allow_credentials: let the browser send cookies / HTTP auth (``--allow-credentials``).
    """

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(isinstance(v, str) and v for v in values):
                raise ValueError(f"{name} must be a tuple of non-empty strings, got {values!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def install(self, app: FastAPI) -> None:
        """Put Starlette's ``CORSMiddleware`` outermost on ``app`` (nothing when no origin is allowed):
        preflight requests are answered before routing and authentication, as browsers expect."""
        if self.enabled:
            app.add_middleware(
                CORSMiddleware,
                allow_origins=list(self.allowed_origins),
                allow_methods=list(self.allowed_methods),
                allow_headers=list(self.allowed_headers),
                allow_credentials=self.allow_credentials,
                # A page's script reads only the response headers listed here: the request id (the SDKs'
                # request_id) and the auto-truncation notice.
                expose_headers=list(EXPOSED_HEADERS),
            )


#: Response headers a browser page may read (CORS ``Access-Control-Expose-Headers``).
EXPOSED_HEADERS = ("x-request-id", "x-kvboost-prompt-tokens-dropped")


def string_list(text: str) -> tuple[str, ...]:
    """A flag value that is a JSON list of strings, as vLLM takes it (``'["http://localhost:3000"]'``), or,
    for convenience, one bare value (``'*'``, ``http://localhost:3000``)."""
    stripped = text.strip()
    if not stripped.startswith(("[", "{", '"')):  # anything JSON-looking must be a JSON list
        if not stripped:
            raise argparse.ArgumentTypeError("expected a JSON list of strings or one value, got ''")
        return (stripped,)
    try:
        values = json.loads(stripped)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list: {exc}") from None
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON list of non-empty strings")
    return tuple(values)


def add_http_arguments(http: argparse._ArgumentGroup) -> None:
    """The CORS, root-path, TLS and docs flags (vLLM's names and value formats)."""
    http.add_argument(
        "--allowed-origins",
        type=string_list,
        default=(),
        metavar="JSON_LIST",
        help="browser origins answered with CORS headers and served, e.g. '[\"http://localhost:3000\"]' or "
        "'[\"*\"]' (unset: no CORS headers, and POST/DELETE requests from pages of other origins are "
        "refused; vLLM's default is every origin)",
    )
    http.add_argument(
        "--allowed-methods",
        type=string_list,
        default=("*",),
        metavar="JSON_LIST",
        help="methods a CORS preflight may ask for (with --allowed-origins)",
    )
    http.add_argument(
        "--allowed-headers",
        type=string_list,
        default=("*",),
        metavar="JSON_LIST",
        help="request headers a CORS preflight may ask for (with --allowed-origins)",
    )
    http.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let browsers send cookies / HTTP auth with CORS requests (with --allowed-origins)",
    )
    http.add_argument(
        "--root-path",
        default=None,
        metavar="PATH",
        help="the path prefix a reverse proxy serves this server under (e.g. /llm), for /docs and URLs; "
        "the proxy strips it before forwarding",
    )
    http.add_argument(
        "--timeout-keep-alive",
        type=positive_int,
        default=None,
        metavar="SECONDS",
        help=f"close an idle keep-alive connection after this many seconds (uvicorn's flag; default: "
        f"${KEEP_ALIVE_ENV}, vLLM's variable, else 5); behind a load balancer, set it above the balancer's "
        "idle timeout",
    )
    http.add_argument("--ssl-keyfile", type=Path, default=None, metavar="FILE", help="TLS private key (PEM)")
    http.add_argument(
        "--ssl-certfile",
        type=Path,
        default=None,
        metavar="FILE",
        help="TLS certificate chain (PEM): with it the server speaks HTTPS",
    )
    http.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="do not log a line per request (method, path, status)",
    )
    http.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default=None,
        help="uvicorn's own log level (vLLM's flag); unset: --log-level",
    )
    http.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="do not serve /docs, /redoc and /openapi.json",
    )


def cors_policy(args: argparse.Namespace) -> CorsPolicy:
    """The CORS policy the flags ask for.

    Raises:
        ValueError: a CORS detail flag without ``--allowed-origins`` (it would do nothing).
    """
    if not args.allowed_origins:
        given = [
            flag
            for flag, value, default in (
                ("--allowed-methods", args.allowed_methods, ("*",)),
                ("--allowed-headers", args.allowed_headers, ("*",)),
                ("--allow-credentials", args.allow_credentials, False),
            )
            if value != default
        ]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(
                f"{', '.join(given)} {verb} only with --allowed-origins (no CORS headers are sent without it)"
            )
    return CorsPolicy(
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """``uvicorn.run`` keywords of ``--root-path``, ``--disable-uvicorn-access-log``, ``--uvicorn-log-level``
    and the TLS flags, checked before the model loads: the files are read and the key is matched to the
    certificate here (uvicorn would find out only after).

    Raises:
        ValueError: ``--ssl-keyfile`` without ``--ssl-certfile``, a missing file, a key that does not match
            the certificate, or a root path not starting with ``/``.
    """
    options: dict[str, Any] = {"access_log": False} if args.disable_uvicorn_access_log else {}
    options["log_level"] = args.uvicorn_log_level or args.log_level
    keep_alive = args.timeout_keep_alive
    if keep_alive is None and os.environ.get(KEEP_ALIVE_ENV, "").strip():
        try:
            keep_alive = positive_int(os.environ[KEEP_ALIVE_ENV].strip())
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"${KEEP_ALIVE_ENV}: {exc} (seconds)") from None
    if keep_alive is not None:
        # NOTE: a load balancer keeping idle connections longer than the server (AWS ALB: 60 s; uvicorn: 5 s)
        # sends requests on connections the server is closing and answers them 502.
        options["timeout_keep_alive"] = keep_alive
    if args.root_path is not None:
        if not args.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', e.g. /llm; got {args.root_path!r}")
        options["root_path"] = args.root_path.rstrip("/")
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate chain)")
        return options
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: not a usable PEM "
            f"certificate and matching key ({exc.strerror or exc})"
        ) from None
    options["ssl_certfile"] = str(args.ssl_certfile)
    if args.ssl_keyfile is not None:
        options["ssl_keyfile"] = str(args.ssl_keyfile)
    return options
