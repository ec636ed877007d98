"""``kvboost-server`` / ``python -m kvb_server``: load a model into KVBoost and serve it over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvb_server._version import __version__
from kvb_server.config import ServerConfig, add_server_arguments, parse_bytes, tenant_keys
from kvb_server.gate import RequestGate

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
API_KEY_ENV = "KVBOOST_API_KEY"


def margin(text: str) -> float:
    """``--planner-safety-margin``: a fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a fraction in [0, 1); e.g. 0.1 keeps 10% of free memory back"
        )
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (block and scheduling sizes)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


class DeprecatedFlag(argparse.Action):
    """A flag kept so old command lines still start: it warns, and stores into ``replacement``'s value or,
    without a replacement, is ignored."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, *, replacement: str | None = None, **kwargs: Any
    ) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if self.replacement is None:
            logger.warning("%s is deprecated and ignored: requests join the next engine step", option_string)
            return
        logger.warning("%s is deprecated; use %s", option_string, self.replacement)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvboost-server",
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, SSE streaming) "
        "on a KVBoost engine that reuses the KV cache of repeated prompt chunks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="local model folder, a hub id already in the local Hugging Face cache, or "
        "'smollm2-135m' for the embedded SmolLM2-135M-Instruct",
    )
    model.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="extra name clients may send as 'model' (repeatable); the engine's model id and "
        "--model are always accepted",
    )
    model.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when available)")
    model.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV dtype (default: the checkpoint's)",
    )
    cache = p.add_argument_group("cache")
    cache.add_argument(
        "--max-cache-bytes",
        type=parse_bytes,
        default="2GiB",
        help="byte budget of the in-memory KV cache; also sizes the paged block pool (running "
        "requests' KV and reusable prefixes) when --num-blocks is not given (0 disables reuse)",
    )
    cache.add_argument("--chunk-size", type=int, default=128, help="tokens per cached chunk")
    cache.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens per KV block of the paged pool (the unit of prefix sharing between requests)",
    )
    cache.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV blocks in the paged pool; unset: as many as --max-cache-bytes holds",
    )
    cache.add_argument(
        "--warm",
        action="append",
        default=[],
        metavar="TEXT",
        help="prefill TEXT's KV before serving (repeatable), e.g. a shared system prompt",
    )
    cache.add_argument(
        "--kv-cache-bits",
        type=int,
        default=16,
        choices=[16, 8, 4],
        help="precision of cached chunks in every tier: 16 exact, 8/4 KIVI-quantized (more chunks "
        "per byte, approximate reuse)",
    )
    cache.add_argument(
        "--disk-cache-dir",
        default=None,
        metavar="DIR",
        help="add a disk tier under RAM in DIR (survives restarts); default: no disk tier",
    )
    cache.add_argument(
        "--disk-cache-bytes", type=parse_bytes, default="16GiB", help="byte budget of the disk tier"
    )
    cache.add_argument(
        "--remote-url",
        default=None,
        metavar="URL",
        help="redis://host:port/db of a Redis shared by several engine processes "
        "(pip install 'kvb-cache[redis]'); default: no remote tier",
    )
    planning = p.add_argument_group("memory planning (pip install kvb-server[planner])")
    planning.add_argument(
        "--oom-planning",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="predict each request's peak memory before it runs: run it as asked, with prefill "
        "slices or quantized KV, or refuse it with HTTP 413 (default: on when kvb-planner is "
        "installed)",
    )
    planning.add_argument(
        "--auto-truncate",
        action="store_true",
        help="instead of refusing a request that does not fit, keep the end of its prompt "
        "(the latest messages) and report the dropped tokens",
    )
    planning.add_argument(
        "--planner-safety-margin",
        type=margin,
        default=None,
        metavar="FRACTION",
        help="fraction of free memory kept back (default: the calibration tracker's suggested "
        "margin, 0.10 until 16 requests were measured, then their p95 residual in [0.05, 0.5])",
    )
    http = p.add_argument_group("http")
    http.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind; the default serves this machine only, use 0.0.0.0 to expose it",
    )
    http.add_argument("--port", type=int, default=8000, help="TCP port")
    http.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every /v1/* route (default: ${API_KEY_ENV}; "
        "unset: no authentication unless tenant keys are given); the operator's key, the only one that may "
        "reset the cache",
    )
    http.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    add_server_arguments(p)
    sched = p.add_argument_group(
        "scheduling",
        "One engine thread runs steps while requests are unfinished: each step prefills slices of new requests "
        "and decodes one token of every running one, streamed or not; a new request joins at the next step.",
    )
    sched.add_argument(
        "--backend",
        default="cpu-paged",
        choices=["cpu-paged"],
        help="engine loop: continuous batching over the paged KV block pool (the only backend; "
        "accepted for command-line compatibility)",
    )
    sched.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=32,
        help="most requests decoded together in one engine step",
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=1024,
        help="most tokens (prefill + decode) one engine step feeds the model; longer prompts are "
        "prefilled in slices interleaved with the running requests' decoding",
    )
    sched.add_argument(
        "--max-batch-size",
        dest="max_num_seqs",
        type=positive_int,
        action=DeprecatedFlag,
        replacement="--max-num-seqs",
        metavar="N",
        help="deprecated alias of --max-num-seqs",
    )
    sched.add_argument(
        "--batch-window-ms",
        dest="batch_window_ms",
        type=float,
        action=DeprecatedFlag,
        metavar="MS",
        help="deprecated and ignored: there is no batching window, requests join the next step",
    )
    sched.add_argument(
        "--max-queue-size",
        type=int,
        default=256,
        help="requests not running yet (queued or waiting inside the engine) before new ones get "
        "HTTP 503; running requests do not count",
    )
    sched.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a request not finished this long after arrival gets HTTP 504 and is stopped",
    )
    sched.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="server-side cap on generated tokens per choice (larger requests are clamped)",
    )
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

    tenants = tenant_keys(args)  # before the model loads: a bad keys file fails fast
    engine = KVBoost.from_pretrained(
        args.model,
        chunk_size=args.chunk_size,
        max_cache_bytes=args.max_cache_bytes,
        device=args.device,
        dtype=args.dtype,
        kv_cache_bits=args.kv_cache_bits,
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_bytes=args.disk_cache_bytes,
        remote_url=args.remote_url,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    for text in args.warm:
        result = engine.warm(text)
        logger.info(
            "warmed %d tokens (%d new chunks) in %.0f ms", result.tokens, result.new_chunks, result.elapsed_ms
        )
    names = tuple(dict.fromkeys([engine.model_name, args.model, *args.served_model_name]))
    config = ServerConfig(
        model_names=names,
        max_queue_size=args.max_queue_size,
        request_timeout_s=args.request_timeout,
        max_tokens=args.max_tokens,
        api_key=args.api_key or None,
        tenant_keys=tenants,
        max_body_bytes=args.max_body_bytes,
        max_json_depth=args.max_json_depth,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    return Server(
        app=create_app(engine, config, gate=build_gate(args, engine)), host=args.host, port=args.port
    )


def build_gate(args: argparse.Namespace, engine: object) -> RequestGate | None:
    """The planner gate the flags ask for, or None (every request admitted).

    Raises:
        ImportError: ``--oom-planning`` was given but kvb-planner is not installed (names the extra).
        ValueError: ``--auto-truncate`` / ``--planner-safety-margin`` without OOM planning.
    """
    from kvb_server.planner_gate import PlannerGate, planner_available

    enabled = args.oom_planning if args.oom_planning is not None else planner_available()
    if not enabled:
        if args.auto_truncate or args.planner_safety_margin is not None:
            raise ValueError(
                "--auto-truncate and --planner-safety-margin need OOM planning; drop them or drop "
                "--no-oom-planning (and pip install kvb-server[planner])"
            )
        logger.info("OOM planning off: every valid request is admitted")
        return None
    gate = PlannerGate.for_engine(
        engine, auto_truncate=args.auto_truncate, safety_margin=args.planner_safety_margin
    )
    logger.info("OOM planning on: %s", gate.profile.to_dict())
    return gate


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.oom_planning is False and (args.auto_truncate or args.planner_safety_margin is not None):
        parser.error(
            "--auto-truncate and --planner-safety-margin need OOM planning; remove --no-oom-planning"
        )
    try:
        tenant_keys(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvicorn

    server = build_server(args)
    if server.host not in ("127.0.0.1", "localhost", "::1") and not (args.api_key or tenant_keys(args)):
        logger.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", server.host
        )
    uvicorn.run(server.app, host=server.host, port=server.port, log_level=args.log_level)
