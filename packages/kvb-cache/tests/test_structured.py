"""Structured outputs: grammar masks in the batched sampler, logit_bias, response_format errors.

A tiny random Llama whose vocabulary is SmolLM2's (the word-level test tokenizer has no JSON punctuation,
so the grammar library could not build a JSON object from it).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
import transformers as T

from kvb_cache import InvalidRequestError, KVBoost, SamplingParams
from kvb_cache.structured import GrammarCache, ResponseFormat, StructuredOutputsUnavailable

pytest.importorskip("llguidance", reason='needs the structured extra: pip install "kvb-cache[structured]"')
jsonschema = pytest.importorskip("jsonschema")

SMOLLM2 = pathlib.Path.home() / ".cache" / "kvboost" / "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def smol_tokenizer() -> T.PreTrainedTokenizerFast:
    if not (SMOLLM2 / "tokenizer.json").exists():
        pytest.skip(f"needs the embedded SmolLM2 tokenizer in {SMOLLM2}")
    return T.AutoTokenizer.from_pretrained(SMOLLM2)


@pytest.fixture(scope="module")
def engine(smol_tokenizer) -> KVBoost:
    torch.manual_seed(0)
    config = T.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(smol_tokenizer),
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=smol_tokenizer.eos_token_id,
    )
    return KVBoost(T.LlamaForCausalLM(config).eval(), smol_tokenizer)


def test_greedy_and_sampled_outputs_validate(engine):
    for kwargs in (
        {},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 4},
    ):
        result = engine.generate("A person:", response_format=PERSON, max_new_tokens=64, **kwargs)
        assert result.finish_reason == "stop", result.output_text
        jsonschema.validate(json.loads(result.output_text), PERSON)


def test_json_regex_grammar_and_pydantic_formats(engine):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: bool

    out = engine.generate("p", response_format=Point, max_new_tokens=48).output_text
    Point.model_validate_json(out)
    result = engine.generate("j", response_format="json", max_new_tokens=48)
    # A random model may write one long string value; whatever it wrote is a JSON object so far.
    assert result.output_text.startswith("{")
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.output_text), dict)
    out = engine.generate("r", response_format={"type": "regex", "pattern": r"[a-c]{3}-\d{2}"}).output_text
    assert len(out) == 6 and out[3] == "-" and set(out[:3]) <= set("abc") and out[4:].isdigit()
    lark = {"type": "grammar", "grammar": 'start: "yes" | "no"'}
    assert engine.generate("g", response_format=lark).output_text in ("yes", "no")
    gbnf = {"type": "grammar", "grammar": 'root ::= "x" [0-9] [0-9]'}
    out = engine.generate("g", response_format=gbnf).output_text
    assert out[0] == "x" and out[1:].isdigit() and len(out) == 3
    openai_shape = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    jsonschema.validate(json.loads(engine.generate("o", response_format=openai_shape).output_text), PERSON)


def test_stream_and_batch_rows(engine):
    events = list(engine.stream("A person:", response_format=PERSON, max_new_tokens=64))
    text = "".join(e.delta_text for e in events)
    assert events[-1].result.output_text == text
    jsonschema.validate(json.loads(text), PERSON)
    regex = {"type": "regex", "pattern": r"\d{4}"}
    results = engine.generate_batch(
        ["one", "two"], sampling=[{"response_format": PERSON}, {"response_format": regex}], max_new_tokens=64
    )
    jsonschema.validate(json.loads(results[0].output_text), PERSON)
    assert results[1].output_text.isdigit() and len(results[1].output_text) == 4


def test_mixed_batch_unconstrained_row_is_unchanged(engine):
    prompts = ["The weather today", "A person:"]
    alone = engine.generate(prompts[0], max_new_tokens=12, ignore_eos=True).output_ids
    alone_sampled = engine.generate(prompts[0], max_new_tokens=12, temperature=1.0, seed=7).output_ids
    for plain in ({}, {"temperature": 1.0, "seed": 7}):
        results = engine.generate_batch(
            prompts,
            sampling=[{**plain, "ignore_eos": not plain}, {"response_format": PERSON, "max_new_tokens": 64}],
            max_new_tokens=12,
        )
        assert results[0].output_ids == (alone_sampled if plain else alone)
        jsonschema.validate(json.loads(results[1].output_text), PERSON)


def test_stop_strings_still_end_constrained_output(engine):
    result = engine.generate("A person:", response_format=PERSON, stop=[","], max_new_tokens=64)
    assert result.finish_reason == "stop" and result.stop_reason == ","
    assert result.output_text.startswith('{"name":') and "," not in result.output_text


def test_logit_bias_bans_and_forces(engine):
    base = engine.generate("Hello", max_new_tokens=6, ignore_eos=True).output_ids
    banned = engine.generate(
        "Hello", max_new_tokens=6, ignore_eos=True, logit_bias={base[0]: -100}
    ).output_ids
    assert base[0] not in banned
    forced = engine.generate("Hello", max_new_tokens=4, ignore_eos=True, logit_bias={"42": 100}).output_ids
    assert forced == [42] * 4
    sampled = engine.generate(
        "Hello", max_new_tokens=4, ignore_eos=True, temperature=1.0, seed=1, logit_bias={42: 250}
    )
    assert sampled.output_ids == [42] * 4  # clamped to +100, which still dominates


def test_logit_bias_validation():
    assert SamplingParams(logit_bias={"5": 300, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({-1: 1.0}, {"x": 1.0}, {1: float("nan")}, {1: "a"}, [1, 2]):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(logit_bias=bad)
        assert info.value.param == "logit_bias"


def test_logit_bias_id_outside_vocab(engine):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate("x", logit_bias={10**7: 1.0})


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "strin"},  # unknown type
        {"type": "integer", "minimum": 5, "maximum": 1},  # unsatisfiable
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},  # unsupported keyword
        {"type": "string", "pattern": "^(?=a)a+$"},  # look-around
        {"type": "regex", "pattern": "(a"},
        {"type": "regex"},
        {"type": "grammar", "grammar": "start: undefined_rule"},
        "yaml",
        42,
        {"type": "json_schema", "json_schema": {"name": "x"}},
        # An unhashable `required` entry: a TypeError while closing the object, a 500 through the server.
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": [["a"]]},
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": [{"a": 1}]},
    ],
)
def test_bad_response_formats_name_the_param(engine, fmt):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("x", response_format=fmt, max_new_tokens=4)
    assert info.value.param == "response_format"


def test_a_tokenizer_the_grammar_library_cannot_read_is_a_request_error(monkeypatch):
    """conftest's word-level tokenizer has no decoder llguidance can map to bytes: a typed error naming
    response_format (was a bare ValueError, a 500 through the server), and the engine serves on."""
    from conftest import make_model, make_tokenizer

    engine = KVBoost(make_model("llama"), make_tokenizer())
    import llguidance.hf

    calls = []
    real = llguidance.hf.from_tokenizer

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", counted)
    for fmt in ("json", {"type": "regex", "pattern": "w[0-9]+"}):
        with pytest.raises(InvalidRequestError, match="tokenizer") as info:
            engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, response_format=fmt))
        assert info.value.param == "response_format"
    assert len(calls) == 1  # the conversion failed once; the second request is refused without it
    assert not engine.has_unfinished()
    assert len(engine.generate([5, 6, 7], max_new_tokens=2).output_ids) == 2


def test_text_format_is_unconstrained():
    assert ResponseFormat.parse({"type": "text"}) is None
    assert SamplingParams(response_format="json").response_format.kind == "json_schema"


def test_kv_cache_bits_refused(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate("x", response_format="json", kv_cache_bits=8)
    assert info.value.param == "response_format"


def test_grammar_cache_is_an_lru(smol_tokenizer):
    cache = GrammarCache(max_entries=2)
    formats = [ResponseFormat.parse({"type": "regex", "pattern": p}) for p in ("a+", "b+", "c+")]
    cache.state(formats[0], smol_tokenizer, len(smol_tokenizer))
    cache.state(formats[0], smol_tokenizer, len(smol_tokenizer))
    assert (cache.hits, cache.misses) == (1, 1)
    cache.state(formats[1], smol_tokenizer, len(smol_tokenizer))
    cache.state(formats[0], smol_tokenizer, len(smol_tokenizer))  # most recent now: b+ is evicted next
    cache.state(formats[2], smol_tokenizer, len(smol_tokenizer))
    assert len(cache) == 2
    cache.state(formats[0], smol_tokenizer, len(smol_tokenizer))
    assert cache.misses == 3
    cache.state(formats[1], smol_tokenizer, len(smol_tokenizer))
    assert cache.misses == 4
    # another logits width is another tokenizer key: compiled again
    cache.state(formats[0], smol_tokenizer, len(smol_tokenizer) + 64)
    assert cache.misses == 5


def test_a_grammar_that_fails_while_decoding_leaves_the_cache(smol_tokenizer):
    """The lexer state a grammar builds past llguidance's limits is shared with the cached grammar (about
    150 MB for this pattern): 256 distinct such patterns pinned tens of GB. A failed grammar is dropped."""
    cache = GrammarCache()
    vocab = len(smol_tokenizer)
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    kept = cache.state(ResponseFormat.parse({"type": "regex", "pattern": "a+"}), smol_tokenizer, vocab)
    failing = ResponseFormat.parse({"type": "regex", "pattern": "0((a{100}){100}){100}"})
    state = cache.state(failing, smol_tokenizer, vocab)
    assert len(cache) == 2
    for token in smol_tokenizer.encode("0") + smol_tokenizer.encode("a") * 5:
        state.fill_bitmask(row)
        state.advance(token)
        if state.failed:
            break
    assert state.failed and "too many expressions" in state.error
    assert len(cache) == 1 and not kept.failed  # the other grammar stays
    cache.state(failing, smol_tokenizer, vocab)  # compiled again for the next request
    assert cache.misses == 3


def test_missing_extra_names_it(monkeypatch, smol_tokenizer):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(StructuredOutputsUnavailable, match=r"kvb-cache\[structured\]"):
        GrammarCache().state(ResponseFormat.parse("json"), smol_tokenizer, len(smol_tokenizer))
    assert issubclass(StructuredOutputsUnavailable, ImportError)


def test_constrained_requests_bypass_the_drafter(engine):
    class Boom:
        def decode(self, model, cache, input_ids, next_logits, processor):
            raise AssertionError("a constrained request must not take the speculative path")

    speculative = KVBoost(engine.model, engine.tokenizer, drafter=Boom())
    result = speculative.generate("A person:", response_format=PERSON, max_new_tokens=64)
    jsonschema.validate(json.loads(result.output_text), PERSON)
    assert (
        result.output_ids
        == engine.generate("A person:", response_format=PERSON, max_new_tokens=64).output_ids
    )


def test_zod_always_true_spellings_compile_in_the_library_too() -> None:
    """The rewrite sits where every JSON schema is compiled, so a library user's zod-made schema compiles as
    the server's does (``z.record(z.string(), V)``'s propertyNames, ``z.cuid()``'s format + pattern)."""
    from kvb_cache.structured.backend import check_grammar

    record = {
        "type": "object",
        "propertyNames": {"type": "string"},
        "additionalProperties": {"type": "number"},
    }
    cuid = {"type": "string", "format": "cuid", "pattern": "^[cC][0-9a-z]{6,}$"}
    for schema in (record, cuid):
        check_grammar(ResponseFormat.parse(schema))
    with pytest.raises(InvalidRequestError, match="propertyNames"):
        check_grammar(ResponseFormat.parse({"type": "object", "propertyNames": {"pattern": "^a"}}))


def test_strict_schema_leaves_data_keywords_alone():
    # A const / enum / default / examples value that looks like a schema got "additionalProperties": false
    # added, so no reply could match the const.
    from kvb_cache.structured.backend import strict_schema

    value = {"properties": {"x": 1}}
    schema = {
        "type": "object",
        "properties": {
            "c": {"const": value},
            "e": {"enum": [value, {"properties": {}}]},
            "examples": {"type": "object", "properties": {"k": {"type": "integer"}}, "default": value},
        },
    }
    out = strict_schema(schema)
    assert out["properties"]["c"]["const"] == value and out["properties"]["e"]["enum"][0] == value
    assert out["properties"]["examples"]["default"] == value
    # Schema positions are still closed, a property named like a data keyword included.
    assert out["additionalProperties"] is False
    assert out["properties"]["examples"]["additionalProperties"] is False


def test_strict_schema_keeps_composed_objects_open():
    # Closing every object that lists properties made allOf of two objects, a base object with anyOf
    # variants, and a required key the properties do not list unsatisfiable (400 "Unsatisfiable").
    from kvb_cache.structured.backend import check_grammar, strict_schema

    two = {"type": "integer"}
    cases = {
        "allOf": {"allOf": [{"properties": {"a": two}, "required": ["a"]}, {"properties": {"b": two}}]},
        "base+anyOf": {
            "type": "object",
            "properties": {"kind": {"type": "string"}},
            "required": ["kind"],
            "anyOf": [{"properties": {"a": two}, "required": ["a"]}, {"properties": {"b": two}}],
        },
        "required elsewhere": {"type": "object", "properties": {"a": two}, "required": ["a", "b"]},
        "allOf of refs": {
            "$defs": {"A": {"properties": {"a": two}}, "B": {"properties": {"b": two}}},
            "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}],
        },
        # Alternatives inside an allOf member add to the parent's keys too (dependabot's update entry,
        # OpenAPI 3.0's Parameter; found on real schemas, 2026-12-01): they were closed.
        "anyOf in an allOf member": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "a": two, "b": two},
            "required": ["name"],
            "allOf": [
                {
                    "anyOf": [
                        {"properties": {"a": two}, "required": ["a"]},
                        {"properties": {"b": two}, "required": ["b"]},
                    ]
                }
            ],
        },
        "a referenced alternative in an allOf member": {
            "$defs": {"B": {"properties": {"b": two}, "required": ["b"]}},
            "type": "object",
            "properties": {"a": two, "b": two},
            "allOf": [{"required": ["a"]}, {"anyOf": [{"$ref": "#/$defs/B"}, {"required": ["a"]}]}],
        },
        "anyOf in a referenced allOf member": {
            "$defs": {
                "Loc": {
                    "anyOf": [
                        {
                            "properties": {"in": {"const": "path"}, "required": {"const": True}},
                            "required": ["in", "required"],
                        },
                        {"properties": {"in": {"const": "query"}}, "required": ["in"]},
                    ]
                }
            },
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "in": {"type": "string"},
                "required": {"type": "boolean"},
            },
            "required": ["name", "in"],
            "allOf": [{"$ref": "#/$defs/Loc"}, {"required": ["name"]}],
        },
    }
    for name, schema in cases.items():
        text = json.dumps(strict_schema(schema))
        assert '"additionalProperties": false' not in text, name
        check_grammar(ResponseFormat.parse(schema))  # compiles (it was refused as unsatisfiable)
    # Alternatives that stand alone are still closed.
    alternatives = strict_schema({"anyOf": [{"properties": {"a": two}}, {"properties": {"b": two}}]})
    assert all(m["additionalProperties"] is False for m in alternatives["anyOf"])
    single = strict_schema({"$defs": {"A": {"properties": {"a": two}}}, "allOf": [{"$ref": "#/$defs/A"}]})
    assert single["$defs"]["A"]["additionalProperties"] is False  # one member: nothing else adds keys


def test_text_with_an_unpaired_surrogate_is_a_request_error(engine):
    """What json.loads gives for an emoji a client split in two: the Rust tokenizer raised a bare TypeError
    (prompt, bad_words), hashing the grammar a UnicodeEncodeError, and the chat template's error named
    neither the character nor the fix."""
    import json

    text = json.loads('"hi \\ud800 there"')
    calls = {
        "prompt": lambda: engine.generate(text, max_new_tokens=2),
        "bad_words": lambda: engine.generate("hi", bad_words=[text], max_new_tokens=2),
        "response_format": lambda: engine.generate("hi", response_format={"type": "regex", "pattern": text}),
        "messages": lambda: engine.chat_prompt(
            [{"role": "user", "content": [{"type": "text", "text": text}]}]
        ),
    }
    for param, call in calls.items():
        with pytest.raises(InvalidRequestError, match="unpaired surrogate") as info:
            call()
        assert info.value.param == param
    assert not engine.has_unfinished()


def test_arrays_where_scalars_go_are_typed_errors(engine):
    """== and truthiness ran before the type checks: "truth value of an array is ambiguous" (numpy) or
    "Boolean value of Tensor" (torch); a meta tensor prompt raised NotImplementedError."""
    import numpy as np

    from kvb_cache import PromptTypeError

    cases = {
        "top_k": lambda: engine.generate("hi", top_k=np.array([40, 50])),
        "response_format": lambda: engine.generate("hi", response_format=np.array([1, 2])),
        "prompt": lambda: engine.generate(torch.tensor([5, 6, 7], device="meta")),
    }
    for param, call in cases.items():
        with pytest.raises((InvalidRequestError, PromptTypeError)) as info:
            call()
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="JSON-serializable"):
        engine.generate("hi", response_format={"type": np.array([1, 2])})
    # A bare schema whose type is a list stays a schema.
    out = engine.generate("hi", response_format={"type": ["integer", "null"]}, max_new_tokens=8)
    assert out.output_ids and out.finish_reason in ("stop", "length")


def test_structural_tag_segments_the_model_opens_match_their_schema(engine):
    """vLLM's structural tag (test_structural_tag.py): a random model pushed towards the trigger
    (logit_bias) opens segments; the grammar completes each one valid."""
    digit = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
    }
    fmt = {
        "type": "structural_tag",
        "structures": [{"begin": "<digit>", "schema": digit, "end": "</f>"}],
        "triggers": ["<"],  # one token: every "<" the model writes opens a segment
    }
    (trigger_token,) = engine.tokenizer.encode("<", add_special_tokens=False)
    segments = 0
    for seed in range(4):
        result = engine.generate(
            "go",
            response_format=fmt,
            logit_bias={trigger_token: 8.0},
            temperature=1.0,
            seed=seed,
            max_new_tokens=48,
        )
        text, pos = result.output_text, 0
        while (i := text.find("<", pos)) >= 0:  # every "<" outside a segment opens one
            close = text.find("</f>", i)
            if close < 0:  # only the last segment may be cut, by max_new_tokens
                assert result.finish_reason == "length", text
                assert text[i:].startswith("<digit>") or "<digit>".startswith(text[i:]), text
                break
            assert text[i:].startswith("<digit>"), text
            jsonschema.validate(json.loads(text[i + len("<digit>") : close]), digit)
            segments, pos = segments + 1, close + len("</f>")
    assert segments >= 2  # the bias makes the model open segments; the grammar completes them


def test_a_gbnf_rule_named_start_is_an_ordinary_rule(engine):
    """GBNF reserves only ``root``; llguidance's converter renames ``root`` to Lark's ``start`` and refused a
    grammar that had its own ``start`` rule ("Rule 'start' already exists")."""
    gbnf = 'root ::= start "!" # start: a rule\nstart ::= "start" | "hi" | [xy]\n'
    assert engine.generate("g", response_format={"type": "grammar", "grammar": gbnf}).output_text in (
        "start!",
        "hi!",
        "x!",
        "y!",
    )
