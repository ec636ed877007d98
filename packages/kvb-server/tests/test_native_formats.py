"""Native tool-call formats with tokenizers shaped like the released checkpoints' (an audit, 2026-11-30;
templates and tokens written for these tests, the checkpoints cannot be downloaded here):

- Hermes tags held as *special* tokens (Hermes-2-Pro / Hermes-3 mark ``<tool_call>`` special): decoded with
  ``skip_special_tokens`` they vanished and a forced call came back as its bare JSON in ``content``; the
  reply is now decoded with special tokens kept when a tag it is read by is one (as vLLM's parsers do).
  Same for a reasoning model's ``<think>`` / ``</think>`` held as special tokens.
- Llama 3.1-3.3 open a JSON call with ``<|python_tag|>`` as often as not: the grammar masked it.
- Mistral v0.3's template writes ``[TOOL_CALLS] [``: the grammar forced ``[TOOL_CALLS][``.
- Mistral's templates refuse ids other than 9 alphanumerics: a history made by another backend was a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import llguidance
import llguidance.hf
import openai
import pytest
from conftest import build_tiny_engine, serve
from test_single_token_tags import THINKING_TEMPLATE
from test_tool_calls import accepts
from test_tool_templates import HERMES_TEMPLATE, WEATHER, tokenizer_with

from kvb_server import ServerConfig, create_app
from kvb_server.tool_calls import ToolCallStream, split_reply, tool_grammar
from kvb_server.tool_calls.prompt import template_id
from kvb_server.tool_calls.spec import tool_plan
from kvb_server.tool_calls.syntax import LLAMA3_JSON, MISTRAL, hermes

LLAMA_CALL = '{"name":"get_weather","parameters":{"unit":"celsius","days":2}}'
MISTRAL_CALL = '[{"name":"get_weather","arguments":{"unit":"celsius","days":2}}]'


@pytest.fixture(scope="module")
def marked():
    tokenizer = tokenizer_with(None, "<|python_tag|>", "[TOOL_CALLS]")
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def test_a_llama_call_may_open_with_python_tag(marked) -> None:
    tokenizer, _ = marked
    tag = {"<|python_tag|>": tokenizer.convert_tokens_to_ids("<|python_tag|>")}
    for mode in ("required", "auto"):
        plan = tool_plan([WEATHER], mode, None, LLAMA3_JSON)
        grammar = tool_grammar(plan, tag_tokens=tag)
        assert accepts(marked, grammar, "<|python_tag|>" + LLAMA_CALL) and accepts(
            marked, grammar, LLAMA_CALL
        )
        assert not accepts(marked, tool_grammar(plan), "<|python_tag|>" + LLAMA_CALL)  # before: masked
        # Decoded with special tokens kept, the tag is in the text: read past it, streamed the same.
        reply = split_reply("<|python_tag|>" + LLAMA_CALL, LLAMA3_JSON)
        assert reply.content is None and reply.calls[0].name == "get_weather"
        stream = ToolCallStream(plan)
        deltas = stream.deltas("<|python_", final=False) + stream.deltas("tag|>" + LLAMA_CALL, final=True)
        names = [d["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d]
        assert names[:1] == ["get_weather"]
        assert not any(d.get("content") for d in deltas)


def test_a_mistral_marker_may_be_followed_by_a_space(marked) -> None:
    tokenizer, _ = marked
    tag = {"[TOOL_CALLS]": tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")}
    grammar = tool_grammar(tool_plan([WEATHER], "required", None, MISTRAL), tag_tokens=tag)
    assert accepts(marked, grammar, "[TOOL_CALLS]" + MISTRAL_CALL)  # Nemo's template
    assert accepts(marked, grammar, "[TOOL_CALLS] " + MISTRAL_CALL)  # v0.3's
    assert not accepts(marked, grammar, "[TOOL_CALLS]  " + MISTRAL_CALL)


def test_foreign_ids_reach_a_mistral_template_as_nine_characters() -> None:
    openai_id = "call_Xy7abcdefghijklmnopqrstu"
    short = template_id(openai_id, MISTRAL)
    assert len(short) == 9 and short.isalnum() and short == template_id(openai_id, MISTRAL)
    assert template_id("call_other", MISTRAL) != short
    assert template_id("abcDEF123", MISTRAL) == "abcDEF123"  # already what the template takes
    assert template_id(openai_id, hermes(native=True)) == openai_id  # other templates take any id


def test_a_forced_reply_cut_inside_text_reads_the_same_streamed_and_not() -> None:
    """Text no grammar admits under a forced choice (a thinking block whose special tags were dropped from
    the text) must read the same both ways: it was content non-streamed and a call when streamed."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        plan = tool_plan([WEATHER], choice, None, hermes(native=True))
        text = " Let me think about the weather"
        whole = split_reply(text, plan.syntax, truncated=True, forced=True, names=("get_weather",))
        stream = ToolCallStream(plan)
        deltas = stream.deltas(text, final=True, truncated=True)
        assert whole.content == text and deltas == [{"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def special_hermes() -> Iterator[tuple[openai.OpenAI, dict[str, int]]]:
    tags = ("<tool_call>", "</tool_call>", "<think>", "</think>")
    tokenizer = tokenizer_with(THINKING_TEMPLATE, *tags)
    engine = build_tiny_engine(context=2048, tokenizer=tokenizer)
    config = ServerConfig(model_names=("tiny-llama",), max_tokens=96, reasoning_parser="qwen3")
    with serve(create_app(engine, config)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        yield client, {t: tokenizer.convert_tokens_to_ids(t) for t in tags}


@pytest.mark.parametrize("stream", [False, True])
def test_special_hermes_and_thinking_tags_are_read(special_hermes, stream: bool) -> None:
    api, ids = special_hermes
    kwargs = dict(
        model="tiny-llama",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
        logit_bias={str(ids["</think>"]): 100},  # a random model: end the thinking at once
    )
    if not stream:
        choice = api.chat.completions.create(**kwargs).choices[0]
        finish, content = choice.finish_reason, choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    else:
        finish, content, calls = None, "", []
        for chunk in api.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                if piece.function.name:
                    calls.append((piece.function.name, ""))
                calls[-1] = (calls[-1][0], calls[-1][1] + (piece.function.arguments or ""))
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content  # before: the call's JSON as content, "stop"
    [(name, arguments)] = calls
    assert name == "get_weather" and json.loads(arguments)["unit"] in ("celsius", "fahrenheit")


def test_special_think_tags_split_the_reasoning(special_hermes) -> None:
    api, ids = special_hermes
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    choice = api.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "a number?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        temperature=0,
        max_tokens=32,
        logit_bias={str(ids["</think>"]): 100},
    ).choices[0]
    assert json.loads(choice.message.content)["a"] in (1, 2)  # no blank or tag left in front of it
    assert "</think>" not in choice.message.content


def test_plain_requests_keep_skipping_special_tokens() -> None:
    """Only a reply read by special tags decodes them: a tokenizer whose tags are plain text (SmolLM2's)
    keeps the default."""
    from kvb_server.reasoning import PARSERS, ReasoningPlan
    from kvb_server.tag_tokens import keeps_special_tags

    plain = build_tiny_engine()
    plan = tool_plan([WEATHER], "required", None, hermes(native=True))
    assert not keeps_special_tags(plain, plan, ReasoningPlan(PARSERS["qwen3"], False))
    special = build_tiny_engine(tokenizer=tokenizer_with(HERMES_TEMPLATE, "<tool_call>", "</tool_call>"))
    assert keeps_special_tags(special, plan, None)
    assert not keeps_special_tags(special, None, None)
    marker_only = build_tiny_engine(tokenizer=tokenizer_with(None, "[TOOL_CALLS]"))
    assert not keeps_special_tags(marker_only, tool_plan([WEATHER], "required", None, MISTRAL), None)
