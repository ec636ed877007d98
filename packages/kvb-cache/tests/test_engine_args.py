"""``EngineArgs`` declares every engine option once; ``from_pretrained``, ``EngineConfig`` and flags follow it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvb_cache import ConfigError, EngineArgs, EngineConfig, KVBoost, StitchConfig
from kvb_cache.options import (
    add_option_arguments,
    as_keywords,
    block_count,
    from_namespace,
    option,
    option_fields,
    options_table,
    parse_bytes,
    parser_mismatches,
    signature_mismatches,
)


def test_from_pretrained_keywords_are_exactly_the_engine_args():
    assert signature_mismatches(KVBoost.from_pretrained, [EngineArgs]) == []


def test_a_drifting_signature_is_reported():
    def from_pretrained(model, *, chunk_size=64, extra=None): ...

    problems = signature_mismatches(from_pretrained, [EngineArgs])
    assert any("chunk_size=64" in p for p in problems)
    assert any("'extra'" in p for p in problems)
    assert any("lacks keyword 'block_size'" in p for p in problems)


def test_engine_config_defaults_are_the_engine_args_defaults():
    shared = {f.name for f in dataclasses.fields(EngineConfig)} & {
        f.name for f in dataclasses.fields(EngineArgs)
    }
    assert len(shared) >= 10
    built = EngineArgs().engine_config()
    assert built == EngineConfig()
    for name in shared:
        assert getattr(built, name) == getattr(EngineConfig(), name), name


def test_every_option_has_help_and_a_group():
    for f, spec in option_fields(EngineArgs):
        assert spec.help and spec.group, f.name
        if spec.cli_default is not None:
            assert spec.parse(spec.cli_default) == f.default, f.name
    assert {f.name for f in dataclasses.fields(EngineArgs)} == {f.name for f, _ in option_fields(EngineArgs)}


def test_flags_round_trip_into_engine_args():
    parser = argparse.ArgumentParser()
    groups = add_option_arguments(parser, EngineArgs)
    assert {"model", "cache", "stitching", "scheduling"} <= set(groups)
    assert parser_mismatches(parser, [EngineArgs]) == []
    assert from_namespace(EngineArgs, parser.parse_args([])) == EngineArgs()
    args = from_namespace(
        EngineArgs,
        parser.parse_args(
            [
                "--max-cache-bytes",
                "1MiB",
                "--recompute-strategy",
                "selective",
                "--num-blocks",
                "8",
                "--dtype",
                "float32",
            ]
        ),
    )
    assert (args.max_cache_bytes, args.num_blocks, args.dtype) == (2**20, 8, "float32")
    config = args.engine_config()
    assert config.stitching == StitchConfig(recompute_strategy="selective") and config.num_blocks == 8
    for bad in (["--kv-cache-bits", "3"], ["--block-size", "0"], ["--recompute-strategy", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    text = parser.format_help()
    assert "--stitching" not in text and "--drafter" not in text  # Python objects have no flag


def test_chunk_size_follows_stitching_unless_given():
    """Unset, chunks are 128 tokens, or 32 with stitching (a document is stitched only in whole chunks);
    a given size is kept either way, and the resolved size survives dataclasses.replace."""
    assert EngineConfig().chunk_size == 128
    assert EngineConfig(stitching=StitchConfig()).chunk_size == 32
    assert EngineConfig(chunk_size=64, stitching=StitchConfig()).chunk_size == 64
    assert EngineArgs(recompute_strategy="selective").engine_config().chunk_size == 32
    assert EngineArgs(recompute_strategy="selective", chunk_size=128).engine_config().chunk_size == 128
    assert dataclasses.replace(EngineConfig(), stitching=StitchConfig()).chunk_size == 128
    with pytest.raises(ConfigError, match="chunk_size"):
        EngineConfig(chunk_size=True)


def test_tiers_and_stitching_contradiction():
    assert EngineArgs().tier_config() is None
    tiers = EngineArgs(disk_cache_dir="/tmp/x", exit_flush_timeout_s=3.0).tier_config()
    assert tiers is not None and tiers.exit_flush_timeout_s == 3.0
    with pytest.raises(ConfigError, match="contradicts"):
        EngineArgs(recompute_strategy="none", stitching=StitchConfig()).engine_config()
    with pytest.raises(ConfigError, match="chunk_size"):
        EngineArgs(chunk_size=0).engine_config()


def test_the_num_blocks_flag_states_the_configs_own_bound():
    # The flag said ">= 1" for 0, then the config refused 1 with ">= 2".
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    for value in ("0", "1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--num-blocks", value])
    assert parser.parse_args(["--num-blocks", "2"]).num_blocks == 2
    with pytest.raises(argparse.ArgumentTypeError, match=">= 2"):
        block_count("1")


def test_remote_timeout_reaches_the_redis_tier_from_the_flag():
    # The 2 s bound of every Redis call was a TierConfig field only: a server on a slow link could not
    # give multi-megabyte records more time.
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    ns = parser.parse_args(["--remote-url", "redis://127.0.0.1:6379/0", "--remote-timeout", "7.5"])
    tiers = from_namespace(EngineArgs, ns).tier_config()
    assert tiers is not None and tiers.remote_timeout_s == 7.5
    assert EngineArgs(remote_url="redis://h:1/0").tier_config().remote_timeout_s == 2.0
    with pytest.raises(ConfigError, match="remote_timeout_s bounds the Redis tier"):
        EngineArgs(remote_timeout_s=5.0).tier_config()
    with pytest.raises(ConfigError, match="remote_timeout_s"):
        EngineArgs(remote_url="redis://h:1/0", remote_timeout_s=0.0).tier_config()


def test_remote_ttl_reaches_the_redis_tier_from_the_flag():
    """docs/tiers.md advises a TTL with volatile-lru; it could be set through TierConfig only (no flag, no
    from_pretrained keyword)."""
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    ns = parser.parse_args(["--remote-url", "redis://127.0.0.1:6379/0", "--remote-ttl", "3600"])
    tiers = from_namespace(EngineArgs, ns).tier_config()
    assert tiers is not None and tiers.remote_ttl_s == 3600
    with pytest.raises(SystemExit):
        parser.parse_args(["--remote-ttl", "0"])
    with pytest.raises(ConfigError, match="remote_ttl_s only applies with a remote_url"):
        EngineArgs(remote_ttl_s=60).tier_config()


def test_other_groups_share_sections_and_the_docs_table():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extra:
        gamma: int = option(5, group="speculative decoding", help="drafted tokens per round")
        fast: bool = option(False, group="cache", help="go fast", aliases=("--quick",))

    parser = argparse.ArgumentParser()
    groups = add_option_arguments(parser, EngineArgs)
    add_option_arguments(parser, Extra, groups)
    ns = parser.parse_args(["--gamma", "3", "--quick"])
    assert from_namespace(Extra, ns) == Extra(gamma=3, fast=True)
    assert parser.parse_args(["--no-fast"]).fast is False
    assert as_keywords(Extra()) == {"gamma": 5, "fast": False}
    table = options_table([EngineArgs, Extra])
    assert "| `--max-cache-bytes` | `max_cache_bytes` | `2GiB` |" in table
    assert "`--fast` `--quick`" in table and "(Python only)" in table
    assert parse_bytes("16GiB") == 16 * 2**30


def test_collect_copies_flag_applies_to_the_stitching_config():
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    args = from_namespace(
        EngineArgs, parser.parse_args(["--recompute-strategy", "selective", "--collect-copies", "2"])
    )
    assert args.engine_config().stitching == StitchConfig(collect_copies=2)
    assert EngineArgs(stitching=StitchConfig(overlap_k=8), collect_copies=3).stitch_config() == StitchConfig(
        overlap_k=8, collect_copies=3
    )
    with pytest.raises(ConfigError, match="needs stitching"):
        EngineArgs(collect_copies=2).engine_config()
    with pytest.raises(ConfigError, match="contradicts"):
        EngineArgs(stitching=StitchConfig(collect_copies=3), collect_copies=2).engine_config()
    with pytest.raises(SystemExit):
        parser.parse_args(["--collect-copies", "0"])


def test_idle_copies_flag_applies_to_the_stitching_config():
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    argv = ["--recompute-strategy", "selective", "--idle-copies", "1", "--collect-copies", "2"]
    args = from_namespace(EngineArgs, parser.parse_args(argv))
    assert args.engine_config().stitching == StitchConfig(idle_copies=1, collect_copies=2)
    assert EngineArgs(recompute_strategy="none").engine_config().stitching.idle_copies == 2
    with pytest.raises(ConfigError, match="idle_copies needs stitching"):
        EngineArgs(idle_copies=3).engine_config()
    with pytest.raises(ConfigError, match="contradicts"):
        EngineArgs(stitching=StitchConfig(idle_copies=3), idle_copies=1).engine_config()


@pytest.mark.parametrize(("flag", "loaded"), [("auto", "auto"), ("half", "float16")])
def test_vllm_dtype_spellings_are_accepted(flag, loaded):
    """`--dtype auto` is in most vLLM command lines and was an "invalid choice" here."""
    import torch

    from kvb_cache.loading import resolve_dtype

    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    dtype = from_namespace(EngineArgs, parser.parse_args(["--dtype", flag])).dtype
    assert dtype == flag
    assert resolve_dtype(dtype) == (loaded if loaded == "auto" else getattr(torch, loaded))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"kv_cache_bits": 8}, r"kv_cache_bits=8 quantizes disk/Redis records only.*--disk-cache-dir"),
        ({"kv_group_size": 64}, "kv_group_size=64 has no effect with kv_cache_bits=16"),
        ({"disk_cache_bytes": 2**20}, "disk_cache_bytes sizes the disk tier, and there is none"),
    ],
)
def test_options_that_would_do_nothing_are_refused(options, match, tmp_path):
    """Each was accepted and silently ignored (`--kv-cache-bits 8` without a tier reads like vLLM's
    --kv-cache-dtype but changed nothing); with what they apply to they are fine."""
    with pytest.raises(ConfigError, match=match):
        EngineArgs(**options).engine_config()
    EngineArgs(**{"kv_cache_bits": 8, **options, "disk_cache_dir": str(tmp_path)}).engine_config()


def test_parser_errors_are_one_line_and_name_the_flag(capsys):
    """argparse printed its whole usage block before the error; a value the options class refused was named
    by its field (num_blocks), not by the flag that was typed."""
    from kvb_cache.options import ArgumentParser, flag_hint

    parser = ArgumentParser(prog="prog")
    add_option_arguments(parser, EngineArgs)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--chunk-size", "x"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "usage:" not in err and "prog --help" in err
    said = "num_blocks must be an int >= 2 or None (derived from max_cache_bytes), got 1"
    assert flag_hint(parser, said) == said + " (--num-blocks)"  # the name said first, not max_cache_bytes
    assert flag_hint(parser, "pass recompute_strategy (--recompute-strategy)").endswith(
        "(--recompute-strategy)"
    )
    assert flag_hint(parser, "the model's context is 512") == "the model's context is 512"


def test_an_unknown_remote_codec_is_named_before_the_missing_url():
    from kvb_cache.tiers import TierConfig

    with pytest.raises(ConfigError, match="foo"):
        TierConfig(remote_codec="foo")


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("2048", 2048),
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25600),
        ("1.001k", 1001),  # a float product is 1000.9999999999999
        ("131.072k", 131072),
        ("32K", 32768),
        ("-1", None),
        ("auto", None),
    ],
)
def test_max_model_len_takes_vllms_human_readable_lengths(flag, expected):
    """A `vllm serve` command line with `--max-model-len 32k` failed at start-up."""
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    assert from_namespace(EngineArgs, parser.parse_args(["--max-model-len", flag])).max_model_len == expected


@pytest.mark.parametrize("flag", ["0", "1.5", "k", "-5", "32q", "1.0001k", "nan", "infk"])
def test_max_model_len_refuses_what_is_not_a_length(flag, capsys):
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, EngineArgs)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", flag])
    assert "1k / 1K style" in capsys.readouterr().err
