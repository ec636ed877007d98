"""Server settings: what the CLI flags become, validated once. The scalar ones are declared once, as fields
made with :func:`kvb_cache.options.option`; their flags, help and defaults follow from the fields."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvb_cache.chat_content import CONTENT_FORMATS
from kvb_cache.options import add_option_arguments, option, option_fields, parse_bytes, positive_int
from kvb_server.chat_template import load_chat_template
from kvb_server.flag_types import logprobs_cap
from kvb_server.generation_config import NO_DEFAULTS, VLLM, Override, SamplingDefaults, parse_override
from kvb_server.generation_config import check_flag as check_generation_config
from kvb_server.http_options import CorsPolicy, cors_policy
from kvb_server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_JSON_DEPTH, MAX_JSON_DEPTH_LIMIT
from kvb_server.reasoning import parser_syntax


# -- value types of ServerConfig's command-line flags ------------------------------------------------
# Their types refuse what ServerConfig would refuse: checked there only, a bad value failed after the model
# had loaded, with a ValueError traceback instead of a usage error.
def positive_seconds(text: str) -> float:
    """A duration in seconds, > 0 (``--request-timeout``, ``--shutdown-timeout``)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0, e.g. 30")
    return value


def json_depth_flag(text: str) -> int:
    """``--max-json-depth``: 1..MAX_JSON_DEPTH_LIMIT."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_JSON_DEPTH_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a nesting depth in 1..{MAX_JSON_DEPTH_LIMIT}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantKey:
    """An API key whose requests share a prefix-cache namespace of their own.

    Attributes:
        key: the Bearer token clients of this tenant send.
        salt: roots the hash chain of every request made with ``key`` (see :mod:`kvb_server.tenancy`), so
            no other tenant's request can hit, or time, this tenant's cached prefixes.
    """

    key: str
    salt: str

    def __post_init__(self) -> None:
        if not self.key.strip() or not self.salt:
            raise ValueError("a tenant key needs a non-empty key and a non-empty salt, e.g. KEY=SALT")

    def __repr__(self) -> str:  # never print a secret into logs
        return "TenantKey(key='***', salt='***')"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """How the HTTP layer queues, caps and guards requests (batching is the engine's: one step serves all).

    Attributes:
        model_names: names clients may put in ``model``; the first is the one ``/v1/models`` reports first.
        max_queue_size: requests not running yet (submitted, or waiting inside the engine) before new ones
            get 503; running requests do not count.
        request_timeout_s: a request not finished this long after it arrived gets 504.
        max_tokens: server-side cap on generated tokens per choice (requests asking for more are clamped).
        default_completion_max_tokens: ``/v1/completions`` default when ``max_tokens`` is omitted (OpenAI: 16).
        api_key: when set, every ``/v1/*`` route requires ``Authorization: Bearer <api_key>``; it is the
            operator's key (the only one that may reset the cache).
        tenant_keys: more accepted keys, each with its prefix-cache salt; with any of them set, ``/v1/*``
            requires one of these or ``api_key``.
        max_n: most choices one request may ask for.
        max_body_bytes: larger request bodies get 413.
        max_json_depth: bodies nesting arrays/objects deeper get 400 (checked before parsing).
        shutdown_timeout_s: on shutdown, how long the engine thread may take to finish its step and run
            ``engine.close()`` (flushing queued disk/Redis writes).
        close_engine: call ``engine.close()`` on shutdown (off for an engine the caller goes on using
            with its lower tiers open).
        generation_config: ``--generation-config`` as given (``auto``, ``vllm`` or a folder): where
            ``sampling_defaults`` came from, as ``/v1/stats`` reports it. Only a label: the CLI resolves
            the defaults (:func:`kvb_server.generation_config.resolve`); a ServerConfig built directly
            has none unless given, hence ``vllm`` here (the flag's default is ``auto``).
        override_generation_config: ``--override-generation-config`` as parsed (generation_config field
            name -> value, :func:`kvb_server.generation_config.parse_override`): merged into
            ``sampling_defaults`` by the CLI, and reported by ``/v1/stats`` next to ``generation_config``.
        sampling_defaults: what a request omitting a sampling field gets instead of OpenAI's default (the
            generation config's recommendation, :mod:`kvb_server.generation_config`); empty: OpenAI's.
        chat_template: Jinja source that replaces the engine tokenizer's chat template (``--chat-template``,
            :mod:`kvb_server.chat_template`); :func:`kvb_server.create_app` installs it on
            ``engine.tokenizer``, so every route rendering chat messages uses it. None: the tokenizer's own.
        cors: which browser origins get CORS headers (``--allowed-origins`` ...); default none.
        fastapi_docs: serve ``/docs``, ``/redoc`` and ``/openapi.json`` (``--disable-fastapi-docs``: off).
        max_logprobs: most alternatives a request may ask for per token (completions' ``logprobs``, chat's
            ``top_logprobs``), vLLM's ``--max-logprobs``: 20 by default (OpenAI caps chat at 20 and
            completions at 5; vLLM takes 20 for both); -1: the whole vocabulary.
        log_requests: log each generation request's prompt and sampling parameters at INFO
            (``--enable-log-requests``, :mod:`kvb_server.request_log`); off: prompts are users' data.
        max_log_len: with ``log_requests``, the most prompt characters and token ids a line shows
            (``--max-log-len``); None: all.
        reasoning_parser: vLLM's ``--reasoning-parser`` name (:data:`kvb_server.reasoning.PARSERS`): chat
            replies' thinking goes to the message's ``reasoning`` field; None: it stays in ``content``.
    """

    model_names: tuple[str, ...]
    max_queue_size: int = option(
        256,
        group="scheduling",
        parse=positive_int,
        help="requests not running yet (queued or waiting inside the engine) before new ones get "
        "HTTP 503; running requests do not count",
    )
    request_timeout_s: float = option(
        600.0,
        group="scheduling",
        flag="--request-timeout",
        parse=positive_seconds,
        metavar="SECONDS",
        help="a request not finished this long after arrival gets HTTP 504 and is stopped",
    )
    max_tokens: int = option(
        1024,
        group="scheduling",
        parse=positive_int,
        help="server-side cap on generated tokens per choice (larger requests are clamped)",
    )
    default_completion_max_tokens: int = 16
    api_key: str | None = None
    tenant_keys: tuple[TenantKey, ...] = ()
    max_n: int = 16
    max_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES,
        group="input limits",
        parse=parse_bytes,
        cli_default="4MiB",
        help="larger request bodies get HTTP 413 (checked while the body streams in, chunked or not), "
        "e.g. 4MiB",
    )
    max_json_depth: int = option(
        DEFAULT_MAX_JSON_DEPTH,
        group="input limits",
        parse=json_depth_flag,
        help=f"JSON bodies nesting arrays/objects deeper get HTTP 400, checked before parsing (at most "
        f"{MAX_JSON_DEPTH_LIMIT})",
    )
    shutdown_timeout_s: float = option(
        30.0,
        group="http",
        flag="--shutdown-timeout",
        parse=positive_seconds,
        metavar="SECONDS",
        help="on shutdown, how long the requests in flight may take to finish (then they are cancelled), "
        "then how long the engine may take to finish its step and flush queued disk/Redis writes "
        "(engine.close())",
    )
    close_engine: bool = True
    generation_config: str = VLLM
    override_generation_config: Override = field(default_factory=dict)
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    chat_template: str | None = None
    chat_template_content_format: str = option(
        "auto",
        group="model",
        choices=CONTENT_FORMATS,
        metavar="auto|string|openai",
        help="how a message's content reaches the chat template (vLLM's flag): auto reads it from the "
        "template's source, string sends one string (text parts joined by newlines), openai a list of text "
        "parts; set it when auto misreads a template",
    )
    cors: CorsPolicy = field(default_factory=CorsPolicy)
    fastapi_docs: bool = True
    max_logprobs: int = option(
        20,
        group="scheduling",
        parse=logprobs_cap,
        metavar="N",
        help="most alternatives a request may ask for per token (completions' logprobs, chat's "
        "top_logprobs; more is HTTP 400), as vLLM's; -1: the whole vocabulary",
    )
    log_requests: bool = option(
        False,
        group="request logging",
        flag="--enable-log-requests",
        help="log each generation request's prompt, prompt token ids and sampling parameters at INFO "
        "(logger kvb_server.requests; vLLM's flag): prompts are users' data, so off by default",
    )
    max_log_len: int | None = option(
        None,
        group="request logging",
        parse=positive_int,
        metavar="N",
        help="with --enable-log-requests, show at most N prompt characters and N token ids; unset: all",
    )
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            parser_syntax(self.reasoning_parser)  # an unknown name is a ValueError listing the known ones
        if not self.model_names:
            raise ValueError("model_names must hold at least one model name, e.g. ('smollm2-135m',)")
        if not all(isinstance(n, str) and n.strip() for n in self.model_names):
            raise ValueError(
                f"model_names (--served-model-name) must all be non-empty strings, got {list(self.model_names)!r}"
            )
        positive_ints = {
            "max_queue_size": self.max_queue_size,
            "max_tokens": self.max_tokens,
            "default_completion_max_tokens": self.default_completion_max_tokens,
            "max_n": self.max_n,
            "max_body_bytes": self.max_body_bytes,
            "max_json_depth": self.max_json_depth,
        }
        for name, value in positive_ints.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or self.max_logprobs < -1
        ):
            raise ValueError(
                f"max_logprobs must be an integer >= 0, or -1 (no cap), got {self.max_logprobs!r}"
            )
        if self.max_log_len is not None and (not isinstance(self.max_log_len, int) or self.max_log_len < 1):
            raise ValueError(f"max_log_len must be an integer >= 1 or None (all), got {self.max_log_len!r}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must be a non-empty string, or None to disable authentication")
        for key in [self.api_key, *(t.key for t in self.tenant_keys)]:
            if key is not None and not _header_safe(key):
                # HTTP headers are read as latin-1 and keys compared as UTF-8 bytes: such a key never matched.
                raise ValueError(
                    "API keys must be printable ASCII without spaces (they travel in an HTTP header); "
                    "a key with other characters could never be matched"
                )
        if self.max_json_depth > MAX_JSON_DEPTH_LIMIT:
            raise ValueError(
                f"max_json_depth must be at most {MAX_JSON_DEPTH_LIMIT} (the JSON parser recurses per "
                f"level), got {self.max_json_depth}"
            )
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError(
                "chat_template must be a non-empty Jinja template, or None for the tokenizer's own"
            )
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"shutdown_timeout_s must be > 0 seconds, got {self.shutdown_timeout_s}")
        keys = [t.key for t in self.tenant_keys]
        if len(set(keys)) != len(keys) or (self.api_key is not None and self.api_key in keys):
            raise ValueError("every tenant key must be distinct from the others and from api_key")

    @property
    def requires_auth(self) -> bool:
        """Whether ``/v1/*`` needs a Bearer token (``api_key`` or a tenant key is set)."""
        return self.api_key is not None or bool(self.tenant_keys)


def add_server_arguments(
    parser: argparse.ArgumentParser, groups: dict[str, argparse._ArgumentGroup] | None = None
) -> None:
    """ServerConfig's declared options (queue, timeouts, caps, input limits, request logging, shutdown:
    :func:`kvb_cache.options.add_option_arguments`, into ``groups`` by title) and the tenant-key flags,
    which two flags build together (``--api-key`` itself stays with the http flags)."""
    add_option_arguments(parser, ServerConfig, groups)
    tenants = parser.add_argument_group(
        "tenants",
        "Each tenant key gets its own prefix-cache namespace (salt): tenants never hit, or time, each "
        "other's cached prefixes. A request's cache_salt only subdivides its key's namespace.",
    )
    tenants.add_argument(
        "--api-key-salt",
        action="append",
        default=[],
        metavar="KEY=SALT",
        help="accept Bearer KEY on /v1/* and salt its requests' prefix cache with SALT (repeatable); "
        "keys on the command line are visible to local users: prefer --api-keys-file",
    )
    tenants.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        metavar="PATH",
        help='a JSON object {"KEY": "SALT", ...} of tenant keys, as --api-key-salt',
    )


def tenant_keys(args: argparse.Namespace) -> tuple[TenantKey, ...]:
    """The tenant keys of ``--api-key-salt`` and ``--api-keys-file``.

    Raises:
        ValueError: a malformed KEY=SALT or keys file (names the fix).
    """
    pairs: list[tuple[str, str]] = []
    for item in args.api_key_salt:
        key, sep, salt = item.partition("=")
        if not sep:
            raise ValueError(f"--api-key-salt takes KEY=SALT, got {item!r}")
        pairs.append((key, salt))
    if args.api_keys_file is not None:
        try:
            data = json.loads(Path(args.api_keys_file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--api-keys-file {args.api_keys_file}: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise ValueError(
                f'--api-keys-file {args.api_keys_file} must hold a JSON object {{"KEY": "SALT", ...}}'
            )
        pairs.extend(data.items())
    return tuple(TenantKey(key=k, salt=v) for k, v in pairs)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP layer's settings from the flags (model names: ``--served-model-name`` and ``--model``; the
    engine's own id joins them once it is loaded).

    Raises:
        ValueError: a malformed tenant key or keys file, a limit ServerConfig refuses, a
            ``--generation-config`` that is not auto, vllm or a folder holding generation_config.json, an
            ``--override-generation-config`` that is not a JSON object of supported fields in range, or a
            ``--chat-template`` that cannot be read or does not compile.
    """
    check_generation_config(args.generation_config)
    override = (
        {} if args.override_generation_config is None else parse_override(args.override_generation_config)
    )
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    return ServerConfig(
        model_names=tuple(dict.fromkeys([*args.served_model_name, args.model])),
        api_key=args.api_key or None,
        tenant_keys=tenant_keys(args),
        generation_config=args.generation_config,
        override_generation_config=override,
        chat_template=template,
        cors=cors_policy(args),
        fastapi_docs=not args.disable_fastapi_docs,
        reasoning_parser=args.reasoning_parser,
        **{f.name: getattr(args, f.name) for f, spec in option_fields(ServerConfig) if spec.cli},
    )


def _header_safe(key: str) -> bool:
    """Whether ``key`` can be sent as ``Authorization: Bearer <key>`` and compared byte for byte."""
    return key.isascii() and key.isprintable() and " " not in key
