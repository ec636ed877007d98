"""``kvboost-server`` / ``python -m kvb_server``: load a model into KVBoost and serve it over HTTP.

The engine flags are :class:`kvb_cache.EngineArgs`' fields (declared once, with their help); an installed
engine composer (:mod:`kvb_server.composer`, e.g. the meta-package ``kvboost``) adds its own option groups
and builds the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple, NoReturn

from kvb_cache.engine_args import EngineArgs
from kvb_cache.errors import KVBoostError
from kvb_cache.options import (
    ArgumentParser,
    add_option_arguments,
    as_keywords,
    flag_hint,
    from_namespace,
    positive_int,
)
from kvb_server import shutdown_log
from kvb_server._version import __version__
from kvb_server.composer import EngineComposer, find_composer
from kvb_server.config import ServerConfig, add_server_arguments, server_config
from kvb_server.config import parse_bytes as parse_bytes  # re-exported: older code imports it from here
from kvb_server.config_file import add_config_arguments
from kvb_server.flag_types import DeprecatedFlag, HelpFormatter, api_key, margin, port
from kvb_server.gate import RequestGate
from kvb_server.generation_config import AUTO
from kvb_server.generation_config import resolve as resolve_generation_config
from kvb_server.http_options import add_http_arguments, uvicorn_options
from kvb_server.reasoning import PARSERS
from kvb_server.vllm_flags import add_full_stack_flags, add_vllm_flags

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
API_KEY_ENV = "KVBOOST_API_KEY"


class _ModelFlag(argparse.Action):
    """``--model`` and the positional ``MODEL``: both set ``model``; two different models are an error."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = getattr(namespace, "model_given", None)
        if given is not None and given != values:
            parser.error(f"the model is given twice ({given!r} and {values!r}): pass it once")
        namespace.model, namespace.model_given = values, values


def build_parser(
    composer: EngineComposer | None = None, *, prog: str = "kvboost-server"
) -> argparse.ArgumentParser:
    """The server's flags; with ``composer``, its option groups too (see :func:`add_arguments`)."""
    p = ArgumentParser(
        prog=prog,
        description="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, SSE streaming) "
        "on a KVBoost engine that reuses the KV cache of repeated prompt chunks."
        + (f" Engine composed by {composer.name}." if composer is not None else ""),
        formatter_class=HelpFormatter,
    )
    add_arguments(p, composer)
    return p


def add_arguments(p: argparse.ArgumentParser, composer: EngineComposer | None = None) -> None:
    """Add every server flag to ``p``: the model, ``EngineArgs``' engine flags, ``composer``'s option groups
    (when given), memory planning, HTTP, input limits, tenants and scheduling."""
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        action=_ModelFlag,
        help="local model folder, a hub id already in the local Hugging Face cache, or "
        "'smollm2-135m' for the embedded SmolLM2-135M-Instruct",
    )
    # `vllm serve MODEL` takes it as a positional argument: `kvboost serve MODEL` was "unrecognized arguments".
    model.add_argument(
        "model_tag",
        nargs="?",
        default=argparse.SUPPRESS,
        action=_ModelFlag,
        metavar="MODEL",
        help="the model as a positional argument, as `vllm serve MODEL` takes it (the same as --model)",
    )
    model.add_argument(
        "--served-model-name",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME",
        help="extra names clients may send as 'model' (several after one flag, as vLLM takes them, or the "
        "flag repeated); the engine's model id and --model are always accepted",
    )
    model.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template file (or, as vLLM, the template text itself) replacing the tokenizer's "
        "for chat, the Responses API and /tokenize with messages; unset: the model folder's",
    )
    model.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(PARSERS),
        metavar="NAME",
        help="split a reasoning model's thinking (<think>...</think>) out of chat replies into the message's "
        f"reasoning / reasoning_content fields, as vLLM's flag ({', '.join(sorted(PARSERS))}); unset: it "
        "stays in content",
    )
    add_config_arguments(model)
    cache = p.add_argument_group("cache")
    cache.add_argument(
        "--warm",
        action="append",
        default=[],
        metavar="TEXT",
        help="prefill TEXT's KV before serving (repeatable), e.g. a shared system prompt",
    )
    sched = p.add_argument_group(
        "scheduling",
        "One engine thread runs steps while requests are unfinished: each step prefills slices of new requests "
        "and decodes one token of every running one, streamed or not; a new request joins at the next step.",
    )
    groups = {"model": model, "cache": cache, "scheduling": sched}
    add_option_arguments(p, EngineArgs, groups)
    for options in composer.option_classes() if composer is not None else ():
        add_option_arguments(p, options, groups)
    if composer is None:
        add_full_stack_flags(p)
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
    http.add_argument("--port", type=port, default=8000, help="TCP port")
    http.add_argument(
        "--api-key",
        type=api_key,
        # An empty $KVBOOST_API_KEY counts as unset (shells export empty variables); an empty --api-key is
        # refused by its type.
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on every /v1/* route (default: ${API_KEY_ENV}; "
        "unset: no authentication unless tenant keys are given); the operator's key, the only one that may "
        "reset the cache or read /v1/stats",
    )
    http.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level"
    )
    add_http_arguments(http)
    groups["http"] = http
    add_server_arguments(p, groups)
    add_vllm_flags(p)
    sched.add_argument(
        "--backend",
        default="cpu-paged",
        choices=["cpu-paged"],
        help="engine loop: continuous batching over the paged KV block pool (the only backend; "
        "accepted for command-line compatibility)",
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
        "--generation-config",
        default=AUTO,
        metavar="auto|vllm|FOLDER",
        help="sampling defaults of requests that omit temperature, top_p, top_k, min_p, repetition_penalty "
        "or max_tokens: auto takes those the model's generation_config.json sets (as vLLM), vllm the "
        "OpenAI API's, a folder its own generation_config.json",
    )
    sched.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="a JSON object of generation_config fields set over --generation-config's, e.g. '{\"temperature\": "
        "0.5}'; keys among temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens "
        "(null drops that default)",
    )


class Server(NamedTuple):
    """What :func:`build_server` returns: the ASGI app and where to bind it."""

    app: object
    host: str
    port: int


def build_server(
    args: argparse.Namespace, composer: EngineComposer | None = None, *, config: ServerConfig | None = None
) -> Server:
    """Load the engine (``composer``'s, or a plain ``kvb_cache.KVBoost``), warm it and create the app
    (everything but binding the socket)."""
    from kvb_server.app import create_app

    if config is None:
        config = server_config(args)  # before the model loads: bad limits or keys fail fast
    engine = build_engine(args, composer)
    for text in args.warm:
        result = engine.warm(text)
        logger.info(
            "warmed %d tokens (%d cached for prompts starting with them) in %.0f ms",
            result.tokens,
            result.cached_tokens,
            result.elapsed_ms,
        )
    # vLLM's order: the --served-model-name values come first, so /v1/models' first entry, the `model` of a
    # request that leaves it out and the metrics' model_name label are the name the operator chose (the
    # engine's id was first, so `--served-model-name gpt-x` still answered as the checkpoint's path).
    config = replace(
        config,
        model_names=tuple(dict.fromkeys([*args.served_model_name, engine.model_name, args.model])),
        sampling_defaults=resolve_generation_config(
            args.generation_config, engine, args.model, config.override_generation_config
        ),
    )
    if config.sampling_defaults.as_dict():
        logger.info(
            "sampling defaults from --generation-config %s%s (a request's own values win; "
            "--generation-config vllm for OpenAI's): %s",
            args.generation_config,
            " and --override-generation-config" if config.override_generation_config else "",
            config.sampling_defaults.as_dict(),
        )
    if config.chat_template is not None:
        logger.info(
            "chat template from --chat-template %s (replaces the tokenizer's)", _template_source(args)
        )
    elif getattr(engine.tokenizer, "chat_template", None) is None:
        logger.warning(
            "the tokenizer has no chat template: /v1/chat/completions and /v1/responses answer 400 (completions "
            "are served); pass --chat-template FILE to serve chat"
        )
    model = getattr(engine, "model", None)
    if model is not None:
        logger.info("serving %s: %s on %s", engine.model_name, getattr(model, "dtype", "?"), engine.device)
    return Server(
        app=create_app(engine, config, gate=build_gate(args, engine)), host=args.host, port=args.port
    )


def _template_source(args: argparse.Namespace) -> str:
    """``--chat-template``'s file, or ``(inline)`` (the value was the template itself)."""
    value = args.chat_template
    return value if os.path.isfile(value) else "(inline)"


def build_engine(args: argparse.Namespace, composer: EngineComposer | None = None) -> object:
    """The served engine: ``composer.build_engine``, or ``kvb_cache.KVBoost`` with ``EngineArgs``' flags."""
    if composer is not None:
        logger.info("engine composed by %s", composer.name)
        return composer.build_engine(args.model, args)
    from kvb_cache import KVBoost

    return KVBoost.from_pretrained(args.model, **as_keywords(from_namespace(EngineArgs, args)))


def build_gate(args: argparse.Namespace, engine: object) -> RequestGate | None:
    """The planner gate the flags ask for, or None (every request admitted).

    Raises:
        ImportError: ``--oom-planning`` was given but kvb-planner is not installed (names the extra).
        ValueError: ``--auto-truncate`` / ``--planner-safety-margin`` without OOM planning, or planning asked
            for (one of the three flags) on a model the planner cannot describe. Planning on by default
            only is turned off with a warning then.
    """
    from kvb_server.planner_gate import PlannerGate, planner_available, require_planner

    enabled = args.oom_planning if args.oom_planning is not None else planner_available()
    if not enabled:
        if args.auto_truncate or args.planner_safety_margin is not None:
            raise ValueError(
                "--auto-truncate and --planner-safety-margin need OOM planning; drop them or drop "
                "--no-oom-planning (and pip install kvb-server[planner])"
            )
        logger.info("OOM planning off: every valid request is admitted")
        return None
    try:
        gate = PlannerGate.for_engine(
            engine, auto_truncate=args.auto_truncate, safety_margin=args.planner_safety_margin
        )
    except require_planner().PlannerError as exc:
        # The planner models Llama-style decoders; the engine serves more (GPT-2 has no intermediate_size).
        # Planning being only on by default, such a model failed to start until --no-oom-planning was found.
        asked = args.oom_planning or args.auto_truncate or args.planner_safety_margin is not None
        if asked:
            raise ValueError(
                f"OOM planning cannot plan for this model: {exc}; drop --oom-planning / --auto-truncate / "
                "--planner-safety-margin"
            ) from exc
        logger.warning("OOM planning off: the planner cannot describe this model (%s)", exc)
        return None
    logger.info("OOM planning on: %s", gate.profile.to_dict())
    gate.warn_if_no_step_fits()
    return gate


#: What a bad flag value, model or environment raises while the server is built (each part's typed errors
#: subclass one of these: ConfigError / StreamingConfigError / PlannerConfigError are ValueErrors,
#: ModelLoadError an OSError, KernelUnavailableError an ImportError). Anything else is a bug and keeps its
#: traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (KVBoostError, ValueError, ImportError, OSError)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (transformers' load errors span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so a port in use is refused before the model loads (uvicorn
    finds out only after, and exits 1 with its own log line).

    Raises:
        OSError: the address is in use or cannot be bound here (names both).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # uvicorn sets SO_REUSEADDR too: a port left in TIME_WAIT by a server just stopped is not "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port or --host"
            ) from None


def main(argv: Sequence[str] | None = None) -> None:
    """``kvboost-server``: the full stack when an engine composer (the ``kvboost`` meta-package) is installed."""
    composer = find_composer()
    parser = build_parser(composer)
    serve(parser.parse_args(argv), composer, error=exit_with_error(parser))


def exit_with_error(parser: argparse.ArgumentParser) -> Callable[[str], NoReturn]:
    """``prog: error: message`` and status 2, as ``parser.error`` without its usage block: a model that does
    not load or a refused option is not a flag-syntax mistake, and the 55-line usage printed before it
    buried the one line that says what is wrong."""

    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {flag_hint(parser, message)}\n")

    return error


def serve(
    args: argparse.Namespace, composer: EngineComposer | None, *, error: Callable[[str], NoReturn]
) -> None:
    """Check the parsed flags (``error`` exits with one line, :func:`exit_with_error`), build the server and
    run it.

    A user mistake found on the way (a flag value the engine refuses, a model that does not load, a port
    in use) exits through ``error`` too: one line and status 2, never a traceback.
    """
    if args.oom_planning is False and (args.auto_truncate or args.planner_safety_margin is not None):
        error("--auto-truncate and --planner-safety-margin need OOM planning; remove --no-oom-planning")
    if any(not text.strip() for text in args.warm):  # said after the model had loaded, without the flag
        error("--warm needs a non-empty text")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # basicConfig does nothing when the root logger is already set up, as `kvboost serve`'s CLI does (at
    # WARNING): --log-level was then ignored there, and even the default info lines never showed.
    logging.getLogger().setLevel(args.log_level.upper())
    import uvicorn

    try:
        # Everything that can be checked without the model, checked before it loads (that takes minutes
        # on a large checkpoint): the HTTP settings, the engine options, the port.
        config = server_config(args)
        http = uvicorn_options(args)
        from_namespace(EngineArgs, args).engine_config()
        check_port_free(args.host, args.port)
        server = build_server(args, composer, config=config)
    except USER_ERRORS as exc:
        error(one_line(exc))
    if server.host not in ("127.0.0.1", "localhost", "::1") and not (config.api_key or config.tenant_keys):
        logger.warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", server.host
        )
    shutdown_log.install()
    uvicorn.run(
        server.app,
        host=server.host,
        port=server.port,
        # Without it uvicorn waits for every request in flight: a client that stops reading held the
        # process open indefinitely (6 long streams kept a SIGINT'd server up 84 s). Left running then,
        # they are cancelled, which aborts them in the engine.
        timeout_graceful_shutdown=args.shutdown_timeout_s,
        **http,
    )
