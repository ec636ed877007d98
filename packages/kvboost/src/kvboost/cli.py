"""The ``kvboost`` command: ``kvboost serve`` (the full-stack server), ``kvboost demo`` and
``kvboost cache status|bench`` (from kvb-cache's tiers)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvb_cache.options import ArgumentParser
from kvb_cache.tiers.cli import add_cache_commands
from kvboost import demo
from kvboost._version import __version__


def build_parser() -> argparse.ArgumentParser:
    # One-line errors (no usage block), for every subcommand's parser too.
    parser = ArgumentParser(
        prog="kvboost", description="KVBoost: chunk-level KV-cache reuse for HF causal LMs"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="replay real multi-turn chats on the embedded model: TTFT without cache vs with KVBoost"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.run)
    add_cache_commands(commands)
    add_serve_command(commands)
    return parser


def add_serve_command(commands: argparse._SubParsersAction) -> None:
    """``kvboost serve``: ``kvboost-server``'s flags plus every part's option group (needs kvb-server)."""
    help_text = (
        "OpenAI-compatible server on the full stack: stitching, speculative decoding, AWQ layer streaming, "
        "kernels, the planner and the block pool"
    )
    try:
        from kvb_server import cli as server_cli
    except ImportError:
        serve = commands.add_parser("serve", help=help_text + " (needs kvb-server)")
        serve.set_defaults(func=_server_missing)
        return
    from kvboost.serving import FullStack

    composer = FullStack()
    from kvb_server.flag_types import HelpFormatter

    serve = commands.add_parser("serve", help=help_text, description=help_text, formatter_class=HelpFormatter)
    server_cli.add_arguments(serve, composer)
    serve.set_defaults(
        func=lambda args: server_cli.serve(args, composer, error=server_cli.exit_with_error(serve))
    )


def _server_missing(args: argparse.Namespace) -> int:
    raise ImportError(
        'kvboost serve needs kvb-server: install the server extra (pip install "kvboost[server]"; from the '
        'source tree pip install "./packages/kvboost[server]")'
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    command = next((i for i, w in enumerate(words) if not w.startswith("-")), len(words))
    if any(w.split("=", 1)[0] == "--config" for w in words[:command]):
        parser.error(
            "--config is an option of kvboost serve: put it after the command (kvboost serve --config FILE)"
        )
    args = parser.parse_args(words)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # Every subcommand sets ``func``; those that report a status return an exit code, the demo returns None.
    try:
        return int(args.func(args) or 0)
    except ImportError as exc:  # an optional part not installed: one line naming the extra, not a traceback
        if not str(exc).startswith(("No module named", "cannot import name")):
            parser.error(str(exc))
        raise


if __name__ == "__main__":
    sys.exit(main())
