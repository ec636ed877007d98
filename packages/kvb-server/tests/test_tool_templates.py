"""Templates that render tools themselves: the prompt the server builds and the calls it reads back.

The templates below are written for these tests in the style of Qwen2.5's (Hermes tags) and Mistral's
(``[TOOL_CALLS]``, a special token); real checkpoints cannot be downloaded here. What they check: tools
and tool history reach the template in Hugging Face's shapes (``arguments`` as a dict, not a JSON string),
and a special-token marker is generated as that token and parsed even though decoding drops it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import openai
import pytest
from conftest import build_tiny_engine, build_tokenizer, serve

from kvb_server import ServerConfig, create_app
from kvb_server.request_plan import chat_plan
from kvb_server.schemas.generation_requests import ChatCompletionRequest
from kvb_server.tool_calls import detect

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools>\nCall a tool inside <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    '{%- for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]["
    '{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }},'
    ' "id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>'
    "{%- elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}{{ raise_exception('ids must be 9 long') }}"
    '{% endif %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- else %}{{ m.content }}{% endif %}{% endfor %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["unit", "days"],
        },
    },
}
HISTORY = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "abcdefghi",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"unit":"celsius","days":1}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"},
]


def tokenizer_with(template: str, *special: str):
    tokenizer = build_tokenizer()
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    tokenizer.chat_template = template
    return tokenizer


def prompt_text(engine, body: dict) -> str:
    req = ChatCompletionRequest.model_validate({"model": "tiny-llama", **body})
    plan = chat_plan(req, engine, ServerConfig(model_names=("tiny-llama",), max_tokens=64))
    return engine.tokenizer.decode(plan.prompts[0])


def test_a_hermes_template_gets_tools_and_history_in_hugging_face_shapes() -> None:
    engine = build_tiny_engine(context=2048, tokenizer=tokenizer_with(HERMES_TEMPLATE))
    assert (detect(engine.tokenizer).name, detect(engine.tokenizer).native) == ("hermes", True)
    text = prompt_text(engine, {"messages": HISTORY, "tools": [WEATHER]})
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "get_weather"' in text
    # arguments reached the template as a dict (tojson of a string would print an escaped string)
    assert '{"name": "get_weather", "arguments": {"unit": "celsius", "days": 1}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "You can use the following tools" not in text  # the server's own prompt is not added


@pytest.fixture(scope="module")
def mistral_url() -> Iterator[str]:
    engine = build_tiny_engine(context=2048, tokenizer=tokenizer_with(MISTRAL_TEMPLATE, "[TOOL_CALLS]"))
    with serve(create_app(engine, ServerConfig(model_names=("tiny-llama",), max_tokens=96))) as url:
        yield url


def test_a_special_token_marker_is_generated_and_parsed(mistral_url: str) -> None:
    client = openai.OpenAI(base_url=f"{mistral_url}/v1", api_key="x", max_retries=0)
    # One call per reply: a random model would otherwise repeat calls up to max_tokens.
    kwargs = dict(
        model="tiny-llama",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    resp = client.chat.completions.create(messages=HISTORY[:1], **kwargs)
    assert resp.choices[0].finish_reason == "tool_calls", resp
    calls = resp.choices[0].message.tool_calls
    assert calls and all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls)  # what the template requires
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and args["unit"] in ("celsius", "fahrenheit")
    # The ids go back through the template, which refuses anything but 9 characters.
    history = [
        *HISTORY[:1],
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
    ]
    again = client.chat.completions.create(messages=history, **kwargs)
    assert again.choices[0].message.tool_calls
    # A paired history made by another backend (OpenAI's ids are not 9 characters): the template refused
    # it ("ids must be 9 long"), so such a conversation could not go on here (an audit, 2026-11-30); each
    # foreign id reaches the template as 9 hex digits of its hash, the same for the call and its result.
    foreign_call = {**calls[0].model_dump(), "id": "call_Xy7abcdefghijklmnopqrstu"}
    foreign = [
        *HISTORY[:1],
        {"role": "assistant", "content": None, "tool_calls": [foreign_call]},
        {"role": "tool", "tool_call_id": foreign_call["id"], "content": "sunny"},
    ]
    assert client.chat.completions.create(messages=foreign, **kwargs).choices[0].message.tool_calls
    # An id answering no call is refused before the template is asked (OpenAI's check).
    unpaired = [*history[:2], {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(messages=unpaired, **kwargs)
    assert info.value.param == "messages[2].tool_call_id" and "not found" in str(info.value)
