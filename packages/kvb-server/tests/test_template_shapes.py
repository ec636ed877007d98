"""Chat templates of other shapes than SmolLM2's (written for these tests in the style of the real ones; the
checkpoints cannot be downloaded here): one without a system role (Gemma's, Mistral v0.1's) and one that
reads content only as a list of parts (SmolVLM / Idefics3). Found by an audit, 2026-11-30: ``tools`` on the
first were a 400 blaming ``messages`` the client never sent (the server's tools prompt was a system
message), and the second rendered a prompt without the user's text (a 200 with a wrong answer).
"""

from __future__ import annotations

import pytest
from conftest import build_tiny_engine, build_tokenizer
from test_tool_templates import WEATHER

from kvb_server import ServerConfig
from kvb_server.errors import InvalidParameterError
from kvb_server.request_plan import chat_plan
from kvb_server.schemas.generation_requests import ChatCompletionRequest

NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>model\n{% endif %}"
)
PARTS_ONLY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for line in m['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = {"role": "user", "content": "What is the weather in Paris?"}


def engine_with(template: str):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    return build_tiny_engine(context=2048, tokenizer=tokenizer)


def prompt_text(engine, body: dict) -> str:
    req = ChatCompletionRequest.model_validate({"model": "tiny-llama", **body})
    plan = chat_plan(req, engine, ServerConfig(model_names=("tiny-llama",), max_tokens=64))
    return engine.tokenizer.decode(plan.prompts[0])


@pytest.fixture(scope="module")
def no_system():
    return engine_with(NO_SYSTEM)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tools_reach_a_template_without_a_system_role_in_the_first_user_turn(no_system, choice: str) -> None:
    text = prompt_text(no_system, {"messages": [USER], "tools": [WEATHER], "tool_choice": choice})
    assert text.startswith("<|im_start|>user\nYou can use the following tools")
    assert '"name": "get_weather"' in text and text.index("<tools>") < text.index(USER["content"])
    # A conversation with a tool round trip keeps the roles alternating.
    history = [
        USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit":"celsius","days":1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = prompt_text(no_system, {"messages": history, "tools": [WEATHER], "tool_choice": choice})
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_system_message_the_client_sent_is_still_the_templates_refusal(no_system) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, USER], "tools": [WEATHER]}
    with pytest.raises(InvalidParameterError, match="System role not supported") as err:
        prompt_text(no_system, body)
    assert err.value.param == "messages"


def test_a_template_with_a_system_role_still_gets_a_system_message() -> None:
    text = prompt_text(build_tiny_engine(context=2048), {"messages": [USER], "tools": [WEATHER]})
    assert "You can use the following tools" in text.split(USER["content"])[0]
    assert "system" in text.split("You can use the following tools")[0]


@pytest.mark.parametrize(
    "content",
    [
        USER["content"],
        [{"type": "text", "text": "What is the weather"}, {"type": "text", "text": "in Paris?"}],
    ],
)
def test_a_parts_only_template_gets_the_users_text(content) -> None:
    text = prompt_text(engine_with(PARTS_ONLY), {"messages": [{"role": "user", "content": content}]})
    said = content if isinstance(content, str) else "What is the weather\nin Paris?"
    assert text == f"<|im_start|>user\n{said}<|im_end|>\n<|im_start|>assistant\n"
