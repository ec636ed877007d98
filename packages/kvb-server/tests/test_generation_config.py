"""vLLM's ``--generation-config``: request sampling defaults from the model's generation_config.json (auto),
OpenAI's (vllm), or a folder's; a request's own values always win."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import build_tiny_model, build_tokenizer, serve
from fakes import FakeEngine
from transformers import GenerationConfig

from kvb_server import generation_config as gc
from kvb_server.cli import build_parser, build_server, main
from kvb_server.config import ServerConfig
from kvb_server.request_body import parse_body
from kvb_server.request_plan import chat_plan, completion_plan
from kvb_server.responses_api.build import ResponseEnvelope
from kvb_server.responses_api.schemas import ResponsesRequest
from kvb_server.schemas.generation_requests import ChatCompletionRequest, CompletionRequest

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def _config(**defaults) -> ServerConfig:
    return ServerConfig(
        model_names=("fake-model",), max_tokens=50, sampling_defaults=gc.SamplingDefaults(**defaults)
    )


def _chat(config: ServerConfig, **body):
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    req = parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    return chat_plan(req, FakeEngine(), config).sampling


def _completion(config: ServerConfig, **body):
    req = parse_body(json.dumps({"prompt": "abc", **body}).encode(), CompletionRequest)
    return completion_plan(req, FakeEngine(), config).sampling


# -- reading a generation config ----------------------------------------------------------------------
def test_an_untouched_generation_config_overrides_nothing() -> None:
    # transformers 5's GenerationConfig defaults are all unset: only what a config sets explicitly counts.
    assert gc.defaults_from(GenerationConfig(), "x") == gc.NO_DEFAULTS
    assert (
        gc.defaults_from(GenerationConfig(bos_token_id=1, eos_token_id=2, use_cache=True), "x").as_dict()
        == {}
    )
    assert gc.defaults_from(None, "x") == gc.NO_DEFAULTS


def test_the_supported_fields_set_become_defaults() -> None:
    config = GenerationConfig(**QWEN_LIKE, min_p=0.05, max_new_tokens=7, do_sample=True, num_beams=1)
    assert gc.defaults_from(config, "x").as_dict() == {**QWEN_LIKE, "min_p": 0.05, "max_tokens": 7}


def test_do_sample_false_keeps_the_numeric_fields_as_vllm_does() -> None:
    config = GenerationConfig(do_sample=False, temperature=0.6)
    assert gc.defaults_from(config, "x").as_dict() == {"temperature": 0.6}


def test_a_value_no_request_may_send_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"cfg sets top_p=1\.5.*--generation-config vllm"):
        gc.defaults_from(GenerationConfig(top_p=1.5), "cfg")


def test_vllm_turns_it_off_and_auto_reads_the_models_generation_config() -> None:
    engine = FakeEngine()
    engine.model = SimpleNamespace(generation_config=GenerationConfig(temperature=0.0, top_k=1))
    assert gc.resolve("auto", engine).as_dict() == {"temperature": 0.0, "top_k": 1}
    assert gc.resolve("vllm", engine) == gc.NO_DEFAULTS
    assert gc.resolve("auto", FakeEngine(), "not-a-folder") == gc.NO_DEFAULTS  # nothing to read: OpenAI's


def test_a_folder_is_read_and_a_bad_one_refused(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"top_k": 3, "max_new_tokens": 9}')
    assert gc.resolve(str(tmp_path), FakeEngine()).as_dict() == {"top_k": 3, "max_tokens": 9}
    with pytest.raises(ValueError, match="not a folder"):
        gc.check_flag(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        gc.check_flag(str(tmp_path / "empty"))


# -- applying the defaults ----------------------------------------------------------------------------
def test_omitted_fields_get_the_defaults_on_both_endpoints() -> None:
    config = _config(**QWEN_LIKE, min_p=0.1)
    for sampling in (_chat(config), _completion(config)):
        assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.7, 0.8, 20)
        assert (sampling.min_p, sampling.repetition_penalty) == (0.1, 1.05)
    plain = _chat(_config())  # no defaults: OpenAI's
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
    )


def test_explicit_request_values_win() -> None:
    config = _config(**QWEN_LIKE, min_p=0.1)
    explicit = _chat(config, temperature=0, top_p=1, top_k=-1, min_p=0, repetition_penalty=1)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.min_p) == (0.0, 1.0, 0, 0.0)
    assert explicit.repetition_penalty == 1.0
    assert _completion(config, temperature=1.2).temperature == 1.2
    assert _chat(config, temperature=None).temperature == 0.7  # null is "omitted", as before
    assert _chat(config, top_p=0).temperature == 0.0  # top_p 0 is still greedy


def test_max_new_tokens_is_the_default_budget_under_the_caps() -> None:
    assert _chat(_config(max_tokens=12)).max_new_tokens == 12
    assert _chat(_config(max_tokens=500)).max_new_tokens == 50  # --max-tokens still caps it
    assert _chat(_config(max_tokens=12), max_tokens=30).max_new_tokens == 30  # explicit wins
    assert _completion(_config(max_tokens=12)).max_new_tokens == 12
    assert _completion(_config(max_tokens=40)).max_new_tokens == 16  # completions' own 16 is smaller
    assert _chat(_config()).max_new_tokens == 50


def test_the_responses_echo_reports_the_defaults() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    echo = ResponseEnvelope.new(req, gc.SamplingDefaults(temperature=0.0, top_p=0.8)).echo
    assert (echo["temperature"], echo["top_p"]) == (0.0, 0.8)
    echo = ResponseEnvelope.new(
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "temperature": 0.5})
    ).echo
    assert (echo["temperature"], echo["top_p"]) == (0.5, 1.0)


# -- the CLI and a served model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose generation_config.json makes the default greedy (temperature 0)."""
    folder = tmp_path_factory.mktemp("greedy-llama")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, context=256).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # As a model creator writes it (transformers refuses to save temperature without do_sample).
    (folder / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 5}')
    return folder


def _texts(url: str, **body) -> list[str]:
    """Four seeded completions (each a different seed): equal only when decoding ignores the seed."""
    texts = []
    for seed in range(4):
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "The quick brown", "seed": seed, **body})
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    return texts


def test_a_served_models_generation_config_is_the_default(model_dir: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvb_server.cli")
    flags = ["--model", str(model_dir), "--no-oom-planning", "--max-cache-bytes", "4MiB"]
    server = build_server(build_parser().parse_args(flags))
    assert "sampling defaults from --generation-config auto" in caplog.text
    assert "'temperature': 0.0" in caplog.text
    with serve(server.app) as url:
        stats = httpx.get(f"{url}/v1/stats").json()["sampling_defaults"]
        assert stats == {
            "generation_config": "auto",
            "override_generation_config": {},
            "overrides": {"temperature": 0.0, "max_tokens": 5},
        }
        greedy = _texts(url, max_tokens=12)
        assert len(set(greedy)) == 1  # temperature 0 from the config: every seed decodes the same
        assert greedy == _texts(url, max_tokens=12, temperature=0)
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "The quick brown", "temperature": 0})
        assert resp.json()["usage"]["completion_tokens"] <= 5  # max_new_tokens: the default budget
        sampled = _texts(url, max_tokens=12, temperature=1.0)  # explicit values win
    server = build_server(build_parser().parse_args([*flags, "--generation-config", "vllm"]))
    with serve(server.app) as url:
        assert httpx.get(f"{url}/v1/stats").json()["sampling_defaults"]["overrides"] == {}
        assert _texts(url, max_tokens=12) == sampled  # OpenAI's temperature 1


@pytest.mark.parametrize("value", ["/nonexistent/generation-config", "auto-ish"])
def test_a_bad_folder_is_a_one_line_usage_error(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--model", "m", "--no-oom-planning", "--generation-config", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            f"--generation-config {value!r}: not a folder (expected auto, vllm or a folder holding "
            "generation_config.json)"
        )
    )


def test_the_flag_is_no_longer_refused_and_defaults_to_auto() -> None:
    assert build_parser().parse_args([]).generation_config == "auto"
    assert build_parser().parse_args(["--generation-config", "vllm"]).generation_config == "vllm"


# -- --override-generation-config -----------------------------------------------------------------------
def test_the_override_wins_per_key_over_auto_and_alone_applies_with_vllm() -> None:
    engine = FakeEngine()
    engine.model = SimpleNamespace(generation_config=GenerationConfig(temperature=0.0, top_k=1))
    override = gc.parse_override('{"temperature": 0.5, "max_new_tokens": 7}')
    assert gc.resolve("auto", engine, override=override).as_dict() == {
        "temperature": 0.5,
        "top_k": 1,
        "max_tokens": 7,
    }
    assert gc.resolve("vllm", engine, override=override).as_dict() == {"temperature": 0.5, "max_tokens": 7}
    # null drops the source's default for that key (vLLM's merge: a None value is no default).
    assert gc.resolve("auto", engine, override=gc.parse_override('{"top_k": null}')).as_dict() == {
        "temperature": 0.0
    }
    assert gc.resolve("auto", engine, override={}).as_dict() == {"temperature": 0.0, "top_k": 1}


def test_the_override_over_a_folder(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"top_k": 3, "top_p": 0.9}')
    override = gc.parse_override('{"top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.1}')
    assert gc.resolve(str(tmp_path), FakeEngine(), override=override).as_dict() == {
        "top_k": 3,
        "top_p": 0.5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{temperature: 0.5}", "--override-generation-config: not JSON"),
        ('[{"temperature": 0.5}]', "--override-generation-config: expected a JSON object with keys among"),
        ('{"temprature": 0.5}', "--override-generation-config: unsupported key(s) temprature; the supported"),
        ('{"temperature": 2.5}', "--override-generation-config sets temperature=2.5, which no request may"),
        ('{"max_new_tokens": 0}', "--override-generation-config sets max_new_tokens=0, which no request may"),
        ('{"top_k": true}', "--override-generation-config: top_k must be a number, not true/false"),
    ],
)
def test_a_bad_override_is_a_one_line_usage_error(value: str, message: str, capsys) -> None:
    # Checked before the model loads: "m" is no model at all.
    with pytest.raises(SystemExit) as info:
        main(["--model", "m", "--no-oom-planning", "--override-generation-config", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert message in last
    if "not JSON" in message or "key" in message:
        assert "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens" in last


def test_stats_and_the_startup_log_show_the_merged_defaults(model_dir: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="kvb_server.cli")
    flags = ["--model", str(model_dir), "--no-oom-planning", "--max-cache-bytes", "4MiB"]
    override = '{"temperature": 0.5, "top_k": 4}'
    server = build_server(build_parser().parse_args([*flags, "--override-generation-config", override]))
    merged = {"temperature": 0.5, "max_tokens": 5, "top_k": 4}
    assert "from --generation-config auto and --override-generation-config" in caplog.text
    assert "{'temperature': 0.5, 'top_k': 4, 'max_tokens': 5}" in caplog.text
    with serve(server.app) as url:
        assert httpx.get(f"{url}/v1/stats").json()["sampling_defaults"] == {
            "generation_config": "auto",
            "override_generation_config": {"temperature": 0.5, "top_k": 4},
            "overrides": merged,
        }
    args = build_parser().parse_args(
        [*flags, "--generation-config", "vllm", "--override-generation-config", override]
    )
    server = build_server(args)
    with serve(server.app) as url:
        stats = httpx.get(f"{url}/v1/stats").json()["sampling_defaults"]
        assert stats["overrides"] == {"temperature": 0.5, "top_k": 4}


def test_an_unreadable_generation_config_json_is_warned_about(tmp_path: Path, caplog) -> None:
    """transformers (and vLLM) fall back to the model config without a word: the folder's sampling defaults
    and its end-of-sequence ids were dropped silently."""
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "eos_token_id": [2,')
    with caplog.at_level(logging.WARNING, logger="kvb_server.generation_config"):
        gc.resolve(
            gc.AUTO,
            SimpleNamespace(model=SimpleNamespace(generation_config=GenerationConfig())),
            str(tmp_path),
        )
    assert "generation_config.json is not valid JSON" in caplog.text
    caplog.clear()
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    with caplog.at_level(logging.WARNING, logger="kvb_server.generation_config"):
        gc.resolve(
            gc.AUTO,
            SimpleNamespace(model=SimpleNamespace(generation_config=GenerationConfig())),
            str(tmp_path),
        )
    assert "not valid JSON" not in caplog.text
