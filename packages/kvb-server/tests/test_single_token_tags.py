"""Tags a tokenizer holds as one added token (Qwen2.5 / Qwen3's ``<tool_call>``, reasoning models'
``</think>``): the tools' and the JSON-after-thinking grammars name them by id, so the model can write them
as the one token it was trained on.

llguidance reads every added token as a special token, whose text no grammar literal matches: with the tag
written as text, ``tool_choice="required"`` was a 400 on every request (the mask allowed the token, the
parser then refused it) and a thinking block could never end. The tokenizers here add the tags the way the
released Qwen tokenizers do (added, not special), on the tests' tiny vocabulary: no hub access here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import llguidance
import llguidance.hf
import openai
import pytest
from conftest import build_tiny_engine, build_tokenizer, serve
from test_tool_calls import accepts
from test_tool_templates import HERMES_TEMPLATE, WEATHER

from kvb_server import ServerConfig, create_app
from kvb_server.reasoning import PARSERS, ReasoningPlan
from kvb_server.tag_tokens import tag_tokens
from kvb_server.tool_calls import tool_grammar
from kvb_server.tool_calls.grammar import json_after_thinking
from kvb_server.tool_calls.spec import tool_plan
from kvb_server.tool_calls.syntax import hermes

TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"unit":"celsius","days":2}}\n</tool_call>'
#: A Qwen3-style template: tools rendered natively, and the generation prompt opens the thinking block.
THINKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
)


def tagged_tokenizer(template: str = HERMES_TEMPLATE):
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(list(TAGS))  # added, not special: as the released Qwen tokenizers hold them
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def tagged():
    tokenizer = tagged_tokenizer()
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def test_the_tags_are_found_as_single_added_tokens() -> None:
    engine = build_tiny_engine(tokenizer=tagged_tokenizer())
    ids = tag_tokens(engine, "<tool_call>\n", "\n</tool_call>", "</think>", "", "[TOOL_CALLS]")
    assert ids == {
        t: engine.tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "</think>")
    }
    plain = build_tiny_engine()  # the tags are several ordinary tokens there: written as text
    assert tag_tokens(plain, "<tool_call>", "</think>") == {}


def test_a_call_written_with_the_tag_tokens_is_admitted(tagged) -> None:
    tokenizer, _ = tagged
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    assert tokenizer.encode(CALL)[0] == ids["<tool_call>"]  # the text of a call holds the tag token
    for mode in ("required", "auto"):
        plan = tool_plan([WEATHER], mode, None, hermes(native=True))
        by_id = tool_grammar(plan, tag_tokens=ids)
        assert f"<[{ids['<tool_call>']}]>" in by_id
        assert accepts(tagged, by_id, CALL) and accepts(tagged, by_id, CALL + "\n" + CALL)
        assert not accepts(tagged, by_id, CALL.replace('"days":2', '"days":9'))
        assert accepts(tagged, by_id, "It is sunny.") == (mode == "auto")
        # Before: the tag as a literal, which the tag token never matches.
        assert not accepts(tagged, tool_grammar(plan), CALL)


@pytest.mark.parametrize("opened", [False, True])
def test_a_thinking_block_closed_by_its_token(tagged, opened: bool) -> None:
    tokenizer, _ = tagged
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    plan = ReasoningPlan(PARSERS["qwen3"], opened)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    grammar = json_after_thinking(schema, plan, tag_tokens=ids)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
    opening = "" if opened else "<think>"
    assert accepts(tagged, grammar, f'{opening}hm, one</think>\n{{"a":1}}')
    assert accepts(tagged, grammar, f'{opening}</think>{{"a":1}}')  # an empty block
    assert not accepts(tagged, grammar, f'{opening}hm</think>{{"a":"x"}}')
    assert accepts(tagged, grammar, '{"a":1}') == (not opened)  # a block the prompt opened must close
    assert not accepts(tagged, json_after_thinking(schema, plan), f'{opening}hm</think>{{"a":1}}')  # before
    calls = tool_grammar(
        tool_plan([WEATHER], "auto", None, hermes(native=True)), tag_tokens=ids, thinking=plan
    )
    assert accepts(tagged, calls, f"{opening}I need the weather.</think>\n{CALL}")
    assert accepts(tagged, calls, f"{opening}no tool</think>Sunny.")


@pytest.fixture(scope="module")
def client() -> Iterator[tuple[openai.OpenAI, dict[str, int]]]:
    engine = build_tiny_engine(context=2048, tokenizer=tagged_tokenizer(THINKING_TEMPLATE))
    config = ServerConfig(model_names=("tiny-llama",), max_tokens=96, reasoning_parser="qwen3")
    ids = {t: engine.tokenizer.convert_tokens_to_ids(t) for t in TAGS}
    with serve(create_app(engine, config)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), ids


def test_required_tools_are_called_with_the_tag_tokens(client) -> None:
    """The whole path: the model ends its (template-opened) thinking with the ``</think>`` token, then
    writes a call whose tags are tokens; the server reads the call back (before: a 400 on every request)."""
    api, ids = client
    resp = api.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
        logit_bias={str(ids["</think>"]): 100},  # a random model: end the thinking at once
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["unit"] in ("celsius", "fahrenheit")
    assert not choice.message.content


def test_json_after_thinking_ends_the_block_with_its_token(client) -> None:
    api, ids = client
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"]}  # no digit loop
    resp = api.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "a number?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        temperature=0,
        max_tokens=48,
        logit_bias={str(ids["</think>"]): 100},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice  # before: thinking until max_tokens, content None
    assert json.loads(choice.message.content)["a"] in (1, 2, 3)


@pytest.mark.parametrize("opened", [False, True])
def test_a_call_in_text_tags_after_a_token_closed_block_and_blank_lines(opened: bool) -> None:
    """``</think>`` one token, ``<tool_call>`` text (an R1 distill on a Llama vocabulary): in auto no call
    could follow ``</think>\\n\\n``, which reasoning models always write (a review, 2026-11-30: the lexer
    gave the blank to the text reply, which then refused the call)."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tagged = (tokenizer, llguidance.hf.from_tokenizer(tokenizer))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>")}
    plan = ReasoningPlan(PARSERS["qwen3"], opened)
    opening = "" if opened else "<think>"
    for mode in ("auto", "required"):
        grammar = tool_grammar(
            tool_plan([WEATHER], mode, None, hermes(native=True)), tag_tokens=ids, thinking=plan
        )
        for blank in ("", "\n", "\n\n", " " * 8):
            assert accepts(tagged, grammar, f"{opening}hm</think>{blank}{CALL}"), (mode, blank)
            assert accepts(tagged, grammar, f"{opening}hm</think>{blank}Sunny.") == (mode == "auto")
        assert not accepts(tagged, grammar, f"{opening}hm</think>{' ' * 9}{CALL}")
        if mode == "auto" and not opened:  # no thinking at all: any text, a leading blank included
            assert accepts(tagged, grammar, " Sunny.") and accepts(tagged, grammar, CALL)
