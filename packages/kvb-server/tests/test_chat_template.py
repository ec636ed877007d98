"""vLLM's ``--chat-template``: a template file (or the template text itself) replacing the tokenizer's for
every route that renders chat messages; a bad one is refused before the model loads."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tokenizer, serve

from kvb_cache.chat import render_chat
from kvb_server.chat_template import load_chat_template
from kvb_server.cli import build_parser, build_server, main, server_config

#: Plain "role: content" lines, no special tokens; two user turns in a row are refused while rendering.
PLAIN_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == 'user' and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
HI = [{"role": "user", "content": "Where is Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose tokenizer carries conftest's ChatML-like template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, context=256).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _flags(model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--no-oom-planning", "--max-cache-bytes", "4MiB", *extra]


def _exit_message(flags: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_file_or_the_template_text_itself_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(PLAIN_TEMPLATE)
    assert load_chat_template(str(path)) == PLAIN_TEMPLATE
    assert load_chat_template(PLAIN_TEMPLATE) == PLAIN_TEMPLATE  # no such file, holds '{': inline
    args = build_parser().parse_args(["--chat-template", "{{ messages[0]['content'] }}"])
    assert server_config(args).chat_template == "{{ messages[0]['content'] }}"
    assert server_config(build_parser().parse_args([])).chat_template is None  # the model's own


def test_the_flag_is_no_longer_refused_as_a_vllm_flag() -> None:
    assert build_parser().parse_args(["--chat-template", "t.jinja"]).chat_template == "t.jinja"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "/nonexistent/t.jinja",
            "--chat-template '/nonexistent/t.jinja': cannot read the file (No such file",
        ),
        (
            "{% for m in messages %}{{ m }}",
            "--chat-template (inline): not a valid Jinja template: Unexpected end",
        ),
        ("{{ x }", "--chat-template (inline): not a valid Jinja template"),
        ("", "--chat-template is empty"),
    ],
)
def test_a_missing_file_or_bad_jinja_is_a_one_line_usage_error(value: str, message: str, capsys) -> None:
    # Checked before the model loads: "m" is no model at all.
    assert message in _exit_message(["--model", "m", "--no-oom-planning", "--chat-template", value], capsys)


def test_a_template_file_that_does_not_compile_names_the_file_and_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}\n{{ m['content'] }}\n{% endif %}")
    last = _exit_message(["--model", "m", "--no-oom-planning", "--chat-template", str(path)], capsys)
    assert f"--chat-template {path}: not a valid Jinja template:" in last and "(line 3)" in last


def test_the_template_renders_every_chat_route(model_dir: Path, tmp_path: Path, caplog) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    caplog.set_level("INFO", logger="kvb_server.cli")
    server = build_server(build_parser().parse_args(_flags(model_dir, "--chat-template", str(path))))
    assert f"chat template from --chat-template {path}" in caplog.text
    tokenizer = build_tokenizer()
    expected = tokenizer("user: Where is Paris?\nassistant:", add_special_tokens=False)["input_ids"]
    assert render_chat(tokenizer, HI) != expected  # the model folder's template renders otherwise
    with serve(server.app) as url:
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": HI}).json()
        assert tokenized["tokens"] == expected
        assert httpx.get(f"{url}/tokenizer_info").json()["chat_template"] == PLAIN_TEMPLATE
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)
        responses = httpx.post(
            f"{url}/v1/responses", json={"model": str(model_dir), "input": HI, "max_output_tokens": 2}
        )
        assert responses.status_code == 200 and responses.json()["usage"]["input_tokens"] == len(expected)

        # The template's own raise_exception() is the request's fault: a 400 in OpenAI's shape.
        twice = [*HI, {"role": "user", "content": "And Rome?"}]
        for route, body in [
            ("/v1/chat/completions", {"messages": twice}),
            ("/tokenize", {"messages": twice}),
            ("/v1/responses", {"model": str(model_dir), "input": twice}),
        ]:
            resp = httpx.post(f"{url}{route}", json=body)
            assert resp.status_code == 400, (route, resp.text)
            error = resp.json()["error"]
            assert "roles must alternate" in error["message"], route
            assert error["type"] == "invalid_request_error"


def test_without_the_flag_the_model_folders_template_stays(model_dir: Path) -> None:
    server = build_server(build_parser().parse_args(_flags(model_dir)))
    with serve(server.app) as url:
        assert httpx.get(f"{url}/tokenizer_info").json()["chat_template"] == CHAT_TEMPLATE
        tokens = httpx.post(f"{url}/tokenize", json={"messages": HI}).json()["tokens"]
        assert tokens == render_chat(build_tokenizer(), HI)


#: Phi-3-mini's shape: system messages are dropped, and the generation prompt follows a user turn only.
DROPS_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'user' %}user: {{ m['content'] }}\n"
    "{% if add_generation_prompt and loop.last %}assistant:{% endif %}"
    "{% elif m['role'] == 'assistant' %}assistant: {{ m['content'] }}\n{% endif %}{% endfor %}"
)


# With OOM planning (on by default where kvb-planner is installed) the planner saw the empty prompt first: a 500.
@pytest.mark.parametrize("planning", [["--no-oom-planning"], []], ids=["no-planning", "planning"])
def test_a_conversation_the_template_renders_to_nothing_is_a_400_naming_messages(
    model_dir: Path, tmp_path: Path, planning: list[str]
) -> None:
    path = tmp_path / "drops_system.jinja"
    path.write_text(DROPS_SYSTEM)
    flags = ["--model", str(model_dir), "--max-cache-bytes", "4MiB", "--chat-template", str(path), *planning]
    server = build_server(build_parser().parse_args(flags))
    only_system = [{"role": "system", "content": "Be brief."}]
    with serve(server.app) as url:
        for route, body in [
            ("/v1/chat/completions", {"messages": only_system, "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": only_system, "max_tokens": 2, "stream": True}),
            ("/v1/responses", {"model": str(model_dir), "input": only_system, "max_output_tokens": 2}),
        ]:
            resp = httpx.post(f"{url}{route}", json=body)
            assert resp.status_code == 400, (route, resp.text)
            error = resp.json()["error"]
            assert "rendered these messages to an empty prompt" in error["message"], route
            assert error["param"] in ("messages", "input"), route
        assert (
            httpx.post(f"{url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code
            == 200
        )


def test_tool_results_then_a_user_message_on_a_template_that_wants_alternation(
    model_dir: Path, tmp_path: Path
) -> None:
    """A template without a tool syntax gets tool results as a user turn; on one that refuses two user turns
    in a row (Gemma's "roles must alternate"), a user message after them was a 400 about roles the client
    never sent (an audit, 2026-12-01): the results now open that user message's turn."""
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    server = build_server(build_parser().parse_args(_flags(model_dir, "--chat-template", str(path))))
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    with serve(server.app) as url:
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages, "tools": tools})
        assert tokenized.status_code == 200, tokenized.text
        text = build_tokenizer().decode(tokenized.json()["tokens"])
        assert "user: <tool_response>\nsunny\n</tool_response>\n\nAnd tomorrow?\nassistant:" in text
        # The results at the end of the conversation are still a user turn of their own.
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages[:3], "tools": tools})
        assert tokenized.status_code == 200, tokenized.text


#: Reads the system message as a string (``|trim``), loops over the others' parts: auto detection sees the
#: loop and sends parts everywhere, so the system message printed as a Python list (an audit, 2026-12-01).
MIXED_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}system: {{ m['content'] | trim }}\n"
    "{% else %}{{ m['role'] }}:{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %} {{ p['text'] }}{% endfor %}{% endif %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.mark.parametrize(
    ("content_format", "system_line"),
    [
        (None, "system: [{'type': 'text', 'text': 'Be brief.'}]"),  # auto: parts, as vLLM's auto sends
        ("string", "system: Be brief."),
        ("openai", "system: [{'type': 'text', 'text': 'Be brief.'}]"),
    ],
)
def test_the_content_format_flag_decides_what_the_template_receives(
    model_dir: Path, tmp_path: Path, content_format: str | None, system_line: str
) -> None:
    path = tmp_path / "mixed.jinja"
    path.write_text(MIXED_TEMPLATE)
    extra = [] if content_format is None else ["--chat-template-content-format", content_format]
    server = build_server(build_parser().parse_args(_flags(model_dir, "--chat-template", str(path), *extra)))
    messages = [{"role": "system", "content": "Be brief."}, *HI]
    with serve(server.app) as url:
        tokens = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
        text = build_tokenizer().decode(tokens)
        assert text == f"{system_line}\nuser: Where is Paris?\nassistant:"
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(tokens)


def test_an_unknown_content_format_is_a_usage_error(model_dir: Path, capsys) -> None:
    message = _exit_message(_flags(model_dir, "--chat-template-content-format", "parts"), capsys)
    assert "--chat-template-content-format" in message and "parts" in message
