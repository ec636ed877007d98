"""vLLM's guided decoding fields (``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``)
and ``structured_outputs`` on a tiny random Llama (real engine, real grammar): a random model writes
nonsense, so each test checks the guaranteed shape, and that a vLLM field gives exactly what the equivalent
``response_format`` gives."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import build_tiny_engine, serve

from kvb_server import ServerConfig, create_app

MODEL = "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["unit", "n"],
}
CHOICES = ["yes", 'no "really"', "maybe\nlater"]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    engine = build_tiny_engine(context=1024)
    with serve(create_app(engine, ServerConfig(model_names=(MODEL,), max_tokens=64))) as base:
        yield base


@pytest.fixture()
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _chat(client: openai.OpenAI, **extra) -> str:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "go"}],
        temperature=0,
        max_tokens=60,
        extra_body=extra,
    )
    return resp.choices[0].message.content


def test_guided_json_equals_response_format(client: openai.OpenAI) -> None:
    want = _chat(
        client, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    )
    data = json.loads(want)
    assert data["unit"] in ("celsius", "fahrenheit") and 0 <= data["n"] <= 9
    assert _chat(client, guided_json=SCHEMA) == want
    assert _chat(client, guided_json=json.dumps(SCHEMA)) == want  # vLLM also takes the schema as JSON text
    assert _chat(client, structured_outputs={"json": SCHEMA}) == want


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_guided_choice_returns_one_of_the_choices(client: openai.OpenAI, seed: int) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt="answer:",
        temperature=1.0,
        seed=seed,
        max_tokens=30,
        extra_body={"guided_choice": CHOICES},
    )
    assert resp.choices[0].text in CHOICES and resp.choices[0].finish_reason == "stop"
    again = client.completions.create(
        model=MODEL,
        prompt="answer:",
        temperature=1.0,
        seed=seed,
        max_tokens=30,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    assert again.choices[0].text == resp.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_thousands_of_choices_and_regex_characters_are_followed(client: openai.OpenAI, stream: bool) -> None:
    """Each choice was one Earley item, and llguidance caps a row at 2000: 2000+ choices passed the up-front
    check, then failed at the first decoding step (a 400 after admission, an error event inside a 200
    stream). Choices holding regex and Lark syntax stay literal."""
    odd = ["a.b", "a|b", "(x)", "x/y", "^$", "[z]", "back\\slash", "caf\u00e9 \U0001f389", "*"]
    choices = odd + [f"option {i:05d}" for i in range(3000)]
    for seed in (1, 2):
        made = client.completions.create(
            model=MODEL,
            prompt="answer:",
            temperature=1.0,
            seed=seed,
            max_tokens=30,
            stream=stream,
            extra_body={"guided_choice": choices},
        )
        text = "".join(c.choices[0].text for c in made) if stream else made.choices[0].text
        assert text in choices, text
    for choice in odd:  # a choice alone is always that choice, whatever it holds
        made = client.completions.create(
            model=MODEL,
            prompt="answer:",
            temperature=1.0,
            seed=3,
            max_tokens=30,
            extra_body={"guided_choice": [choice]},
        )
        assert made.choices[0].text == choice


def test_guided_regex_and_grammar(client: openai.OpenAI) -> None:
    text = (
        client.completions.create(
            model=MODEL,
            prompt="code:",
            temperature=0,
            max_tokens=20,
            extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"},
        )
        .choices[0]
        .text
    )
    assert len(text) == 6 and text[:3].isupper() and text[3] == "-" and text[4:].isdigit()
    grammar = 'start: "ok" | "fail " CODE\nCODE: /[0-9]{1,2}/'
    text = _chat(client, guided_grammar=grammar)
    assert text == "ok" or (text.startswith("fail ") and text[5:].isdigit() and len(text) <= 7), text
    assert _chat(client, structured_outputs={"json_object": True}).startswith("{")
    # vLLM's options that change nothing here (compact JSON, no fallback backend): a 400 before.
    options = {
        "disable_any_whitespace": False,
        "disable_fallback": True,
        "disable_additional_properties": False,
    }
    assert _chat(client, structured_outputs={"json": SCHEMA, **options}) == _chat(
        client, structured_outputs={"json": SCHEMA}
    )


#: vLLM's structural tag: free text, and after "<" a segment "<n>" + JSON matching SCHEMA + "</n>".
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<n>", "schema": SCHEMA, "end": "</n>"}],
    "triggers": ["<"],
}


def test_structural_tag_as_response_format_and_as_vllm_structured_outputs(client: openai.OpenAI) -> None:
    from conftest import build_tokenizer

    (lt,) = build_tokenizer().encode("<")  # pushed up, so the random model opens segments
    segments = 0
    for seed in range(3):
        extra = {"temperature": 1.0, "seed": seed, "logit_bias": {str(lt): 6}}
        text = _chat(client, response_format=TAG, **extra)
        # vLLM's spelling: structured_outputs.structural_tag, a JSON string (an object is taken too).
        assert _chat(client, structured_outputs={"structural_tag": json.dumps(TAG)}, **extra) == text
        assert _chat(client, structured_outputs={"structural_tag": TAG}, **extra) == text
        pos = 0
        while (i := text.find("<", pos)) >= 0:  # every "<" outside a segment opens one
            close = text.find("</n>", i)
            if close < 0:  # only the last one may be cut by max_tokens
                assert text[i:].startswith("<n>") or "<n>".startswith(text[i:]), text
                break
            assert text[i:].startswith("<n>"), text
            value = json.loads(text[i + 3 : close])
            assert value["unit"] in ("celsius", "fahrenheit") and 0 <= value["n"] <= 9, text
            segments, pos = segments + 1, close + 4
    assert segments >= 1, "the biased model never opened a segment: nothing was checked"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: @@@"}, "guided_grammar"),
        ({"structured_outputs": {"choise": ["a"]}}, "structured_outputs.choise"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs.choice"),
        (
            {"structured_outputs": {"regex": "a+", "disable_fallback": "yes"}},
            "structured_outputs.disable_fallback",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " ?"}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"structural_tag": {**TAG, "type": "json"}}},
            "structured_outputs.structural_tag.type",
        ),
        ({"response_format": {**TAG, "triggers": ["["]}}, "response_format"),
        ({"response_format": {**TAG, "format": {}}}, "response_format.format"),
    ],
)
def test_bad_guided_requests_are_400s_naming_the_field(url: str, extra: dict, param: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **extra}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


#: Compiles, but past llguidance's limits at the first token (an Earley row of 3001 items; max 2000).
TOO_WIDE = {"type": "grammar", "grammar": "start: " + " | ".join(f'"choice{i}"' for i in range(3000))}


def test_a_grammar_that_fails_while_decoding_is_a_400_not_a_stop(client: openai.OpenAI) -> None:
    """The engine ended such a choice as ``finish_reason: "stop"`` with text matching none of the
    alternatives (``"choice"``): a silently wrong answer. Non-streamed it is a 400 naming the format."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="go", max_tokens=8, temperature=0, extra_body={"response_format": TOO_WIDE}
        )
    assert info.value.param == "response_format" and "could not be followed" in info.value.message
    # Sent as vLLM's field, the 400 names that field (it named response_format, which was never sent).
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL,
            prompt="go",
            max_tokens=8,
            temperature=0,
            extra_body={"guided_grammar": TOO_WIDE["grammar"]},
        )
    assert info.value.param == "guided_grammar" and "guided_grammar grammar could not" in info.value.message
    # A regex no text matches: said so (llguidance's "NoExtensionBias" alone told a client nothing).
    with pytest.raises(openai.BadRequestError, match="admits no output"):
        client.completions.create(
            model=MODEL,
            prompt="go",
            max_tokens=4,
            extra_body={"response_format": {"type": "regex", "pattern": "[^\\s\\S]"}},
        )


def test_a_grammar_that_fails_while_decoding_ends_its_stream_with_the_error(url: str) -> None:
    """Streamed, the text already sent stays sent; the error replaces the "stop" finish chunk, then [DONE]."""
    body = {"model": MODEL, "prompt": "go", "max_tokens": 8, "response_format": TOO_WIDE, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["param"] == "response_format"
    finishes = [c["finish_reason"] for e in events[:-2] for c in json.loads(e)["choices"]]
    assert "stop" not in finishes
