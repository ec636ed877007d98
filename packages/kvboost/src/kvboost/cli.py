"""The ``kvboost`` command: ``kvboost demo`` (and the subcommands other distributions contribute)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvboost import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost", description="KVBoost: chunk-level KV-cache reuse for HF causal LMs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="replay real multi-turn chats on the embedded model: TTFT without cache vs with KVBoost"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=demo.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args.handler(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
