"""``kvboost-server`` / ``python -m kvb_server``: load a model into KVBoost and serve it over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Sequence
from typing import NamedTuple

from kvb_server._version import __version__
from kvb_server.config import ServerConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
API_KEY_ENV = "KVBOOST_API_KEY"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1048576"`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size; write e.g. 2GiB, 512MB or 1048576")
    return int(float(match.group(1)) * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvboost-server",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, SSE streaming) "
        "on a KVBoost engine that reuses the KV cache of repeated prompt chunks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    model = p.add_argument_group("model")
    model.add_argument("--model", default=DEFAULT_MODEL,
                       help="local model folder, a hub id already in the local Hugging Face cache, or "
                       "'smollm2-135m' for the embedded SmolLM2-135M-Instruct")
    model.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                       help="extra name clients may send as 'model' (repeatable); the engine's model id and "
                       "--model are always accepted")
    model.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when available)")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="weights and KV dtype (default: the checkpoint's)")
    cache = p.add_argument_group("cache")
    cache.add_argument("--max-cache-bytes", type=parse_bytes, default="2GiB",
                       help="byte budget of the in-memory KV chunk store (0 disables reuse)")
    cache.add_argument("--chunk-size", type=int, default=128,
                       help="tokens per cached chunk; also the leading tokens that group requests in a batch")
    cache.add_argument("--warm", action="append", default=[], metavar="TEXT",
                       help="prefill TEXT's KV before serving (repeatable), e.g. a shared system prompt")
    http = p.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1",
                      help="interface to bind; the default serves this machine only, use 0.0.0.0 to expose it")
    http.add_argument("--port", type=int, default=8000, help="TCP port")
    http.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                      help=f"require 'Authorization: Bearer KEY' on every /v1/* route (default: ${API_KEY_ENV}; "
                      "unset: no authentication)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                      help="server log level")
    sched = p.add_argument_group("scheduling")
    sched.add_argument("--max-batch-size", type=int, default=8,
                       help="most non-streamed requests served together in one batched engine call")
    sched.add_argument("--batch-window-ms", type=float, default=5.0,
                       help="how long the worker waits for more requests to join a batch (0: no wait)")
    sched.add_argument("--max-queue-size", type=int, default=256,
                       help="requests waiting for the engine before new ones get HTTP 503")
    sched.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="a request not finished this long after arrival gets HTTP 504 and is stopped")
    sched.add_argument("--max-tokens", type=int, default=1024,
                       help="server-side cap on generated tokens per choice (larger requests are clamped)")
    return p


class Server(NamedTuple):
    """What :func:`build_server` returns: the ASGI app and where to bind it."""

    app: object
    host: str
    port: int


def build_server(args: argparse.Namespace) -> Server:
    """Load the engine, warm it and create the app (everything but binding the socket)."""
    from kvb_cache import KVBoost
    from kvb_server.app import create_app

    engine = KVBoost.from_pretrained(
        args.model, chunk_size=args.chunk_size, max_cache_bytes=args.max_cache_bytes, device=args.device,
        dtype=args.dtype,
    )
    for text in args.warm:
        result = engine.warm(text)
        logger.info("warmed %d tokens (%d new chunks) in %.0f ms", result.tokens, result.new_chunks,
                    result.elapsed_ms)
    names = tuple(dict.fromkeys([engine.model_name, args.model, *args.served_model_name]))
    config = ServerConfig(
        model_names=names, max_queue_size=args.max_queue_size, max_batch_size=args.max_batch_size,
        batch_window_ms=args.batch_window_ms, request_timeout_s=args.request_timeout, max_tokens=args.max_tokens,
        group_prefix_tokens=args.chunk_size, api_key=args.api_key or None,
    )
    return Server(app=create_app(engine, config), host=args.host, port=args.port)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    server = build_server(args)
    if server.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("binding %s without --api-key: anyone who can reach this port can use the model",
                       server.host)
    uvicorn.run(server.app, host=server.host, port=server.port, log_level=args.log_level)
