from __future__ import annotations

import argparse
import logging

import pytest
from fakes import FakeEngine

import kvb_cache
from kvb_server.cli import build_parser, build_server, parse_bytes
from kvb_server.config import server_config


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="2GiB"):
        parse_bytes("lots")


def test_the_model_may_be_positional_as_vllm_serve_takes_it(capsys) -> None:
    """`vllm serve MODEL` is how a vLLM user starts a server; `kvboost-server MODEL` was "unrecognized
    arguments". The same model twice is fine, two different ones are refused in one line."""
    parser = build_parser()
    assert parser.parse_args(["path/to/m", "--port", "9000"]).model == "path/to/m"
    assert parser.parse_args(["--port", "9000", "path/to/m"]).model == "path/to/m"
    assert parser.parse_args(["m", "--model", "m"]).model == "m"
    # vLLM's boolean flags take no value: the model after one was taken as its value (default model served).
    assert (
        parser.parse_args(["--enable-prefix-caching", "path/to/m", "--trust-remote-code"]).model
        == "path/to/m"
    )
    for argv in (["a", "--model", "b"], ["--model", "b", "a"]):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
        assert "the model is given twice" in capsys.readouterr().err


def test_a_config_file_gives_options_as_vllm_serve_reads_it(tmp_path) -> None:
    """`vllm serve --config file.yaml`: keys are option names without dashes (either spelling), values go
    through each flag's own parsing, and what is typed on the command line wins over the file."""
    path = tmp_path / "server.yaml"
    path.write_text(
        "model: from/file\nport: 9001\nmax_num_seqs: 4\nserved-model-name: [a, b]\n"
        "warm: [first text, second text]\noom-planning: false\nallowed-origins: ['http://x']\n"
        "max-cache-bytes: 1GiB\nenable-prefix-caching: true\n"
    )
    args = build_parser().parse_args(["--config", str(path)])
    assert (args.model, args.port, args.max_num_seqs, args.served_model_name) == (
        "from/file",
        9001,
        4,
        ["a", "b"],
    )
    assert args.warm == ["first text", "second text"] and args.oom_planning is False
    assert args.allowed_origins == ("http://x",) and args.max_cache_bytes == 2**30
    args = build_parser().parse_args(["typed/model", f"--config={path}", "--port", "9002"])
    assert (args.model, args.port, args.max_num_seqs) == ("typed/model", 9002, 4)
    assert build_parser().parse_args(["--config", str(path), "--model", "m"]).model == "m"
    # An option typed replaces the file's, a list too (not merged after the file's first name).
    args = build_parser().parse_args(["--config", str(path), "--served-model-name", "typed", "--warm", "w"])
    assert args.served_model_name == ["typed"] and args.warm == ["w"]
    # A list as the file's last option takes no typed word: the model typed after it stays the model.
    last = tmp_path / "last.yaml"
    last.write_text("port: 8031\nserved-model-name: [my-llama]\n")
    for argv in (["/models/llama", "--config", str(last)], ["--config", str(last), "/models/llama"]):
        args = build_parser().parse_args(argv)
        assert (args.model, args.served_model_name) == ("/models/llama", ["my-llama"])
    # vLLM's spellings: `key: false` is --no-key; a --no- key set to false is the positive flag.
    flags = tmp_path / "flags.yaml"
    flags.write_text("no-oom-planning: false\nenforce-eager: false\n")
    args = build_parser().parse_args(["m", "--config", str(flags)])
    assert args.oom_planning is True and args.enforce_eager is False
    # An unambiguous abbreviation is the flag, as argparse takes them.
    assert build_parser().parse_args(["--conf", str(path)]).port == 9001


def test_served_names_without_a_model_are_refused_as_vllm_refuses_them(capsys) -> None:
    """In `--served-model-name x MODEL` the model is taken as a second name (the flag takes several), and the
    server started on the embedded default model under the name typed for another."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--served-model-name", "x", "/models/Llama-3-8B"])
    assert "name the model first" in capsys.readouterr().err
    args = build_parser().parse_args(["/models/Llama-3-8B", "--served-model-name", "x"])
    assert (args.model, args.served_model_name) == ("/models/Llama-3-8B", ["x"])
    assert build_parser().parse_args(["--max_num_seqs", "4"]).max_num_seqs == 4  # vLLM's underscores


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nonsense-option: 1\n", "unknown option 'nonsense-option'"),
        ("- port\n- 9000\n", "must be a mapping of option names to values"),
        ("port: [1\n", "is not valid YAML"),
        ("config: other.yaml\n", "cannot name another one"),
        ("port: not-a-port\n", "--port"),
        ("max-num-seqs:\n", "'max-num-seqs' has no value"),
        ("swap-space: 4\n", "a preempted request is recomputed"),  # vLLM flags are refused as typed
        (
            "enable-prefix-caching: false\n",
            "--max-cache-bytes 0",
        ),  # vLLM reads it as --no-enable-prefix-caching
        ("enable-chunked-prefill: false\n", "is what this server always does"),
        ("served-model-name: [a]\n", "name the model first"),
        ("help: true\n", "unknown option 'help'"),  # it printed the help and exited 0
        ("version: true\n", "unknown option 'version'"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_option(tmp_path, capsys, text, message) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--config", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config", str(tmp_path / "missing.yaml")])
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--config="])
    assert "--config needs a YAML file" in capsys.readouterr().err


def test_a_switch_left_off_in_a_config_file_is_its_default(tmp_path) -> None:
    """vLLM YAML files spell out ``enable-log-requests: false``: it was refused, saying the server "always
    does" what it does not (an audit of the options, 2026-11-30)."""
    path = tmp_path / "server.yaml"
    path.write_text(
        "enable-log-requests: false\nauto-truncate: false\ndisable-log-stats: false\n"
        "trust-remote-code: false\nenable-sleep-mode: false\n"
    )
    args = build_parser().parse_args(["--config", str(path)])
    defaults = build_parser().parse_args([])
    assert (args.log_requests, args.auto_truncate) == (
        defaults.log_requests,
        defaults.auto_truncate,
    )
    path.write_text("enable-log-requests: true\n")
    assert build_parser().parse_args(["--config", str(path)]).log_requests is True
    # An option's Python name where its flag is shorter (from_pretrained's remote_ttl_s is --remote-ttl).
    path.write_text("remote_ttl_s: 5\nexit-flush-timeout-s: 3\n")
    args = build_parser().parse_args(["--config", str(path)])
    assert (args.remote_ttl_s, args.exit_flush_timeout_s) == (5, 3)


def test_safe_defaults_and_flags() -> None:
    args = build_parser().parse_args([])
    assert args.host == "127.0.0.1"
    assert args.model == "smollm2-135m"
    assert args.max_cache_bytes == 2 * 2**30
    assert (args.block_size, args.num_blocks, args.max_num_seqs, args.max_num_batched_tokens) == (
        16,
        None,
        32,
        1024,
    )
    assert args.backend == "cpu-paged"
    args = build_parser().parse_args(
        [
            "--warm",
            "a",
            "--warm",
            "b",
            "--max-num-seqs",
            "4",
            "--api-key",
            "k",
            "--block-size",
            "8",
            "--num-blocks",
            "512",
            "--max-num-batched-tokens",
            "256",
            "--backend",
            "cpu-paged",
        ]
    )
    assert args.warm == ["a", "b"] and args.max_num_seqs == 4 and args.api_key == "k"
    assert (args.block_size, args.num_blocks, args.max_num_batched_tokens) == (8, 512, 256)
    for bad in (
        ["--block-size", "0"],
        ["--num-blocks", "x"],
        ["--max-num-seqs", "-1"],
        ["--backend", "cuda"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_old_batching_flags_still_parse_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="kvb_server.cli"):
        args = build_parser().parse_args(["--max-batch-size", "4", "--batch-window-ms", "10"])
    assert args.max_num_seqs == 4  # --max-batch-size is an alias of --max-num-seqs
    assert not hasattr(args, "batch_window_ms") and not hasattr(args, "max_batch_size")
    assert "--max-batch-size is deprecated; use --max-num-seqs" in caplog.text
    assert "--batch-window-ms is deprecated and ignored" in caplog.text


def test_help_shows_only_defaults_that_say_something() -> None:
    # "(default: None)" after "unset: the model's", Python's "(default: [])", and a help that names its own
    # default followed by "(default: None)".
    import re

    text = re.sub(r"\s+", " ", build_parser().format_help())
    for noise in ("(default: None)", "(default: [])", "(default: ())"):
        assert noise not in text
    assert "(default: 8000)" in text  # a real default is still shown


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
        "--block-size",
        "--num-blocks",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--backend",
        "--max-queue-size",
        "--request-timeout",
        "--max-tokens",
        "--api-key",
    ):
        assert flag in text
    assert "deprecated alias of --max-num-seqs" in text


def test_engine_loop_flags_reach_the_engine(monkeypatch) -> None:
    seen: dict = {}

    def from_pretrained(model: str, **kwargs) -> FakeEngine:
        seen.update(kwargs, model=model)
        return FakeEngine()

    monkeypatch.setattr(kvb_cache.KVBoost, "from_pretrained", staticmethod(from_pretrained))
    args = build_parser().parse_args(
        [
            "--model",
            "m",
            "--block-size",
            "8",
            "--num-blocks",
            "64",
            "--max-num-seqs",
            "3",
            "--max-num-batched-tokens",
            "96",
            "--no-oom-planning",
            "--max-queue-size",
            "7",
            "--seed",
            "-3",
            "--tokenizer",
            "/tok",
            "--max-logprobs",
            "-1",
            "--gpu-memory-utilization",
            "0.85",
        ]
    )
    server = build_server(args)
    assert (seen["seed"], seen["tokenizer"]) == (-3, "/tok")  # vLLM's flags, refused before
    assert seen["gpu_memory_utilization"] == 0.85
    assert server_config(args).max_logprobs == -1
    assert (seen["block_size"], seen["num_blocks"], seen["max_num_seqs"], seen["max_num_batched_tokens"]) == (
        8,
        64,
        3,
        96,
    )
    assert seen["model"] == "m" and server.host == "127.0.0.1" and server.port == 8000


def test_limit_tenant_and_shutdown_flags_reach_the_config(monkeypatch, tmp_path) -> None:
    import kvb_server.app

    monkeypatch.setattr(kvb_cache.KVBoost, "from_pretrained", staticmethod(lambda model, **kw: FakeEngine()))
    configs = []
    monkeypatch.setattr(
        kvb_server.app, "create_app", lambda engine, config, gate=None: configs.append(config)
    )
    keys = tmp_path / "keys.json"
    keys.write_text('{"key-c": "salt-c"}')
    args = build_parser().parse_args(
        [
            "--no-oom-planning",
            "--max-body-bytes",
            "1MiB",
            "--max-json-depth",
            "32",
            "--api-key-salt",
            "key-a=salt-a",
            "--api-key-salt",
            "key-b=x=y",
            "--api-keys-file",
            str(keys),
            "--shutdown-timeout",
            "7",
        ]
    )
    build_server(args)
    (config,) = configs
    assert (config.max_body_bytes, config.max_json_depth, config.shutdown_timeout_s) == (2**20, 32, 7.0)
    assert [(t.key, t.salt) for t in config.tenant_keys] == [
        ("key-a", "salt-a"),
        ("key-b", "x=y"),
        ("key-c", "salt-c"),
    ]
    assert config.requires_auth and config.api_key is None
    assert "salt-a" not in repr(config)  # secrets stay out of logs
    defaults = build_parser().parse_args([])
    assert (defaults.max_body_bytes, defaults.max_json_depth) == (4 * 2**20, 64)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--api-key-salt", "no-equals"], "KEY=SALT"),
        (["--api-key-salt", "k="], "non-empty"),
        (["--api-keys-file", "/nonexistent/keys.json"], "--api-keys-file"),
    ],
)
def test_bad_tenant_keys_are_refused_before_the_model_loads(flags: list[str], match: str) -> None:
    from kvb_server.cli import main

    with pytest.raises(SystemExit):
        main(flags)
    with pytest.raises(ValueError, match=match):
        build_server(build_parser().parse_args(flags))


def test_shutdown_timeout_bounds_the_requests_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn waited for every request in flight on SIGINT/SIGTERM, however long (a client that stopped
    reading held the process open); --shutdown-timeout bounds that wait too."""
    import uvicorn

    from kvb_server import cli

    seen: dict = {}
    monkeypatch.setattr(
        cli, "build_server", lambda args, composer, **_: cli.Server(object(), "127.0.0.1", 8000)
    )
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    parser = build_parser()
    cli.serve(parser.parse_args(["--shutdown-timeout", "7"]), None, error=parser.error)
    assert seen["timeout_graceful_shutdown"] == 7


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "-1"], "not a TCP port"),
        (["--port", "70000"], "not a TCP port"),
        (["--max-logprobs", "-2"], "-1 for the whole vocabulary"),
        (["--max-queue-size", "-5"], "integer >= 1"),
        (["--max-tokens", "0"], "integer >= 1"),
        (["--request-timeout", "-1"], "seconds > 0"),
        (["--shutdown-timeout", "0"], "seconds > 0"),
        (["--max-json-depth", "0"], "nesting depth in 1..512"),
    ],
)
def test_bad_server_flag_values_are_usage_errors(flags: list[str], message: str, capsys) -> None:
    """These were int/float flags checked only by ServerConfig after the model loaded (a ValueError
    traceback; a bad --port only inside uvicorn)."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    # One line, not the 56-line usage block first (argparse's own error printed it).
    assert err.count("\n") == 1 and "usage:" not in err and "(see kvboost-server --help)" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--swap-space", "4"], "a preempted request is recomputed"),
        (["--num-speculative-tokens", "3"], "older speculative flags"),  # was "the model is given twice"
        (["--speculative-model", "[ngram]"], "takes --speculative-config"),
        (["--no-enable-prefix-caching"], "--max-cache-bytes 0"),
        (["--revision", "main"], "nothing is downloaded"),
        (["--tensor-parallel-size", "2"], "one server per GPU"),
        (["--download", "x"], "--download-dir (a vLLM flag)"),  # an abbreviation names the full flag
        (
            ["-O3"],
            "there is no torch.compile",
        ),  # vLLM's -O3 is -O 3, the short --compilation-config (-O0: fine)
        (["--enable-sleep-mode"], "there is no sleep mode"),
        (["--calculate-kv-scales"], "fp8 KV uses a scale of 1.0"),
        (["--trust-request-chat-template"], "start the server with --chat-template"),
        (["--kv-transfer-config", "{}"], "--remote-url (Redis)"),
        (["--response-role", "bot"], "accepted: assistant"),
        (["--load-format", "gguf"], "accepted: auto, safetensors"),
        (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "only backend"),
    ],
)
def test_vllm_flags_are_refused_with_what_to_use_instead(flags: list[str], message: str, capsys) -> None:
    """argparse answered "unrecognized arguments", which says nothing about the equivalent here."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "--swap-space" not in build_parser().format_help()  # hidden: they are not options


@pytest.mark.parametrize(
    "flags",
    [
        ["--response-role", "assistant"],
        ["--load-format", "safetensors"],
        ["--tokenizer-mode", "auto"],
        ["--structured-outputs-config", '{"backend": "xgrammar"}'],
        ["--max-seq-len-to-capture", "8192"],
        ["--compilation-config", "0"],
        ["--cpu-offload-gb", "0.0"],
    ],
)
def test_vllm_flags_asking_for_what_the_server_does_are_accepted_with_a_warning(flags, caplog) -> None:
    """Common in vLLM command lines; they were "unrecognized arguments", so the line had to be edited."""
    with caplog.at_level(logging.WARNING, logger="kvb_server.vllm_flags"):
        build_parser().parse_args(flags)
    assert f"{flags[0]} (a vLLM flag) changes nothing here" in caplog.text


@pytest.mark.parametrize("flags", [["--speculative", "prompt_lookup"], ["--gamma", "4"], ["--awq-streaming"]])
def test_full_stack_flags_without_the_meta_package_say_what_provides_them(flags: list[str], capsys) -> None:
    """--speculative was taken as an abbreviation of vLLM's --speculative-config and refused under that
    name; --gamma and --awq-streaming were merely "unrecognized arguments"."""
    with pytest.raises(SystemExit) as info:
        build_parser(None).parse_args(flags)
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"{flags[0]} is an option of the full stack" in err and "kvboost" in err


def _serve(monkeypatch: pytest.MonkeyPatch, flags: list[str], load=None, *, check_port=False) -> list[dict]:
    """Run cli.main(flags) with uvicorn stubbed and the engine load replaced by ``load``."""
    import uvicorn

    from kvb_server import cli

    runs: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append(kw))
    monkeypatch.setattr(cli, "find_composer", lambda: None)  # the plain engine, with or without kvboost
    if not check_port:  # other processes on this machine may hold any fixed port
        monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    if load is not None:
        monkeypatch.setattr(kvb_cache.KVBoost, "from_pretrained", staticmethod(load))
    cli.main(["--no-oom-planning", *flags])
    return runs


def test_a_model_that_does_not_load_is_one_line_and_status_2(monkeypatch, capsys) -> None:
    """A ModelLoadError (or any typed user error raised while the server is built) escaped as a traceback."""

    def load(model: str, **kwargs) -> FakeEngine:
        raise kvb_cache.ModelLoadError(f"model path {model!r} does not exist;\nsecond line")

    with pytest.raises(SystemExit) as info:
        _serve(monkeypatch, ["--model", "/nonexistent"], load)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: model path '/nonexistent' does not exist; second line" in err
    assert err.count("\n") == 1 and "usage:" not in err  # one line, not the usage block first


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--chunk-size", "0"], "argument --chunk-size: '0' is not an integer >= 1"),
        (["--boundary-window", "99"], "boundary_window must be an int in [0, chunk_size // 2]"),
        # Refused by the options class under its field name: the flag is named too.
        (["--boundary-window", "99"], "got 99 (--boundary-window)"),
        # The flag states the options class's own bound (it said ">= 1" for 0, then the class refused 1).
        (["--num-blocks", "1"], "argument --num-blocks: '1' is not an integer >= 2"),
        (["--max-body-bytes", "0"], "(--max-body-bytes)"),
        (["--exit-flush-timeout", "-1"], "(--exit-flush-timeout)"),
        (["--warm", " "], "--warm needs a non-empty text"),
        (["m", "--served-model-name", ""], "model_names (--served-model-name) must all be non-empty strings"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be a fraction in (0, 1]"),
        (["--gpu-memory-utilization", "0.9", "--num-blocks", "64"], "both size the KV pool"),
    ],
)
def test_engine_options_are_checked_before_the_model_loads(monkeypatch, capsys, flags, message) -> None:
    loads: list[str] = []
    with pytest.raises(SystemExit) as info:
        _serve(monkeypatch, flags, lambda model, **kw: loads.append(model))
    assert info.value.code == 2 and loads == []
    assert message in capsys.readouterr().err


def test_a_port_in_use_is_refused_before_the_model_loads(monkeypatch, capsys) -> None:
    import socket

    loads: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            _serve(
                monkeypatch, ["--port", str(port)], lambda model, **kw: loads.append(model), check_port=True
            )
    assert info.value.code == 2 and loads == []
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_served_model_names_come_first_as_in_vllm(monkeypatch) -> None:
    """vLLM answers as the first --served-model-name: /v1/models' first entry, the `model` of requests that
    leave it out and the metrics' model_name label. The engine's id (a checkpoint path) was first."""
    import kvb_server.app

    monkeypatch.setattr(kvb_cache.KVBoost, "from_pretrained", staticmethod(lambda model, **kw: FakeEngine()))
    configs = []
    monkeypatch.setattr(
        kvb_server.app, "create_app", lambda engine, config, gate=None: configs.append(config)
    )
    flags = [
        "--no-oom-planning",
        "--model",
        "/ckpt/m",
        "--served-model-name",
        "gpt-x",
        "--served-model-name",
        "y",
    ]
    build_server(build_parser().parse_args(flags))
    # vLLM takes several names after one flag (nargs="+"): "unrecognized arguments: y" before.
    build_server(
        build_parser().parse_args(
            ["--no-oom-planning", "--model", "/ckpt/m", "--served-model-name", "gpt-x", "y"]
        )
    )
    assert len(configs) == 2
    for config in configs:
        assert config.model_names[:2] == ("gpt-x", "y")
        assert {FakeEngine().model_name, "/ckpt/m"} <= set(config.model_names)
    assert build_parser().parse_args(["--dtype", "float"]).dtype == "float"  # vLLM's spelling of float32


def test_an_empty_api_key_is_refused_not_authentication_off(monkeypatch, capsys) -> None:
    """`--api-key "$KEY"` with KEY unset served without authentication, silently."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--api-key", " "])
    assert info.value.code == 2 and "the key is empty" in capsys.readouterr().err
    monkeypatch.setenv("KVBOOST_API_KEY", "")  # an empty variable is as unset
    assert build_parser().parse_args([]).api_key is None
    monkeypatch.setenv("KVBOOST_API_KEY", "k1")
    assert build_parser().parse_args([]).api_key == "k1"


def test_log_level_applies_when_the_root_logger_is_already_configured(monkeypatch) -> None:
    """`kvboost serve` configures logging (WARNING) before the server's basicConfig, which then did nothing:
    --log-level was ignored and the default info lines never showed."""
    import uvicorn

    from kvb_server import cli

    monkeypatch.setattr(
        cli, "build_server", lambda args, composer, **_: cli.Server(object(), "127.0.0.1", 8000)
    )
    monkeypatch.setattr(cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    root = logging.getLogger()
    handler = logging.NullHandler()
    before = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        parser = build_parser()
        cli.serve(parser.parse_args(["--log-level", "debug"]), None, error=parser.error)
        assert root.level == logging.DEBUG
    finally:
        root.removeHandler(handler)
        root.setLevel(before)


def test_a_model_the_planner_cannot_describe_serves_without_planning_by_default(monkeypatch, caplog) -> None:
    """The engine serves GPT-2, the planner models Llama-style decoders (no intermediate_size): with the
    planner installed (planning on by default) such a model did not start without --no-oom-planning."""
    planner = pytest.importorskip("kvb_planner")
    from kvb_server import cli
    from kvb_server.planner_gate import PlannerGate

    def for_engine(engine, **kwargs):
        raise planner.PlannerConfigError("config has no integer 'intermediate_size'")

    monkeypatch.setattr(PlannerGate, "for_engine", staticmethod(for_engine))
    with caplog.at_level(logging.WARNING, logger="kvb_server.cli"):
        assert cli.build_gate(build_parser().parse_args([]), FakeEngine()) is None
    assert "OOM planning off: the planner cannot describe this model" in caplog.text
    for asked in (["--oom-planning"], ["--auto-truncate"], ["--planner-safety-margin", "0.2"]):
        with pytest.raises(ValueError, match="OOM planning cannot plan for this model"):
            cli.build_gate(build_parser().parse_args(asked), FakeEngine())


def test_a_tokenizer_without_a_chat_template_is_said_at_start(monkeypatch, caplog) -> None:
    # It started silently and every chat request was a 400.
    with caplog.at_level("WARNING", logger="kvb_server.cli"):
        _serve(monkeypatch, ["--model", "m"], lambda model, **kwargs: FakeEngine())
    assert "no chat template" in caplog.text and "--chat-template" in caplog.text
