"""Message content in the shape the chat template reads (kvb_cache.chat_content): a string, or text parts.

Found by an audit with other families' templates (2026-11-30): a template that loops over content as parts
(SmolVLM / Idefics3 style) rendered a prompt without the user's text when handed a string (a 200 with a
wrong answer), one that indexes the parts refused a correct request, and a string template handed parts
raised an untyped TypeError from inside jinja.
"""

from __future__ import annotations

import copy

import pytest
from conftest import words

from kvb_cache import InvalidRequestError, KVBoost
from kvb_cache.chat_content import content_format, fit_content

STRING = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
LOOP = (  # Idefics3 / SmolVLM style: only parts
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %} {{ line['text'] }}{% endif %}"
    "{% endfor %} <eos> {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
INDEXED = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content[0]['text'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BOTH = (  # Qwen2-VL / Llama 3.2 Vision style: a string or parts
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c.type == 'text' %} {{ c.text }}{% endif %}{% endfor %}"
    "{% endif %} <eos> {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
#: A string template that concatenates (Mistral v0.1 style): parts there were a TypeError from jinja.
CONCAT = (
    "{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [(STRING, "string"), (CONCAT, "string"), (LOOP, "openai"), (INDEXED, "openai"), (BOTH, "openai")],
)
def test_the_format_is_read_from_the_template(template: str, fmt: str) -> None:
    assert content_format(template) == fmt


def test_templates_with_loop_controls_or_generation_blocks_are_read() -> None:
    """Hub templates use {% break %} and {% generation %}, which apply_chat_template's environment takes
    and a plain jinja2 one refuses (a review: such a parts template was read as "string")."""
    with_break = LOOP.replace(
        "{% endif %}{% endfor %}", "{% endif %}{% if loop.index > 9 %}{% break %}{% endif %}{% endfor %}", 1
    )
    with_generation = LOOP.replace(
        "<|{{ message['role'] }}|>", "{% generation %}<|{{ message['role'] }}|>{% endgeneration %}"
    )
    assert with_break != LOOP and with_generation != LOOP
    assert content_format(with_break) == "openai" and content_format(with_generation) == "openai"


def test_an_unparsable_template_is_left_alone() -> None:
    assert content_format("{% for x in %}") == "string"


def test_fit_content_converts_only_what_the_template_cannot_read() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    assert fit_content(messages, "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": [], "tool_calls": [{"id": "1"}]},
        messages[2],
        messages[3],
    ]
    assert fit_content(messages, "string") == [
        messages[0],
        messages[1],
        {"role": "user", "content": "b\nc"},
        messages[3],
    ]
    assert messages[0]["content"] == "a"  # the caller's messages are not changed


@pytest.fixture()
def engine_with(llama, tokenizer):
    def build(template: str) -> KVBoost:
        own = copy.deepcopy(tokenizer)
        own.chat_template = template
        return KVBoost(llama, own)

    return build


@pytest.mark.parametrize("template", [LOOP, INDEXED, BOTH])
def test_a_parts_template_gets_the_users_text_as_a_string_or_as_parts(engine_with, template: str) -> None:
    engine = engine_with(template)
    text = words(5, seed=3)
    as_string = engine.chat_prompt([{"role": "user", "content": text}])
    as_parts = engine.chat_prompt([{"role": "user", "content": [{"type": "text", "text": text}]}])
    assert as_string == as_parts
    rendered = engine.tokenizer.decode(as_string)
    assert text in rendered  # the LOOP template printed nothing of a string content before


@pytest.mark.parametrize("template", [STRING, CONCAT])
def test_a_string_template_gets_text_parts_joined(engine_with, template: str) -> None:
    engine = engine_with(template)
    joined = engine.chat_prompt([{"role": "user", "content": "one\ntwo"}])
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert engine.chat_prompt([{"role": "user", "content": parts}]) == joined


def test_a_content_the_template_cannot_render_is_a_typed_error(engine_with) -> None:
    engine = engine_with(CONCAT)
    with pytest.raises(InvalidRequestError, match="chat template") as err:
        engine.chat_prompt([{"role": "user", "content": {"text": "a dict"}}])
    assert err.value.param == "messages"


def test_the_caller_can_choose_the_content_format(engine_with) -> None:
    """``content_format`` overrides what the template's source reads as (vLLM's
    ``--chat-template-content-format``): BOTH reads either shape, so each choice renders the same text;
    on LOOP, ``string`` starves the loop (it walks the string's characters, none has a ``type``)."""
    text = words(5, seed=4)
    messages = [{"role": "user", "content": text}]
    both = engine_with(BOTH)
    auto = both.chat_prompt(messages)
    assert both.chat_prompt(messages, content_format="string") == auto
    assert both.chat_prompt(messages, content_format="openai") == auto
    loop = engine_with(LOOP)
    assert text in loop.tokenizer.decode(loop.chat_prompt(messages))
    assert text not in loop.tokenizer.decode(loop.chat_prompt(messages, content_format="string"))
    string = engine_with(STRING)
    as_parts = string.chat_prompt(messages, content_format="openai")  # prints the list, not the text
    assert as_parts != string.chat_prompt(messages) and text not in string.tokenizer.decode(as_parts)


def test_an_unknown_content_format_is_a_typed_error(engine_with) -> None:
    with pytest.raises(InvalidRequestError, match="auto, string, openai") as err:
        engine_with(STRING).chat_prompt([{"role": "user", "content": "a"}], content_format="parts")
    assert err.value.param == "content_format"
