"""vLLM's ``structural_tag`` response format: free text, and after a trigger a tagged segment whose JSON
must match its structure's schema (SmolLM2's tokenizer; a tiny random Llama for generation)."""

from __future__ import annotations

import pathlib

import pytest
import transformers as T

from kvb_cache import InvalidRequestError
from kvb_cache.structured import GrammarCache, ResponseFormat
from kvb_cache.structured import structural_tag as st
from kvb_cache.structured.backend import llguidance_schema

pytest.importorskip("llguidance", reason='needs the structured extra: pip install "kvb-cache[structured]"')
jsonschema = pytest.importorskip("jsonschema")

SMOLLM2 = pathlib.Path.home() / ".cache" / "kvboost" / "smollm2-135m-instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
DIGIT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"],
}
WEATHER = {
    "type": "structural_tag",
    "structures": [
        {"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"},
        {"begin": "<function=noop>", "schema": True, "end": "</function>"},
    ],
    "triggers": ["<function="],
}


@pytest.fixture(scope="module")
def tokenizer() -> T.PreTrainedTokenizerFast:
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"needs the embedded SmolLM2 tokenizer in {SMOLLM2}")
    return T.AutoTokenizer.from_pretrained(SMOLLM2)


def accepted(fmt: ResponseFormat, tokenizer, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens, and is then complete."""
    matcher = GrammarCache().state(fmt, tokenizer, len(tokenizer))._matcher
    ids = tokenizer.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) != len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.is_accepting()


def test_free_text_and_segments_that_match_their_schemas_are_accepted(tokenizer):
    fmt = ResponseFormat.parse(WEATHER)
    assert fmt.kind == "structural_tag"
    for text in (
        "no call at all",
        "",
        'Sure. <function=get_weather>{"city":"Paris"}</function> and <function=noop>[1,2]</function>!',
        'first <function=get_weather>{"city":"Rome"}</function>',
    ):
        assert accepted(fmt, tokenizer, text), text
    for text in (
        'x <function=get_weather>{"city":"Paris","extra":1}</function>',  # objects are closed (strict)
        'x <function=get_weather>{"town":"Paris"}</function>',  # required key missing
        "x <function=elsewhere>{}</function>",  # a trigger starts no other structure
        'x <function=get_weather>{"city":"Paris"} done',  # the end tag is required
        'x <function=get_weather>{"city": "Paris"}</function>',  # compact JSON, as every schema here
    ):
        assert not accepted(fmt, tokenizer, text), text


def test_structures_group_by_their_trigger(tokenizer):
    fmt = ResponseFormat.parse(
        {
            "type": "structural_tag",
            "structures": [
                {"begin": "<tool>a", "schema": DIGIT, "end": "</tool>"},
                {"begin": "<tool>b", "schema": CITY, "end": "</tool>"},
                {"begin": "[[x]]", "schema": DIGIT, "end": ""},
            ],
            "triggers": ["<tool>", "[[", "<tool>", "unused"],
        }
    )
    grammar = st.lark(fmt.source, llguidance_schema)
    assert grammar.count("seg_0_open[lazy]") == 1 and "unused" not in grammar
    assert accepted(
        fmt, tokenizer, 'p <tool>a{"x":3}</tool> q <tool>b{"city":"Oslo"}</tool> [[x]]{"x":1} end'
    )
    assert not accepted(fmt, tokenizer, 'p <tool>b{"x":3}</tool>')


def test_tags_held_as_one_added_token_are_written_by_id(tokenizer):
    """SmolLM2 holds <repo_name> and <file_sep> as added tokens: the model emits them as one token each,
    which a text literal in the grammar never matches."""
    fmt = ResponseFormat.parse(
        {
            "type": "structural_tag",
            "structures": [{"begin": "<repo_name>call", "schema": CITY, "end": "<file_sep>"}],
            "triggers": ["<repo_name>"],
        }
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<repo_name>", "<file_sep>")}
    assert st.lark(fmt.source, llguidance_schema, ids).count("<[") == 2
    text = 'hi <repo_name>call{"city":"Rome"}<file_sep> bye'
    assert tokenizer.convert_tokens_to_ids("<repo_name>") in tokenizer.encode(text, add_special_tokens=False)
    assert accepted(fmt, tokenizer, text)
    assert not accepted(fmt, tokenizer, 'hi <repo_name>call{"city":"Rome"} bye')


def test_an_end_that_is_the_end_of_sequence_token_is_refused(tokenizer):
    fmt = ResponseFormat.parse(
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": CITY, "end": tokenizer.eos_token}],
            "triggers": ["<f>"],
        }
    )
    with pytest.raises(InvalidRequestError, match="end-of-sequence") as info:
        GrammarCache().state(fmt, tokenizer, len(tokenizer))
    assert info.value.param == "response_format"


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": CITY, "end": "</f>"}]},
        {"type": "structural_tag", "structures": [], "triggers": ["<f"]},
        {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": CITY}], "triggers": [""]},
        {"type": "structural_tag", "structures": [{"begin": "<g>", "schema": CITY}], "triggers": ["<f"]},
        {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": False}], "triggers": ["<f"]},
        {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": [1]}], "triggers": ["<f"]},
        {"type": "structural_tag", "structures": [{"begin": "<f>", "end": 3}], "triggers": ["<f"]},
        {"type": "structural_tag", "structures": [{"begin": "<f>", "scheme": {}}], "triggers": ["<f"]},
        {"type": "structural_tag", "structures": ["<f>"], "triggers": ["<f"]},
        {"type": "structural_tag", "format": {"type": "any_text"}},  # xgrammar's newer form: not taken
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}],
            "triggers": ["<f"],
        },
    ],
)
def test_bad_structural_tags_name_the_param(tokenizer, fmt):
    with pytest.raises(InvalidRequestError) as info:
        GrammarCache().state(ResponseFormat.parse(fmt), tokenizer, len(tokenizer))
    assert info.value.param == "response_format"


def test_a_deeply_nested_segment_schema_is_refused_before_compiling():
    schema: dict = {"type": "integer"}
    for _ in range(400):
        schema = {"type": "array", "items": schema}
    fmt = ResponseFormat.parse(
        {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": schema}], "triggers": ["<f>"]}
    )
    from kvb_cache.structured import check_grammar

    with pytest.raises(InvalidRequestError, match="nests"):
        check_grammar(fmt)


def test_triggers_that_are_prefixes_of_each_other_reach_every_structure(tokenizer):
    """Free text ends at the first trigger completed: structures are filed under the shortest trigger their
    begin starts with (under the longest, ``<func=a>`` was refused at its first token)."""
    fmt = ResponseFormat.parse(
        {
            "type": "structural_tag",
            "structures": [
                {"begin": "<fx>", "schema": DIGIT, "end": "</f>"},
                {"begin": "<func=a>", "schema": CITY, "end": "</func>"},
            ],
            "triggers": ["<func", "<f"],
        }
    )
    assert accepted(fmt, tokenizer, 'x <func=a>{"city":"Oslo"}</func> y <fx>{"x":2}</f> z')
    assert not accepted(fmt, tokenizer, 'x <func=b>{"city":"Oslo"}</func>')
    assert not accepted(fmt, tokenizer, 'x <fx>{"city":"Oslo"}</f>')
