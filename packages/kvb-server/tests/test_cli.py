from __future__ import annotations

import argparse

import pytest

from kvb_server.cli import build_parser, parse_bytes


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="2GiB"):
        parse_bytes("lots")


def test_safe_defaults_and_flags() -> None:
    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1"
    assert args.model == "smollm2-135m"
    assert args.max_cache_bytes == 2 * 2**30
    args = build_parser().parse_args(
        ["--warm", "a", "--warm", "b", "--max-batch-size", "4", "--api-key", "k"]
    )
    assert args.warm == ["a", "b"] and args.max_batch_size == 4 and args.api_key == "k"


def test_help_explains_every_flag() -> None:
    text = build_parser().format_help()
    for flag in (
        "--model",
        "--host",
        "--port",
        "--device",
        "--dtype",
        "--max-cache-bytes",
        "--chunk-size",
        "--warm",
        "--batch-window-ms",
        "--max-batch-size",
        "--max-queue-size",
        "--request-timeout",
        "--max-tokens",
        "--api-key",
    ):
        assert flag in text
