"""KVBoost.chat_prompt: the tokenizer's own template, vLLM's template options, template errors as 400s."""

from __future__ import annotations

import copy

import pytest
from conftest import words

from kvb_cache import InvalidRequestError, KVBoost, PromptTypeError

THINKING = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% if enable_thinking is defined and not enable_thinking %}"
    "<eos> {% endif %}{% endif %}"
)


@pytest.fixture()
def engine(llama, tokenizer):
    own = copy.deepcopy(tokenizer)  # the session tokenizer's template stays as it is
    own.chat_template = THINKING
    return KVBoost(llama, own)


MESSAGES = [{"role": "user", "content": words(6, seed=1)}]


def test_chat_template_kwargs_reach_the_template(engine):
    plain = engine.chat_prompt(MESSAGES)
    off = engine.chat_prompt(MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert (
        off
        == engine.tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, enable_thinking=False
        )["input_ids"]
    )
    assert off[: len(plain)] == plain and len(off) > len(plain)


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"tools": []}, {"return_dict": False}, [1], {1: 2}])
def test_chat_template_kwargs_only_set_template_variables(engine, kwargs):
    with pytest.raises(InvalidRequestError) as info:
        engine.chat_prompt(MESSAGES, chat_template_kwargs=kwargs)
    assert info.value.param == "chat_template_kwargs"


def test_a_template_broken_by_its_variables_names_chat_template_kwargs_not_the_messages(engine):
    """A template variable that breaks rendering (shadowing a name the template calls, as vLLM's and
    transformers' templates let a request do) was blamed on ``messages`` (an audit, 2026-12-01)."""
    engine.tokenizer.chat_template = "{% set ns = namespace(n=0) %}" + THINKING
    assert engine.chat_prompt(MESSAGES)
    with pytest.raises(InvalidRequestError) as info:
        engine.chat_prompt(MESSAGES, chat_template_kwargs={"namespace": None})
    assert info.value.param == "chat_template_kwargs"
    two_users = THINKING.replace(
        "{% for m in messages %}", "{% for m in messages %}{{ raise_exception('no') if loop.index > 1 }}"
    )
    engine.tokenizer.chat_template = two_users
    with pytest.raises(InvalidRequestError) as info:  # the messages themselves are refused: still messages
        engine.chat_prompt(MESSAGES * 2, chat_template_kwargs={"enable_thinking": False})
    assert info.value.param == "messages"


def test_every_argument_of_the_installed_apply_chat_template_is_refused(engine):
    """Read from the signature, not only a hand-written list: transformers 5.2x's ``sanitize_control_tokens``
    slipped through (a request switched how control tokens in its text were encoded), ``self`` was a
    TypeError worded as a template failure."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    names = [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    assert "self" in names and "tokenize" in names
    for name in names:
        with pytest.raises(InvalidRequestError, match=name) as info:
            engine.chat_prompt(MESSAGES, chat_template_kwargs={name: True})
        assert info.value.param == "chat_template_kwargs"


def test_continue_final_message_leaves_the_last_message_open(engine):
    messages = [*MESSAGES, {"role": "assistant", "content": words(4, seed=2)}]
    closed = engine.chat_prompt(messages, add_generation_prompt=False)
    open_ = engine.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert closed[: len(open_)] == open_ and len(open_) < len(closed)
    with pytest.raises(InvalidRequestError) as info:
        engine.chat_prompt(messages, continue_final_message=True)  # with the generation prompt: contradictory
    assert info.value.param == "continue_final_message"


def test_a_template_that_raises_is_a_request_error(engine):
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        engine.chat_prompt(MESSAGES)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    "messages",
    [None, "hello", [("user", "hi")], [{"role": 5, "content": "hi"}]],
    ids=["none", "string", "tuple-message", "int-role"],
)
def test_messages_of_the_wrong_type_are_a_prompt_type_error(engine, messages):
    # These reached the template and failed inside transformers/jinja with an untyped TypeError or
    # AttributeError ("'NoneType' object is not iterable", "'str' object has no attribute 'items'").
    with pytest.raises(PromptTypeError, match="messages") as info:
        engine.chat_prompt(messages)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"add_generation_prompt": "false"}, "add_generation_prompt"),
        ({"add_generation_prompt": False, "continue_final_message": 1}, "continue_final_message"),
        ({"tools": "abc"}, "tools"),
        ({"tools": [5]}, "tools"),
    ],
)
def test_chat_options_of_the_wrong_type_are_refused(engine, options, param):
    """add_generation_prompt="false" is truthy: the generation prompt was rendered anyway. transformers'
    own types stay accepted: continue_final_message may name the final message's field to continue, and a
    tool may be a function (read as a JSON schema)."""
    with pytest.raises(InvalidRequestError) as info:
        engine.chat_prompt(MESSAGES, **options)
    assert info.value.param == param
    if options.get("tools") == [5]:
        assert "tools[0]" in str(info.value)


def test_transformers_own_option_types_still_render(engine):
    def weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city's name
        """
        return city

    assert engine.chat_prompt(MESSAGES, tools=[weather])
    started = [*MESSAGES, {"role": "assistant", "content": "so"}]
    named = engine.chat_prompt(started, add_generation_prompt=False, continue_final_message="content")
    assert named == engine.chat_prompt(started, add_generation_prompt=False, continue_final_message=True)


def test_messages_or_an_encoding_passed_as_a_prompt_name_the_fix(engine):
    from kvb_cache import PromptTypeError

    with pytest.raises(PromptTypeError, match=r"engine\.chat_prompt\(messages\)"):
        engine.generate(MESSAGES, max_new_tokens=2)
    with pytest.raises(PromptTypeError, match=r"\['input_ids'\]"):
        engine.generate(engine.tokenizer("hi"), max_new_tokens=2)
