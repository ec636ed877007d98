"""The meta-package re-exports kvb_cache's API and wires the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvb_cache
import kvboost
from kvboost.cli import build_parser, main
from kvboost.replay import SYSTEM_PROMPT, chat_turns, load_user_turns


def test_reexports_are_the_same_objects():
    import kvb_speculative
    import kvb_streaming

    for name in kvboost.__all__:
        if name in ("KVBoost", "SpeculativeArgs", "StreamingArgs", "__version__"):
            continue
        source = {"SpeculativeConfigError": kvb_speculative, "StreamingConfigError": kvb_streaming}.get(
            name, kvb_cache
        )
        assert getattr(kvboost, name) is getattr(source, name), name
    assert issubclass(kvboost.KVBoost, kvb_cache.KVBoost)


def test_cli_help_lists_demo_and_its_flags():
    out = subprocess.run(
        [sys.executable, "-m", "kvboost.cli", "demo", "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--model", "--conversations", "--turns", "--max-new-tokens", "--chunk-size", "--device"):
        assert flag in out.stdout


def test_serve_takes_the_model_as_vllm_serve_does():
    pytest.importorskip("kvb_server")
    assert build_parser().parse_args(["serve", "path/to/m", "--port", "9000"]).model == "path/to/m"


def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys):
    # Without kvb-server, `kvboost serve` ended in a 10-line traceback (every other mistake: one line, exit 2).
    monkeypatch.setitem(sys.modules, "kvb_server", None)
    monkeypatch.setitem(sys.modules, "kvb_server.cli", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"])
    assert exit_info.value.code == 2
    assert 'pip install "kvboost[server]"' in capsys.readouterr().err


def test_a_config_before_the_command_says_where_it_goes(capsys):
    with pytest.raises(SystemExit):
        main(["--config", "f.yaml", "serve"])
    assert "put it after the command" in capsys.readouterr().err


def test_serve_reads_a_vllm_style_config_file(tmp_path):
    pytest.importorskip("kvb_server")
    path = tmp_path / "serve.yaml"
    path.write_text("speculative-config: {method: ngram, num_speculative_tokens: 3}\nkv-cache-dtype: fp8\n")
    args = build_parser().parse_args(["serve", "--config", str(path)])
    assert args.kv_cache_dtype == "fp8" and '"num_speculative_tokens": 3' in args.speculative_config


def test_cli_prints_its_version():
    out = subprocess.run([sys.executable, "-m", "kvboost.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"kvboost {kvboost.__version__}"


def test_cli_requires_a_command():
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


@pytest.mark.parametrize(
    "argv",
    [
        ["--conversations", "0"],
        ["--turns", "-1"],
        ["--max-new-tokens", "0"],
        ["--chunk-size", "0"],
        ["--turns", "x"],
    ],
)
def test_demo_refuses_counts_below_one(argv, capsys):
    # --conversations 0 replayed every one of the dataset's 7168 conversations (the count was never met);
    # --turns -1 silently dropped each conversation's last turn; zeros ended in engine tracebacks.
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["demo", *argv])
    assert info.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_replay_reads_real_conversations():
    conversations = load_user_turns(5, min_turns=4)
    assert len(conversations) == 5
    assert all(len(c) >= 4 and all(isinstance(t, str) and t for t in c) for c in conversations)
    turns = list(chat_turns(conversations[0], 3))
    assert [t for t, _ in turns] == [1, 2, 3]
    messages = turns[-1][1]
    assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert messages[-1] == {"role": "user", "content": conversations[0][2]}
