"""kvb_server.tool_calls without a model: syntax detection, grammars, parsing, streaming, prompt rendering."""

from __future__ import annotations

import json
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest
from conftest import build_tokenizer

from kvb_server.errors import InvalidParameterError
from kvb_server.responses import assistant_message, cut_short
from kvb_server.schemas.generation_requests import ChatMessage
from kvb_server.tool_calls import (
    ToolCallStream,
    detect,
    scan_calls,
    split_reply,
    template_messages,
    tool_grammar,
    tool_plan,
)
from kvb_server.tool_calls.grammar import call_schema
from kvb_server.tool_calls.syntax import LLAMA3_JSON, MISTRAL, hermes

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Pa\\"ris}","unit":"c"}}\n</tool_call>'


def tokenizer_with(template: str) -> SimpleNamespace:
    return SimpleNamespace(chat_template=template)


@pytest.mark.parametrize(
    ("template", "name", "native"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes", False),
        (
            "{% if tools %}<tools>{{ tools | tojson }}</tools> use <tool_call></tool_call>{% endif %}",
            "hermes",
            True,
        ),
        (
            "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
            "mistral",
            True,
        ),
        (
            '{% if tools %}Environment: ipython {"name": ..., "parameters": ...}{% endif %}',
            "llama3_json",
            True,
        ),
        ("{% if tools %}<|tool_call|>{{ tools }}{% endif %}", "hermes", False),  # unknown format: our prompt
    ],
)
def test_detect_reads_the_templates_own_format(template: str, name: str, native: bool) -> None:
    syntax = detect(tokenizer_with(template))
    assert (syntax.name, syntax.native) == (name, native)


def test_scan_reads_partial_and_complete_calls() -> None:
    syntax = hermes(native=False)
    two = f"{CALL}\n{CALL.replace('get_weather', 'get_time').replace('Pa', 'Ro')}"
    seen = []
    for end in range(len(two) + 1):
        calls, state = scan_calls(two[:end], syntax)
        assert state in ("partial", "done"), two[:end]
        seen.append([(c.name, c.arguments) for c in calls])
        for call in calls:  # every partial argument text is a prefix of the final one
            assert ('{"city":"Pa\\"ris}","unit":"c"}' + "}").startswith(
                call.arguments
            ) or call.name == "get_time"
    assert state == "done"
    assert seen[-1] == [
        ("get_weather", '{"city":"Pa\\"ris}","unit":"c"}'),
        ("get_time", '{"city":"Ro\\"ris}","unit":"c"}'),
    ]
    assert scan_calls("hello", syntax)[1] == "bad"


@pytest.mark.parametrize(
    ("syntax", "text"),
    [
        (LLAMA3_JSON, '{"name":"f","parameters":{"x":[1,{"y":"}"}]}}'),
        (MISTRAL, '[{"name":"f","arguments":{"x":[1,{"y":"}"}]}}, {"name":"g","arguments":{}}]'),
        (MISTRAL, '[TOOL_CALLS][{"name":"f","arguments":{"x":[1,{"y":"}"}]}}]'),
    ],
)
def test_split_reply_in_each_syntax(syntax, text: str) -> None:
    reply = split_reply(text, syntax)
    assert reply.content is None
    assert reply.calls[0].name == "f" and json.loads(reply.calls[0].arguments) == {"x": [1, {"y": "}"}]}


def test_split_reply_keeps_text_and_cut_calls_as_text_unless_truncated() -> None:
    syntax = hermes(native=False)
    assert split_reply("The weather is fine.", syntax).content == "The weather is fine."
    cut = CALL + "\n<tool_call>\n{" + '"name":"get_weather","argu'
    assert split_reply(cut, syntax).calls == ()
    assert [c.name for c in split_reply(cut, syntax, truncated=True).calls] == ["get_weather"]


@pytest.mark.parametrize(
    ("choice", "finish"),
    [
        ("required", "tool_calls"),
        ("auto", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ],
)
def test_a_call_finishes_tool_calls_unless_tool_choice_named_it(choice, finish: str) -> None:
    """OpenAI and vLLM: "tool_calls" when the model chose to call tools, "stop" when tool_choice forced the
    named function; a cut reply stays "length" either way."""
    plan = tool_plan([WEATHER, TIME], choice, None, hermes(native=False))
    message, reason = assistant_message(plan, CALL, "stop")
    assert reason == finish and message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert assistant_message(plan, CALL + "<tool_call>", "length")[1] == "length"


@pytest.mark.parametrize(
    ("cut", "auto_text"), [(len(CALL) - 30, True), (len(CALL) - 14, True), (len(CALL) - 3, False)]
)
def test_a_forced_call_cut_by_max_tokens_stays_a_call_as_streamed(cut: int, auto_text: bool) -> None:
    """With tool_choice "required" a reply cut inside its call returned the call syntax as ``content`` (the
    stream had sent a tool call): it is the call with the arguments written so far, finish ``length``.
    Under "auto" a first call cut inside its arguments is still text (the model might not have been
    calling); one whose arguments are whole counts, as before."""
    text = CALL[:cut]
    forced = tool_plan([WEATHER, TIME], "required", None, hermes(native=False))
    message, finish = assistant_message(forced, text, "length")
    assert finish == "length" and message["content"] is None
    [call] = message["tool_calls"]
    streamed = [d["tool_calls"][0] for d in stream_all(ToolCallStream(forced), text, 5)]
    assert call["function"]["name"] == "get_weather" == streamed[0]["function"]["name"]
    assert call["function"]["arguments"] == "".join(d["function"]["arguments"] for d in streamed)
    auto = tool_plan([WEATHER, TIME], "auto", None, hermes(native=False))
    assert (assistant_message(auto, text, "length")[0]["content"] == text) is auto_text


def stream_all(stream: ToolCallStream, text: str, step: int) -> list[dict]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.push(text[i : i + step])
    return deltas + stream.finish()


@pytest.mark.parametrize("step", [1, 3, 50])
def test_stream_sends_a_header_then_argument_pieces(step: int) -> None:
    plan = tool_plan([WEATHER, TIME], "required", None, hermes(native=False))
    text = f"{CALL}{CALL.replace('get_weather', 'get_time')}"
    deltas = stream_all(ToolCallStream(plan), text, step)
    assert all(set(d) == {"tool_calls"} and len(d["tool_calls"]) == 1 for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        piece = d["tool_calls"][0]
        if "id" in piece:  # OpenAI's first delta of a call: id, type, name and empty arguments
            assert piece["index"] not in calls and piece["type"] == "function"
            assert piece["function"]["arguments"] == ""
            calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
        else:
            assert set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"city": 'Pa"ris}', "unit": "c"}] * 2


def test_auto_stream_holds_a_possible_call_start_then_sends_text() -> None:
    plan = tool_plan([WEATHER], "auto", None, hermes(native=False))
    stream = ToolCallStream(plan)
    assert stream.push("<tool") == []  # could still become a call
    assert stream.push("box> is a tag") == [{"content": "<toolbox> is a tag"}]
    assert stream.push("!") == [{"content": "!"}]
    held = ToolCallStream(plan)
    assert held.push(" <tool_") == []
    assert held.finish() == [{"content": " <tool_"}]  # the reply ended: it was text


def test_stream_cut_before_a_call_name_ends_with_the_text_the_non_streamed_reply_returns() -> None:
    """Under "auto" a stop string or max_tokens cut the reply inside ``<tool_call>``: the non-streamed
    message is that text, so the stream must send it as content before its finish chunk, not drop it."""
    plan = tool_plan([WEATHER], "auto", None, hermes(native=False))
    for cut in ("<tool_call>", "<tool_call>\n{", '<tool_call>\n{"name":"get_wea'):
        for truncated in (False, True):
            stream = ToolCallStream(plan)
            deltas = stream.deltas(cut[:4], final=False) + stream.deltas(
                cut[4:], final=True, truncated=truncated
            )
            assert deltas == [{"role": "assistant", "content": cut}], cut
            assert split_reply(cut, plan.syntax, truncated=truncated).content == cut


@pytest.mark.parametrize(
    ("tools", "choice", "cut", "name"),
    [
        ([WEATHER], "required", "<tool_", "get_weather"),  # one callable tool: the call is known
        ([WEATHER], "required", "<tool_call>\n{", "get_weather"),
        ([WEATHER, TIME], "required", '<tool_call>\n{"name":"get_', None),  # either tool: no call yet
        ([WEATHER, TIME], "required", '<tool_call>\n{"name":"get_t', "get_time"),  # only one name fits
        ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, "<tool_call>", "get_time"),
        ([WEATHER], "required", "   ", None),  # nothing written
        # The name whole, its arguments not begun: that tool (it was dropped with two tools, a review).
        ([WEATHER, TIME], "required", '<tool_call>\n{"name":"get_weather"', "get_weather"),
        ([WEATHER, TIME], "required", '<tool_call>\n{"name":"get_time","', "get_time"),
    ],
)
def test_a_forced_call_cut_before_its_name_is_that_call_or_nothing(tools, choice, cut: str, name) -> None:
    """tool_choice forced calls and max_tokens ended the reply before the call's name was whole: the call
    syntax came back as ``content`` (an audit with openai-node and the AI SDK, 2026-11-30: agents showed
    ``<tool_call>\n{"name`` as the answer; the AI SDK raised ToolChoiceViolation). It is the one call the
    callable tools' names leave possible, with no arguments yet, else no content and no call; streamed
    the same."""
    plan = tool_plan(tools, choice, None, hermes(native=False))
    message, finish = assistant_message(plan, cut, "length")
    assert finish == "length" and message["content"] is None
    assert [c["function"] for c in message.get("tool_calls", [])] == (
        [{"name": name, "arguments": ""}] if name else []
    )
    stream = ToolCallStream(plan)
    deltas = stream.deltas(cut[:3], final=False) + stream.deltas(cut[3:], final=True, truncated=True)
    assert all(not d.get("content") for d in deltas)
    streamed = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed == ([{"name": name, "arguments": ""}] if name else [])
    # A stop string cut it instead: the same reading (under a forced choice nothing but calls can be written),
    # finish "stop" (it was a text before, while the stream sent the call: an audit, 2026-12-01).
    message, finish = assistant_message(plan, cut, "stop")
    assert finish == "stop" and message["content"] is None
    assert [c["function"] for c in message.get("tool_calls", [])] == (
        [{"name": name, "arguments": ""}] if name else []
    )


@pytest.mark.parametrize("finish", ["stop", "length"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_a_stop_string_cut_is_the_partial_call_streamed_or_not(choice, finish: str) -> None:
    """``stop: ["city"]`` fired inside a forced call's arguments: the non-streamed reply was the call markup as
    ``content`` while the stream had sent the call (an audit, 2026-12-01). Both are now the partial call, and
    the finish reason says what cut it."""
    plan = tool_plan([WEATHER], choice, None, hermes(native=False))
    cut = '<tool_call>\n{"name":"get_weather","arguments":{"'
    message, reason = assistant_message(plan, cut, finish)
    assert reason == finish and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"'}]
    stream = ToolCallStream(plan)
    truncated = cut_short(plan, finish)
    deltas = stream.deltas(cut[:20], final=False) + stream.deltas(cut[20:], final=True, truncated=truncated)
    assert all(not d.get("content") for d in deltas)
    streamed = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert streamed[0]["name"] == "get_weather" and "".join(f.get("arguments", "") for f in streamed) == '{"'
    # A whole forced call that ended the reply (its grammar done) still finishes as before.
    whole = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert assistant_message(plan, whole, "stop")[1] == ("tool_calls" if choice == "required" else "stop")


def test_stream_cut_inside_a_calls_arguments_keeps_the_partial_call() -> None:
    """Once a call's header was sent it cannot be taken back: the stream ends with the partial call (as
    vLLM's does), while the non-streamed reply, cut inside its first call, is text (docs/tools.md)."""
    plan = tool_plan([WEATHER], "required", None, hermes(native=False))
    cut = '<tool_call>\n{"name":"get_weather","arguments":{"city'
    deltas = ToolCallStream(plan).deltas(cut, final=True)
    assert all("content" not in d or d["content"] is None for d in deltas)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[-1]["tool_calls"][0]["function"] == {"arguments": '{"city'}


@pytest.fixture(scope="module")
def ll_tokenizer():
    return build_tokenizer(), llguidance.hf.from_tokenizer(build_tokenizer())


def accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    tokenizer, ll = ll_tokenizer
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def test_required_grammar_admits_exactly_valid_calls(ll_tokenizer) -> None:
    plan = tool_plan([WEATHER, TIME], "required", None, hermes(native=False))
    grammar = tool_grammar(plan)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar)) == ""
    assert accepts(ll_tokenizer, grammar, CALL)
    assert accepts(ll_tokenizer, grammar, CALL + CALL)  # no newline between calls with our system prompt
    assert not accepts(ll_tokenizer, grammar, CALL + "\n" + CALL)
    native = tool_grammar(tool_plan([WEATHER, TIME], "required", None, hermes(native=True)))
    assert accepts(ll_tokenizer, native, CALL + "\n" + CALL)  # Qwen-style templates write one
    assert not accepts(ll_tokenizer, grammar, "Sure!")
    assert not accepts(ll_tokenizer, grammar, CALL.replace('"unit":"c"', '"unit":"k"'))  # not in the enum
    assert not accepts(ll_tokenizer, grammar, CALL.replace("get_weather", "get_wether"))  # unknown tool
    assert not accepts(ll_tokenizer, grammar, CALL.replace('"city"', '"town"'))
    assert not accepts(ll_tokenizer, grammar, CALL * 9)  # MAX_PARALLEL_CALLS
    single = tool_grammar(tool_plan([WEATHER, TIME], "required", False, hermes(native=False)))
    assert not accepts(ll_tokenizer, single, CALL + CALL)
    named = tool_plan(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None, hermes(native=False)
    )
    assert accepts(
        ll_tokenizer, tool_grammar(named), '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    )
    assert not accepts(ll_tokenizer, tool_grammar(named), CALL)


def test_auto_grammar_admits_text_or_calls(ll_tokenizer) -> None:
    plan = tool_plan([WEATHER], "auto", None, hermes(native=False))
    grammar = tool_grammar(plan)
    assert accepts(ll_tokenizer, grammar, "It is sunny.")
    assert accepts(ll_tokenizer, grammar, CALL)
    assert not accepts(ll_tokenizer, grammar, "<tool_call>\nnot json")
    with_schema = tool_grammar(plan, text_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(ll_tokenizer, with_schema, '{"a":1}')
    assert not accepts(ll_tokenizer, with_schema, "It is sunny.")


@pytest.mark.parametrize("syntax", [LLAMA3_JSON, MISTRAL])
def test_native_syntax_grammars_compile(ll_tokenizer, syntax) -> None:
    plan = tool_plan([WEATHER], "required", None, syntax)
    arguments = json.dumps(
        {"name": "get_weather", syntax.args_key: {"city": "x", "unit": "f"}}, separators=(",", ":")
    )
    text = arguments
    if syntax.bracket:
        text = f"[TOOL_CALLS][{text}]"
    assert accepts(ll_tokenizer, tool_grammar(plan), text)
    assert split_reply(text, syntax).calls[0].name == "get_weather"


def messages(*raw: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


HISTORY = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
)


def test_history_for_a_template_without_tools_is_text() -> None:
    syntax = hermes(native=False)
    plan = tool_plan([WEATHER], None, None, syntax)
    out = template_messages(messages(*HISTORY), syntax, plan)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert (
        out[2]["content"] == '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\n21 C\n</tool_response>"
    # The system prompt only changes when tools are declared (same prefix for every call of a loop).
    assert template_messages(messages(*HISTORY), syntax, None)[0]["content"] == "Be brief."


def test_history_for_a_native_template_uses_hugging_face_shapes() -> None:
    out = template_messages(messages(*HISTORY), hermes(native=True), None)
    assert out[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert out[3] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1", "name": "get_weather"}


def test_bad_tool_definitions_name_the_parameter() -> None:
    syntax = hermes(native=False)
    for tools, choice, param in [
        ([{"type": "function"}], None, "tools[0].function"),
        (
            [{"type": "function", "function": {"name": "x", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
        ([WEATHER, WEATHER], None, "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        # The Responses API's shape on chat: it read "no function named None".
        ([WEATHER], {"type": "function", "name": "get_weather"}, "tool_choice.function"),
        (None, "auto", "tool_choice"),
        ([WEATHER], {"type": "allowed_tools"}, "tool_choice.allowed_tools"),
        (
            [WEATHER],
            {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}},
            "tool_choice.allowed_tools",
        ),
        (
            [WEATHER],
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
            "tool_choice.allowed_tools.tools",
        ),
        (
            [WEATHER],
            {
                "type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "x"}}]},
            },
            "tool_choice.allowed_tools.tools[0].function.name",
        ),
        (
            [WEATHER],
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["get_weather"]}},
            "tool_choice.allowed_tools.tools[0]",
        ),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            tool_plan(tools, choice, None, syntax)
        assert info.value.param == param
    assert tool_plan(None, "none", None, syntax) is None


@pytest.mark.parametrize(("mode", "plan_mode"), [("auto", "auto"), ("required", "calls")])
def test_allowed_tools_restricts_the_calls_to_a_subset_of_the_declared_tools(
    mode: str, plan_mode: str
) -> None:
    """OpenAI's ``allowed_tools`` (pydantic-ai sends it to restrict a run to some tools while keeping every
    tool declared, so the prompt and its cached prefix stay the same): it was a 400."""
    syntax = hermes(native=False)
    for entry in (
        {"type": "function", "function": {"name": "get_time"}},
        {"type": "function", "name": "get_time"},
    ):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [entry]}}
        plan = tool_plan([WEATHER, TIME], choice, None, syntax)
        assert plan.mode == plan_mode and [t.name for t in plan.tools] == ["get_weather", "get_time"]
        assert [t.name for t in plan.callable] == ["get_time"] and not plan.named and plan.max_calls > 1
        schema = call_schema(plan)
        assert schema["properties"]["name"] == {"const": "get_time"}  # the grammar offers only the subset


def test_refs_under_properties_named_like_data_keywords_are_rebased() -> None:
    # A pydantic argument called "examples" (or "default") with a $ref to its model: the property map was
    # copied as if it were the examples keyword's data, its $ref kept pointing at the root, and the valid
    # tool was refused ("Pointer '/$defs/Example' does not exist").
    from kvb_server.tool_calls.grammar import rebase_refs

    parameters = {
        "$defs": {"Example": {"type": "object", "properties": {"q": {"type": "string"}}}},
        "type": "object",
        "properties": {
            "examples": {"type": "array", "items": {"$ref": "#/$defs/Example"}},
            "default": {"$ref": "#/$defs/Example", "default": {"$ref": "#/not/a/reference"}},
        },
    }
    out = rebase_refs(parameters, "/properties/arguments")
    assert out["properties"]["examples"]["items"]["$ref"] == "#/properties/arguments/$defs/Example"
    assert out["properties"]["default"]["$ref"] == "#/properties/arguments/$defs/Example"
    assert out["properties"]["default"]["default"] == {"$ref": "#/not/a/reference"}  # data stays data
