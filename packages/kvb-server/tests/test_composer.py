"""Engine flags come from ``kvb_cache.EngineArgs``; an engine composer adds its groups and builds the engine."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import httpx
import pytest
from conftest import serve
from fakes import FakeEngine

import kvb_cache
from kvb_cache import EngineArgs
from kvb_cache.options import as_keywords, from_namespace, option, option_fields, parser_mismatches
from kvb_server import ServerConfig, create_app
from kvb_server.cli import build_parser, build_server
from kvb_server.composer import ENTRY_POINT_GROUP, EngineComposer, find_composer
from kvb_server.config import server_config


def test_every_server_option_is_a_flag_with_its_default() -> None:
    """ServerConfig's scalar options are declared once (their fields): the flags, defaults and dests follow."""
    parser = build_parser()
    assert parser_mismatches(parser, [ServerConfig]) == []
    assert {f.name for f, _ in option_fields(ServerConfig)} >= {
        "max_queue_size",
        "request_timeout_s",
        "max_tokens",
        "max_logprobs",
        "max_body_bytes",
        "max_json_depth",
        "shutdown_timeout_s",
        "log_requests",
        "max_log_len",
    }
    config = server_config(parser.parse_args([]))
    for f, spec in option_fields(ServerConfig):
        assert spec.cli and getattr(config, f.name) == f.default, f.name
    args = parser.parse_args(
        [
            "--request-timeout",
            "7",
            "--shutdown-timeout",
            "3",
            "--max-body-bytes",
            "1KiB",
            "--enable-log-requests",
        ]
    )
    config = server_config(args)
    assert (config.request_timeout_s, config.shutdown_timeout_s, config.max_body_bytes) == (7.0, 3.0, 1024)
    assert config.log_requests is True


def test_every_engine_arg_is_a_flag_with_its_default() -> None:
    parser = build_parser()
    assert parser_mismatches(parser, [EngineArgs]) == []
    assert from_namespace(EngineArgs, parser.parse_args([])) == EngineArgs()
    text = parser.format_help()
    for flag in ("--recompute-strategy", "--boundary-window", "--attn-implementation", "--kv-group-size"):
        assert flag in text


def test_engine_args_reach_kvb_cache_from_pretrained(monkeypatch) -> None:
    seen: dict[str, Any] = {}

    def from_pretrained(model: str, **kwargs: Any) -> FakeEngine:
        seen.update(kwargs, model=model)
        return FakeEngine()

    monkeypatch.setattr(kvb_cache.KVBoost, "from_pretrained", staticmethod(from_pretrained))
    flags = ["--no-oom-planning", "--recompute-strategy", "selective", "--boundary-window", "4"]
    build_server(build_parser().parse_args(flags))
    expected = as_keywords(EngineArgs(recompute_strategy="selective", boundary_window=4))
    assert {k: seen[k] for k in expected} == expected


@dataclasses.dataclass(frozen=True, kw_only=True)
class GammaArgs:
    gamma: int = option(5, group="speculative decoding", help="drafted tokens per round")


class FakeComposer:
    name = "fake-stack"

    def __init__(self) -> None:
        self.calls: list[tuple[str, argparse.Namespace]] = []

    def option_classes(self) -> tuple[type, ...]:
        return (GammaArgs,)

    def build_engine(self, model: str, args: argparse.Namespace) -> FakeEngine:
        self.calls.append((model, args))
        return FakeEngine()


def test_a_composer_adds_its_groups_and_builds_the_engine() -> None:
    composer = FakeComposer()
    assert isinstance(composer, EngineComposer)
    parser = build_parser(composer)
    assert "fake-stack" in parser.description and "--gamma" in parser.format_help()
    assert parser_mismatches(parser, [EngineArgs, GammaArgs]) == []
    args = parser.parse_args(["--model", "m", "--gamma", "3", "--no-oom-planning"])
    build_server(args, composer)
    ((model, seen),) = composer.calls
    assert model == "m" and from_namespace(GammaArgs, seen) == GammaArgs(gamma=3)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--gamma", "3"])  # without the composer there is no such flag


def test_find_composer_reads_the_entry_point_group(monkeypatch) -> None:
    import kvb_server.composer as module

    class EntryPoint:
        name, value = "fake", "tests:FakeComposer"

        def load(self):
            return FakeComposer

    monkeypatch.setattr(
        module, "entry_points", lambda group: [EntryPoint()] if group == ENTRY_POINT_GROUP else []
    )
    assert isinstance(find_composer(), FakeComposer)
    monkeypatch.setattr(module, "entry_points", lambda group: [])
    assert find_composer() is None


class PartsEngine(FakeEngine):
    def cache_stats(self) -> dict[str, Any]:
        return {**super().cache_stats(), "speculative": {"acceptance_rate": 0.5}, "streaming": {"hits": 3}}


def test_stats_show_composed_parts_at_the_top_level() -> None:
    with serve(create_app(PartsEngine(), ServerConfig(model_names=("fake",)))) as url:
        stats = httpx.get(url + "/v1/stats").json()
    assert stats["speculative"] == {"acceptance_rate": 0.5} and stats["streaming"] == {"hits": 3}
    assert "speculative" not in stats["cache"] and "streaming" not in stats["cache"]
    with serve(create_app(FakeEngine(), ServerConfig(model_names=("fake",)))) as url:
        stats = httpx.get(url + "/v1/stats").json()
    assert "speculative" not in stats and "streaming" not in stats
