"""vLLM's HTTP flags: CORS, --root-path, TLS, the access log and the docs pages; and the vLLM flags that ask
for what this server does anyway (accepted with a warning) or for what it lacks (refused, naming why)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import serve

from kvb_server import ServerConfig, create_app
from kvb_server.cli import build_parser
from kvb_server.http_options import CorsPolicy, cors_policy, uvicorn_options

MODEL = "tiny-llama"


def test_no_cors_headers_unless_origins_are_allowed(tiny_engine) -> None:
    """vLLM answers every origin by default; here a page on another site gets no CORS headers unless
    --allowed-origins names it, and a preflight is not answered as allowed."""
    with serve(create_app(tiny_engine, ServerConfig(model_names=(MODEL,)))) as url:
        got = httpx.get(f"{url}/v1/models", headers={"Origin": "http://evil.example"})
        assert got.status_code == 200 and "access-control-allow-origin" not in got.headers
        pre = httpx.options(
            f"{url}/v1/chat/completions",
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in pre.headers


def test_allowed_origins_get_cors_headers_and_preflights_pass_authentication(tiny_engine) -> None:
    """A browser preflight carries no Authorization header: it must be answered before the API key check,
    and the key itself must be an allowed header."""
    policy = CorsPolicy(allowed_origins=("http://localhost:3000",))
    config = ServerConfig(model_names=(MODEL,), api_key="sk-test", cors=policy)
    with serve(create_app(tiny_engine, config)) as url:
        pre = httpx.options(
            f"{url}/v1/chat/completions",
            headers={
                "Origin": "http://localhost:3000",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        got = httpx.get(
            f"{url}/v1/models",
            headers={"Origin": "http://localhost:3000", "Authorization": "Bearer sk-test"},
        )
        assert got.status_code == 200
        assert got.headers["access-control-allow-origin"] == "http://localhost:3000"
        # A page's script may read the request id (browser SDKs' request_id).
        assert "x-request-id" in got.headers["access-control-expose-headers"].split(", ")
        other = httpx.get(
            f"{url}/v1/models", headers={"Origin": "http://other.example", "Authorization": "Bearer sk-test"}
        )
        assert "access-control-allow-origin" not in other.headers


def test_cors_flags_parse_as_vllm_writes_them() -> None:
    args = build_parser().parse_args(
        ["--allowed-origins", '["http://a.example", "http://b.example"]', "--allow-credentials"]
    )
    policy = cors_policy(args)
    assert policy.allowed_origins == ("http://a.example", "http://b.example") and policy.allow_credentials
    assert cors_policy(build_parser().parse_args(["--allowed-origins", "*"])).allowed_origins == ("*",)
    assert not cors_policy(build_parser().parse_args([])).enabled
    with pytest.raises(ValueError, match="--allow-credentials applies only with --allowed-origins"):
        cors_policy(build_parser().parse_args(["--allow-credentials"]))
    with pytest.raises(ValueError, match="--allowed-methods, --allowed-headers apply only with"):
        cors_policy(build_parser().parse_args(["--allowed-methods", "GET", "--allowed-headers", "x"]))


@pytest.mark.parametrize("value", ['["a", 1]', "[not json", '{"a": 1}', "[]x"])
def test_a_malformed_origin_list_is_a_usage_error(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--allowed-origins", value])
    assert info.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


def test_disable_fastapi_docs_hides_the_docs_pages(tiny_engine) -> None:
    config = ServerConfig(model_names=(MODEL,), fastapi_docs=False)
    with serve(create_app(tiny_engine, config)) as url:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path).status_code == 404
        assert httpx.get(url + "/v1/models").status_code == 200


def test_keep_alive_timeout_from_the_flag_or_vllms_variable(monkeypatch) -> None:
    """uvicorn's 5 s keep-alive could not be changed: behind a load balancer that keeps idle connections
    longer (AWS ALB: 60 s), requests sent on connections the server was closing got 502s."""
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert "timeout_keep_alive" not in uvicorn_options(build_parser().parse_args([]))
    assert (
        uvicorn_options(build_parser().parse_args(["--timeout-keep-alive", "75"]))["timeout_keep_alive"] == 75
    )
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "300")
    assert uvicorn_options(build_parser().parse_args([]))["timeout_keep_alive"] == 300
    assert (
        uvicorn_options(build_parser().parse_args(["--timeout-keep-alive", "9"]))["timeout_keep_alive"] == 9
    )
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "soon")
    with pytest.raises(ValueError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        uvicorn_options(build_parser().parse_args([]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--timeout-keep-alive", "0"])


def test_root_path_and_access_log_reach_uvicorn() -> None:
    args = build_parser().parse_args(["--root-path", "/llm/", "--disable-uvicorn-access-log"])
    assert uvicorn_options(args) == {"root_path": "/llm", "access_log": False, "log_level": "info"}
    assert uvicorn_options(build_parser().parse_args([])) == {"log_level": "info"}
    # vLLM's --uvicorn-log-level sets uvicorn's own level apart from the server's (refused before).
    quiet = build_parser().parse_args(["--log-level", "debug", "--uvicorn-log-level", "warning"])
    assert uvicorn_options(quiet) == {"log_level": "warning"}
    assert uvicorn_options(build_parser().parse_args(["--log-level", "error"])) == {"log_level": "error"}
    with pytest.raises(ValueError, match="must start with '/'"):
        uvicorn_options(build_parser().parse_args(["--root-path", "llm"]))


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    request = [
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=localhost",
    ]
    subprocess.run(
        [*request, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return key, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_files_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    key, cert = _self_signed(tmp_path, "a")
    other_key, _ = _self_signed(tmp_path, "b")
    args = build_parser().parse_args(["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    assert uvicorn_options(args) == {"ssl_certfile": str(cert), "ssl_keyfile": str(key), "log_level": "info"}
    mismatched = build_parser().parse_args(["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)])
    with pytest.raises(ValueError, match="not a usable PEM certificate and matching key"):
        uvicorn_options(mismatched)
    with pytest.raises(ValueError, match="no such file"):
        uvicorn_options(build_parser().parse_args(["--ssl-certfile", str(tmp_path / "missing.pem")]))
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        uvicorn_options(build_parser().parse_args(["--ssl-keyfile", str(key)]))


def test_a_vllm_tool_calling_command_line_starts(caplog) -> None:
    """vLLM's tool-calling recipe (``--enable-auto-tool-choice --tool-call-parser hermes``) and other flags
    asking for what this server always does were refused; they parse now, each with a warning saying why
    it changes nothing, and leave every option at its default."""
    flags = [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--enable-prefix-caching",
        "--enable-chunked-prefill",
        "--trust-remote-code",
        "--disable-log-requests",
        # Single-device values, common in vLLM command lines (-tp 1), are what runs here.
        "-tp",
        "1",
        "--pipeline-parallel-size=1",
        "-dp",
        "1",
        "--distributed-executor-backend",
        "uni",
        "--cpu-offload-gb",
        "0",
    ]
    with caplog.at_level(logging.WARNING, logger="kvb_server.vllm_flags"):
        args = build_parser().parse_args(["--model", "m", *flags])
    assert vars(args) == vars(build_parser().parse_args(["--model", "m"]))
    for flag in (
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--trust-remote-code",
        "--tensor-parallel-size",
    ):
        assert f"{flag} (a vLLM flag) changes nothing here" in caplog.text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--swap-space", "4"], "a preempted request is recomputed"),
        (["--enable-lora"], "merge_and_unload"),
        (["--lora-modules", "a=b"], "merge_and_unload"),
        (["--revision", "main"], "nothing is downloaded"),
        (
            ["-tp", "2"],
            "--tensor-parallel-size 2 (a vLLM flag) is not supported: one engine runs on one device",
        ),
        (["--kv-cache-dtype", "int8"], "invalid choice: 'int8'"),
        (["--cpu-offload-gb", "4"], "--awq-streaming"),
        (["-q", "awq"], "--quantization (a vLLM flag) is not supported: AWQ int4 checkpoints load with"),
    ],
)
def test_vllm_flags_this_server_lacks_are_refused_naming_why(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_enable_log_requests_logs_each_prompt_and_its_sampling(tiny_engine, caplog) -> None:
    """vLLM's --enable-log-requests (refused before): an INFO line per prompt on kvb_server.requests, cut
    to --max-log-len; nothing without the flag (prompts are users' data)."""
    args = build_parser().parse_args(["--enable-log-requests", "--max-log-len", "12"])
    from kvb_server.config import server_config

    config = server_config(args)
    assert (config.log_requests, config.max_log_len) == (True, 12)
    assert server_config(build_parser().parse_args([])).log_requests is False
    prompt = "The quick brown fox jumps over the lazy dog again and again"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "n": 2}
    for cfg, logged in (
        (ServerConfig(model_names=(MODEL,), log_requests=True, max_log_len=12), True),
        (ServerConfig(model_names=(MODEL,)), False),
    ):
        caplog.clear()
        with (
            caplog.at_level(logging.INFO, logger="kvb_server.requests"),
            serve(create_app(tiny_engine, cfg)) as url,
        ):
            assert (
                httpx.post(
                    url + "/v1/completions", json=body, timeout=60, headers={"x-request-id": "trace-7"}
                ).status_code
                == 200
            )
        lines = [r.getMessage() for r in caplog.records if r.name == "kvb_server.requests"]
        if not logged:
            assert lines == []
            continue
        (line,) = lines
        ids = tiny_engine.tokenizer.encode(prompt, add_special_tokens=False)
        assert line.startswith("request completions ") and f"model={MODEL}" in line
        assert "x-request-id=trace-7" in line  # the gateway's id, to find the request by
        assert f"prompt={prompt[:12]!r}" in line and f"={ids[:12]} " in line
        assert f"(first 12 of {len(ids)})" in line and "max_new_tokens=2" in line
        assert line.split(" ")[2].count(",") == 1  # both choices' job ids


def test_log_requests_without_a_tokenizer_logs_the_ids(caplog) -> None:
    """``GenerationService`` may be built without its engine (no tokenizer): with request logging on, every
    submit raised AttributeError before its jobs were queued."""
    from kvb_server.request_log import log_request

    with caplog.at_level(logging.INFO, logger="kvb_server.requests"):
        log_request(
            endpoint="completions",
            model=MODEL,
            job_ids=["cmpl-1"],
            prompts=[[5, 6, 7]],
            n=1,
            sampling="s",
            tokenizer=None,
            max_len=None,
        )
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvb_server.requests"]
    assert "prompt=None" in line and "prompt_token_ids=[5, 6, 7]" in line


def test_scheduling_policy_is_vllms_flag_and_reaches_the_engine() -> None:
    """--scheduling-policy priority used to be refused as unsupported; it is the engine's own option now."""
    args = build_parser().parse_args(["--model", "m", "--scheduling-policy", "priority"])
    assert args.scheduling_policy == "priority"
    assert build_parser().parse_args(["--model", "m"]).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--scheduling-policy", "lifo"])


def test_kv_cache_dtype_is_vllms_flag_and_reaches_the_engine_config() -> None:
    """--kv-cache-dtype was refused except for ``auto``; the pool holds KV in that precision now."""
    from kvb_cache import EngineArgs

    for value in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        args = build_parser().parse_args(["--model", "m", "--kv-cache-dtype", value])
        engine_args = EngineArgs(**{f: getattr(args, f) for f in ("kv_cache_dtype",)})
        assert engine_args.engine_config().kv_cache_dtype == value
    assert build_parser().parse_args(["--model", "m"]).kv_cache_dtype == "auto"


def test_enforce_eager_is_vllms_flag_and_reaches_the_engine_config() -> None:
    """--enforce-eager was accepted as what the server always did; decode steps replay CUDA graphs now, so
    it is the engine's option (no graphs), as in vLLM."""
    args = build_parser().parse_args(["--model", "m", "--enforce-eager"])
    assert args.enforce_eager is True
    assert build_parser().parse_args(["--model", "m"]).enforce_eager is False
