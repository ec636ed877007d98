"""``--reasoning-parser``: a reasoning model's ``<think>...</think>`` leaves ``content`` for ``reasoning`` /
``reasoning_content``, streamed or not, whichever way the template opens the block."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest
from conftest import serve
from fakes import FakeEngine
from test_tool_calls import accepts as grammar_accepts

from kvb_server import ServerConfig, create_app
from kvb_server.reasoning import PARSERS, ReasoningPlan, ReasoningStream, split

MODEL = "fake-model"
QWEN3 = PARSERS["qwen3"]


@pytest.fixture(scope="module")
def accepts():
    """``accepts(grammar, text)``: llguidance takes ``text``'s tokens (the tests' tokenizer) and ends there."""
    import llguidance.hf
    from conftest import build_tokenizer

    tokenizer = build_tokenizer()
    return functools.partial(grammar_accepts, (tokenizer, llguidance.hf.from_tokenizer(tokenizer)))


def _record_prompts(fake: FakeEngine) -> list[list[dict]]:
    """The messages of every chat prompt ``fake`` renders, in order."""
    seen: list[list[dict]] = []
    render = fake.chat_prompt

    def chat_prompt(messages, **kw):
        seen.append(messages)
        return render(messages, **kw)

    fake.chat_prompt = chat_prompt
    return seen


@pytest.mark.parametrize(
    ("reply", "opened", "expected"),
    [
        ("<think>Let me see.</think>\n\nThe answer is 4.", False, ("Let me see.", "The answer is 4.")),
        ("The answer is 4.", False, (None, "The answer is 4.")),  # never thought (enable_thinking false)
        ("<think>cut off by max_tokens", False, ("cut off by max_tokens", None)),
        ("Let me see.</think>4", True, ("Let me see.", "4")),  # the template opened the block
        ("still thinking", True, ("still thinking", None)),
        ("  <think>a</think>b", False, ("a", "b")),
        ("a <think> in the answer", False, (None, "a <think> in the answer")),
    ],
)
def test_split(reply: str, opened: bool, expected: tuple[str | None, str | None]) -> None:
    assert split(reply, ReasoningPlan(QWEN3, opened)) == expected


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_a_tag_split_across_pieces_never_leaks(size: int) -> None:
    reply = "<think>step 1</think>\n\nanswer </think> stays"
    stream = ReasoningStream(ReasoningPlan(QWEN3, False))
    thought = content = ""
    for at in range(0, len(reply), size):
        r, c = stream.feed(reply[at : at + size])
        thought, content = thought + r, content + c
    r, c = stream.feed("", final=True)
    assert (thought + r, content + c) == ("step 1", "answer </think> stays")


def test_other_tags() -> None:
    assert split("[THINK]x[/THINK]y", ReasoningPlan(PARSERS["mistral"], False)) == ("x", "y")
    assert split("<seed:think>x</seed:think>y", ReasoningPlan(PARSERS["seed_oss"], False)) == ("x", "y")


def _app(reply: str, *, parser: str | None = "qwen3", opens: bool = False):
    fake = FakeEngine()
    fake.reply = reply
    if opens:
        fake.generation_prompt = "<assistant><think>\n"
    return fake, create_app(fake, ServerConfig(model_names=(MODEL,), reasoning_parser=parser))


def test_a_reply_with_thinking_is_split_in_the_message() -> None:
    _, app = _app("<think>2 + 2 is 4.</think>\n\nFour.")
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}])
        message = resp.choices[0].message
        assert message.content == "Four." and resp.choices[0].finish_reason == "stop"
        assert message.model_extra["reasoning"] == "2 + 2 is 4."
        assert message.model_extra["reasoning_content"] == "2 + 2 is 4."


def test_without_the_flag_the_thinking_stays_in_content() -> None:
    _, app = _app("<think>hm</think>Four.", parser=None)
    with serve(app) as url:
        body = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}]},
        ).json()
        message = body["choices"][0]["message"]
        assert message["content"] == "<think>hm</think>Four." and "reasoning" not in message


def test_a_template_that_opens_the_block_and_a_reply_cut_off_while_thinking() -> None:
    _, app = _app("I should count. One, two", opens=True)
    with serve(app) as url:
        body = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 8},
        ).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "I should"


def test_streamed_thinking_arrives_as_reasoning_deltas_then_content() -> None:
    _, app = _app("<think>a b c</think>\n\nFour.")
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "2+2?"}], stream=True
        )
        thought = content = ""
        order = []
        for chunk in stream:
            delta = chunk.choices[0].delta
            piece = (delta.model_extra or {}).get("reasoning")
            if piece:
                assert delta.model_extra["reasoning_content"] == piece
                thought += piece
                order.append("reasoning")
            if delta.content:
                content += delta.content
                order.append("content")
        assert (thought, content) == ("a b c", "Four.")
        assert order == sorted(order, key=lambda kind: kind == "content")  # all reasoning first


def test_the_history_passes_thinking_to_the_template() -> None:
    """Qwen3's template reads an assistant turn's ``reasoning_content``; clients send either name."""
    fake, app = _app("ok")
    seen = _record_prompts(fake)
    with serve(app) as url:
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning": "be nice"},
            {"role": "user", "content": "again"},
        ]
        assert httpx.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages}
        ).is_success
        assert seen[-1][1]["reasoning_content"] == "be nice" and seen[-1][1]["reasoning"] == "be nice"
        messages[1] = {"role": "assistant", "content": "hello", "reasoning_content": 7}
        bad = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].reasoning_content"


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="known: deepseek_r1"):
        ServerConfig(model_names=(MODEL,), reasoning_parser="nope")


def test_the_flag_parses(capsys) -> None:
    from kvb_server.cli import build_parser, server_config

    args = build_parser().parse_args(["--reasoning-parser", "deepseek_r1"])
    assert server_config(args).reasoning_parser == "deepseek_r1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_responses_api_returns_thinking_as_a_reasoning_item() -> None:
    """OpenAI's reasoning item (``reasoning_text`` content, as its open-weight models report it) before
    the message; replayed as input, its text is the assistant turn's ``reasoning_content`` again."""
    fake, app = _app("<think>2 + 2 is 4.</think>\n\nFour.")
    seen = _record_prompts(fake)
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        first = client.responses.create(model=MODEL, input="2+2?")
        kinds = [item.type for item in first.output]
        assert kinds == ["reasoning", "message"] and first.output_text == "Four."
        assert first.output[0].content[0].text == "2 + 2 is 4." and first.output[0].summary == []
        history = [{"role": "user", "content": "2+2?"}, *[i.model_dump() for i in first.output]]
        client.responses.create(model=MODEL, input=[*history, {"role": "user", "content": "and 3+3?"}])
        assert seen[-1][1]["reasoning_content"] == "2 + 2 is 4." and seen[-1][1]["content"] == "Four."
        client.responses.create(model=MODEL, input="and 3+3?", previous_response_id=first.id)
        assert seen[-1][1]["reasoning_content"] == "2 + 2 is 4."
        encrypted = {**history[1], "encrypted_content": "gAAAA"}
        with pytest.raises(openai.BadRequestError, match="encrypted"):
            client.responses.create(model=MODEL, input=[history[0], encrypted])


def test_the_responses_api_streams_reasoning_events() -> None:
    _, app = _app("<think>a b</think>Four.")
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(model=MODEL, input="2+2?", stream=True))
        kinds = [e.type for e in events]
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert (thought, text) == ("a b", "Four.")
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
        done = events[-1].response
        assert [item.type for item in done.output] == ["reasoning", "message"]
        assert done.output[0].content[0].text == "a b" and done.output_text == "Four."
        assert [e.sequence_number for e in events] == list(range(len(events)))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_a_reasoning_model_thinks_then_calls_a_tool(stream: bool) -> None:
    """A thinking model's reply with tools is ``<think>...</think>`` then the call: the reasoning is split
    out and the call is still parsed (before, the tools' grammar read ``<think>`` as the start of plain
    text, so the call after it was never parsed)."""
    fake, app = _app(f"<think>I need the weather.</think>\n\n{CALL}")
    fake.context_length = 4000  # the tools' system prompt
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert choice.message.model_extra["reasoning"] == "I need the weather."
            assert choice.message.tool_calls[0].function.arguments == '{"city":"Paris"}'
        else:
            thought, args, finish = "", "", None
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                delta = chunk.choices[0].delta
                thought += (delta.model_extra or {}).get("reasoning") or ""
                for call in delta.tool_calls or ():
                    args += call.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            assert (thought, args, finish) == ("I need the weather.", '{"city":"Paris"}', "tool_calls")
        grammar = fake.added[-1].params.response_format.source
        assert grammar.startswith("start: THINK? reply") and "THINK: /<think>" in grammar


def test_the_tools_grammar_admits_a_thinking_block_and_checks_the_call_after_it(accepts) -> None:
    from kvb_server.tool_calls import tool_grammar, tool_plan
    from kvb_server.tool_calls.syntax import hermes

    spec = [{"type": "function", "function": {**WEATHER["function"]}}]
    for mode in ("auto", "required"):
        plan = tool_plan(spec, mode, None, hermes(native=True))
        free = tool_grammar(plan, thinking=ReasoningPlan(QWEN3, False))
        opened = tool_grammar(plan, thinking=ReasoningPlan(QWEN3, True))
        assert accepts(free, f"<think>hm</think>\n{CALL}") and accepts(free, CALL)
        assert accepts(opened, f"hm</think>\n{CALL}") and not accepts(opened, CALL)  # must close it
        bad = '<tool_call>\n{"name":"get_weather","arguments":{"town":1}}\n</tool_call>'
        assert not accepts(free, f"<think>hm</think>\n{bad}") and not accepts(opened, f"hm</think>{bad}")
        assert accepts(free, "<think>hm</think>Sunny.") == (mode == "auto")


def test_a_reasoning_model_thinks_then_answers_in_json() -> None:
    """``response_format`` json_schema: the grammar admits the thinking block, then holds the answer to
    the schema (vLLM starts the structured-output grammar when the thinking ends); ``content`` is the
    JSON alone, so the SDK's ``parse()`` reads it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fake, app = _app('<think>one is a number</think>\n{"a":1}')
    with serve(app) as url:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "json"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
        message = httpx.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["content"] == '{"a":1}' and message["reasoning"] == "one is a number"
        grammar = fake.added[-1].params.response_format
        assert grammar.kind == "grammar" and grammar.source.startswith("start: THINK? reply")
        regex = {**body, "response_format": {"type": "regex", "pattern": "[a-z]+"}}
        fake.reply = "<think>x</think>abc"
        message = httpx.post(f"{url}/v1/chat/completions", json=regex).json()["choices"][0]["message"]
        assert message["content"] == "<think>x</think>abc" and "reasoning" not in message  # not split


def test_the_json_grammar_after_thinking_checks_the_answer(accepts) -> None:
    from kvb_server.tool_calls.grammar import json_after_thinking

    schema = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    free = json_after_thinking(schema, ReasoningPlan(QWEN3, False))
    assert accepts(free, '<think>hm</think>\n{"a":1}') and accepts(free, '{"a":1}')
    assert not accepts(free, '<think>hm</think>{"a":"x"}') and not accepts(free, "<think>hm</think>no")
    opened = json_after_thinking(schema, ReasoningPlan(QWEN3, True))
    assert accepts(opened, 'hm</think>{"a":1}') and not accepts(opened, '{"a":1}')


def test_the_real_engine_decodes_under_the_thinking_grammars() -> None:
    """The tiny random Llama behind KVBoost (llguidance over its real tokenizer, not the fake's script):
    a template that opens the block, with tools and with a JSON schema, decodes without error, and
    whatever it wrote before the end tag is reasoning, never content."""
    from conftest import build_tiny_engine

    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n<think>\n"
    )
    engine = build_tiny_engine(context=2048)  # room for the tools' system prompt
    config = ServerConfig(model_names=(MODEL,), reasoning_parser="qwen3", chat_template=template)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with serve(create_app(engine, config)) as url:
        for extra in (
            {"tools": [WEATHER], "tool_choice": "required"},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            {},
        ):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 12,
                **extra,
            }
            got = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert got.status_code == 200, got.text
            message = got.json()["choices"][0]["message"]
            assert message["reasoning"] is None or isinstance(message["reasoning"], str)
            if extra:  # under a grammar: the answer part is the structure alone, never thinking text
                assert message["content"] is None or message["content"].startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_leaves_the_thinking_out(stream: bool) -> None:
    """vLLM's per-request ``include_reasoning: false``: the answer alone (it was an unknown field, a 400)."""
    _, app = _app("<think>secret steps</think>Four.")
    with serve(app) as url:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "2+2?"}],
            "include_reasoning": False,
            "stream": stream,
        }
        got = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert got.status_code == 200 and "secret" not in got.text and "reasoning" not in got.text
        if not stream:
            assert got.json()["choices"][0]["message"]["content"] == "Four."
        else:
            pieces = [line[6:] for line in got.text.splitlines() if line.startswith("data: {")]
            text = "".join(
                (json.loads(p)["choices"][0]["delta"].get("content") or "")
                for p in pieces
                if json.loads(p)["choices"]
            )
            assert text == "Four."


def test_responses_logprobs_with_a_reasoning_parser_are_refused_by_name() -> None:
    """The message's logprobs cannot be told apart from the thinking's here: a 400 naming the option, rather
    than a message whose logprobs spell its thinking too."""
    _, app = _app("<think>2 + 2 is 4.</think>\n\nFour.")
    with serve(app) as url:
        for ask, param in (
            ({"include": ["message.output_text.logprobs"]}, "include"),
            ({"top_logprobs": 1}, "top_logprobs"),
        ):
            got = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "2+2?", **ask})
            assert (got.status_code, got.json()["error"]["param"]) == (400, param)
        plain = httpx.post(
            f"{url}/v1/responses",
            json={"model": MODEL, "input": "2+2?", "include": ["reasoning.encrypted_content"]},
        )
        assert plain.status_code == 200 and plain.json()["output"][0]["encrypted_content"] is None


def test_a_generation_prompt_that_closed_the_block_leaves_nothing_to_split() -> None:
    """Qwen3 with ``enable_thinking: false`` renders ``<think>\\n\\n</think>\\n\\n`` as the generation prompt:
    the reply is the answer, so the tools' grammar holds it from its first token (it admitted a new thinking
    block, and a forced tool_choice ended with thinking and no call: an audit, 2026-12-01)."""
    fake, app = _app(CALL)
    fake.generation_prompt = "<assistant><think>\n\n</think>\n\n"
    fake.context_length = 4000  # the tools' system prompt
    with serve(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Paris?"}]
        choice = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required"
        ).choices[0]
        assert choice.message.tool_calls[0].function.arguments == '{"city":"Paris"}'
        assert "reasoning" not in (choice.message.model_extra or {})
        grammar = fake.added[-1].params.response_format.source
        assert "THINK" not in grammar
        fake.reply = "Four."
        message = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
        assert message.content == "Four." and "reasoning" not in (message.model_extra or {})
