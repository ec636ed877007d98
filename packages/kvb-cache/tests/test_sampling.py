"""Sampler: temperature 0, seeds, top-k/top-p masks, penalties, stop strings, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import reply_text, words

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost, NonFiniteLogitsError, SamplingParams
from kvb_cache.request_processor import RequestProcessor


@pytest.fixture()
def engine(llama, tokenizer):
    return KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))


PROMPT = words(30)


def test_temperature_zero_is_greedy_and_not_empty(engine, llama, tokenizer):
    result = engine.generate(PROMPT, max_new_tokens=10, temperature=0, ignore_eos=True)
    ids = tokenizer(PROMPT)["input_ids"]
    expected = llama.generate(
        torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert result.output_ids == expected[0, len(ids) :].tolist()
    assert result.output_text.strip() and result.finish_reason == "length"


def test_seed_reproducible_and_seed_matters(engine):
    runs = [
        engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=s, ignore_eos=True).output_ids
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_and_top_p_masks():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    history = torch.tensor([0])
    top_k = RequestProcessor(
        SamplingParams(temperature=1.0, top_k=2), prompt_len=1, device=torch.device("cpu")
    )
    assert torch.isfinite(top_k.process(history, logits)).tolist() == [True, True, False, False, False]
    # softmax of logits: [0.636, 0.234, 0.086, ...]; top_p=0.8 keeps the smallest set reaching 0.8: two tokens.
    top_p = RequestProcessor(
        SamplingParams(temperature=1.0, top_p=0.8), prompt_len=1, device=torch.device("cpu")
    )
    assert torch.isfinite(top_p.process(history, logits)).tolist() == [True, True, False, False, False]


def test_sampling_respects_top_k(engine):
    """With top_k=1 sampling at any temperature must equal greedy."""
    greedy = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True).output_ids
    sampled = engine.generate(
        PROMPT, max_new_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True
    ).output_ids
    assert sampled == greedy


def test_presence_and_frequency_penalties():
    processor = RequestProcessor(
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_len=2, device=torch.device("cpu")
    )
    history = torch.tensor([3, 3, 1, 1, 2])  # prompt [3, 3] is not penalised; output [1, 1, 2]
    out = processor.process(history, torch.zeros(5))
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 0.0]


def test_repetition_penalty_changes_greedy(engine):
    plain = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).output_ids
    penalised = engine.generate(PROMPT, max_new_tokens=24, repetition_penalty=5.0, ignore_eos=True).output_ids
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


def test_stop_string_ends_generation_and_is_not_emitted(engine):
    full = engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    stop_word = full.output_text.split()[5]
    result = engine.generate(PROMPT, max_new_tokens=20, stop=[stop_word, "never-appears"], ignore_eos=True)
    assert result.finish_reason == "stop" and result.stop_reason == stop_word
    assert stop_word not in result.output_text
    assert full.output_text.startswith(result.output_text)


def test_stop_string_split_across_tokens_is_held_back_in_stream(engine):
    full = engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True).output_text
    words_out = full.split()
    stop = f"{words_out[3]} {words_out[4]}"  # spans two tokens
    deltas = [e.delta_text for e in engine.stream(PROMPT, max_new_tokens=20, stop=stop, ignore_eos=True)]
    streamed = "".join(deltas)
    assert stop not in streamed
    assert streamed == full[: full.index(stop)]


def test_eos_stops_with_reason_stop(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    greedy = engine.generate(PROMPT, max_new_tokens=30, ignore_eos=True).output_ids
    eos = greedy[4]
    tokenizer_eos = engine.eos_token_ids
    engine.generation_eos = None
    result = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    result.model.generation_config.eos_token_id = eos
    try:
        out = result.generate(PROMPT, max_new_tokens=30)
    finally:
        result.model.generation_config.eos_token_id = 1
    assert out.finish_reason == "stop" and out.output_ids == greedy[: greedy.index(eos) + 1]
    assert tokenizer_eos  # the tokenizer's eos is always honoured too


@pytest.mark.parametrize("path", ["loop", "solo"])
def test_min_tokens_holds_back_eos_and_stop_strings(llama, tokenizer, path):
    """vLLM's min_tokens: no end-of-sequence and no stop string before that many tokens."""
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    # kv_cache_bits routes a request to the solo generator (generation.run) instead of the batched loop.
    extra = {"kv_cache_bits": 8} if path == "solo" else {}
    free = engine.generate(PROMPT, max_new_tokens=30, ignore_eos=True, **extra).output_ids
    eos = free[4]
    llama.generation_config.eos_token_id = eos
    try:
        engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
        early = engine.generate(PROMPT, max_new_tokens=30, **extra)
        held = engine.generate(PROMPT, max_new_tokens=30, min_tokens=12, **extra)
    finally:
        llama.generation_config.eos_token_id = 1
    assert early.output_ids == free[:5] and early.finish_reason == "stop"
    assert len(held.output_ids) >= 12 and eos not in held.output_ids[:12]
    assert held.output_ids[:4] == free[:4]  # nothing else changes before the banned token

    stop = engine.tokenizer.decode(free[2:3])
    stopped = engine.generate(PROMPT, max_new_tokens=20, stop=stop, ignore_eos=True, **extra)
    late = engine.generate(PROMPT, max_new_tokens=20, stop=stop, min_tokens=15, ignore_eos=True, **extra)
    assert len(stopped.output_ids) <= 3
    assert late.output_ids[:15] == free[:15]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1}])
def test_min_tokens_with_an_eos_id_past_the_vocabulary(llama, tokenizer, sampling):
    """Phi-3's default generation config names eos 32000; with a smaller vocabulary, banning it under
    min_tokens indexed past the logits and failed the whole batched step (IndexError)."""
    llama.generation_config.eos_token_id = [1, 32000]
    try:
        engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
        held = engine.generate(PROMPT, max_new_tokens=6, min_tokens=3, **sampling)
    finally:
        llama.generation_config.eos_token_id = 1
    assert 3 <= len(held.output_ids) <= 6 and 1 not in held.output_ids[:3]


@pytest.mark.parametrize(("min_tokens", "max_new_tokens"), [(-1, 10), (11, 10), (True, 10), (2.0, 10)])
def test_min_tokens_is_checked(engine, min_tokens, max_new_tokens):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(PROMPT, max_new_tokens=max_new_tokens, min_tokens=min_tokens)
    assert info.value.param == "min_tokens"


@pytest.mark.parametrize("path", ["loop", "solo"])
def test_stop_token_ids_end_generation_and_name_the_token(engine, path):
    """vLLM's stop_token_ids: like end-of-sequence (even with ignore_eos), the id is the stop_reason, its
    text is left out unless include_stop_str_in_output; min_tokens holds them back too."""
    extra = {"kv_cache_bits": 8} if path == "solo" else {}
    free = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True, **extra)
    stop_id = free.output_ids[3]
    stopped = engine.generate(PROMPT, max_new_tokens=24, stop_token_ids=[stop_id], ignore_eos=True, **extra)
    assert stopped.output_ids == free.output_ids[:4]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.output_text == reply_text(engine.tokenizer, PROMPT, free.output_ids[:3])
    kept = engine.generate(
        PROMPT,
        max_new_tokens=24,
        stop_token_ids=[stop_id],
        include_stop_str_in_output=True,
        ignore_eos=True,
        **extra,
    )
    assert kept.output_text == reply_text(engine.tokenizer, PROMPT, free.output_ids[:4])
    held = engine.generate(
        PROMPT, max_new_tokens=24, stop_token_ids=[stop_id], min_tokens=10, ignore_eos=True, **extra
    )
    assert len(held.output_ids) >= 10 and stop_id not in held.output_ids[:10]


def test_include_stop_str_in_output_keeps_the_stop_string(engine):
    full = engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True).output_text
    stop = full.split()[2]
    kept = engine.generate(
        PROMPT, max_new_tokens=20, stop=stop, include_stop_str_in_output=True, ignore_eos=True
    )
    assert kept.output_text == full[: full.index(stop) + len(stop)] and kept.stop_reason == stop


def test_skip_special_tokens_false_keeps_their_text(engine):
    eos = min(engine.eos_token_ids)
    forced = {"logit_bias": {eos: 100}, "ignore_eos": True, "max_new_tokens": 3}
    assert engine.generate(PROMPT, **forced).output_text == ""
    kept = engine.generate(PROMPT, skip_special_tokens=False, **forced).output_text
    assert kept == reply_text(engine.tokenizer, PROMPT, [eos] * 3, skip_special_tokens=False) and kept


@pytest.mark.parametrize("value", [[-1], ["7"], [True], 7, [10**6]])
def test_stop_token_ids_are_checked(engine, value):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(PROMPT, max_new_tokens=4, stop_token_ids=value)
    assert info.value.param == "stop_token_ids"


def test_logprobs(engine):
    result = engine.generate(PROMPT, max_new_tokens=5, logprobs=3, ignore_eos=True)
    assert result.logprobs is not None and len(result.logprobs) == 5
    for step, token in zip(result.logprobs, result.output_ids):
        assert step.token_id == token and step.logprob <= 0
        assert len(step.top) == 3 and step.top[0][2] >= step.top[1][2] >= step.top[2][2]
        assert step.top[0][0] == token  # greedy picks the most likely token


def _stop_cases(text: str, words_out: list[str]):
    """Stop strings cutting the output inside token ``k`` or exactly at its start (whose text is " w.."),
    each found first where intended; yields ``(stop, k, tokens left, tokens left with the stop kept)``."""
    for k in range(2, len(words_out) - 2):
        start = len(" ".join(["", *words_out[:k]]))  # where token k's text (" wN") begins
        inside = words_out[k][1:] + " " + words_out[k + 1]  # from the second character of token k's word
        at = " " + words_out[k] + " " + words_out[k + 1]
        if text.find(inside) == start + 2 and text.find(at) == start:
            yield inside, k, k + 1, k + 2
            yield at, k, k, k + 2
            return
    pytest.skip("no stop string occurs only once in this output")


@pytest.mark.parametrize("path", ["loop", "solo"])
def test_logprobs_leave_out_the_tokens_of_a_cut_stop_string(engine, path):
    # OpenAI's logprobs cover the returned text: the tokens of a stop string cut from it were listed (so the
    # server's text_offset pointed past the text, and the tokens' bytes spelt the stop string).
    extra = {"kv_cache_bits": 8} if path == "solo" else {}  # a private quantized cache runs generation.py
    full = engine.generate(PROMPT, max_new_tokens=10, logprobs=0, ignore_eos=True, **extra)
    words_out = full.output_text.split()  # the text is " w1 w2 ...": each word after a space
    assert len(words_out) == 10
    for stop, k, kept, kept_with_stop in _stop_cases(full.output_text, words_out):
        cut = engine.generate(PROMPT, max_new_tokens=10, logprobs=0, ignore_eos=True, stop=stop, **extra)
        assert (
            cut.finish_reason == "stop" and cut.output_text == full.output_text[: full.output_text.find(stop)]
        )
        assert cut.output_ids == full.output_ids[: k + 2]  # generation ran until the stop string completed
        assert [lp.token_id for lp in cut.logprobs] == full.output_ids[:kept]
        events = list(
            engine.stream(PROMPT, max_new_tokens=10, logprobs=0, ignore_eos=True, stop=stop, **extra)
        )
        assert [lp for e in events for lp in e.logprobs] == list(cut.logprobs)
        assert [t for e in events for t in e.token_ids] == cut.output_ids
        kept_stop = engine.generate(
            PROMPT,
            max_new_tokens=10,
            logprobs=0,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
            **extra,
        )
        assert [lp.token_id for lp in kept_stop.logprobs] == full.output_ids[:kept_with_stop]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -2),  # -1 is vLLM's "off"
        ("top_k", 2**63),  # past int64: failed the batched step of every request beside it
        ("repetition_penalty", 1e-308),  # 0 in float32: NaN probabilities in the batched step
        ("repetition_penalty", 1e4),
        ("temperature", float("nan")),
        ("logprobs", -1),
        ("presence_penalty", 3.0),
        ("temperature", 10**400),  # an int past float's range
    ],
)
def test_invalid_sampling_values_name_the_parameter(engine, field, value):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(PROMPT, **{field: value})
    assert info.value.param == field and field in str(info.value)


def test_int_values_of_float_fields_are_taken_as_floats(engine):
    """transformers' warpers demand floats: temperature=2 and repetition_penalty=2 were a bare ValueError ("has
    to be a strictly positive float") from inside the request's processor."""
    ints = dict(
        temperature=2, repetition_penalty=2, top_p=1, min_p=0, presence_penalty=1, frequency_penalty=-1
    )
    as_ints = engine.generate(PROMPT, max_new_tokens=4, seed=5, **ints)
    as_floats = engine.generate(PROMPT, max_new_tokens=4, seed=5, **{k: float(v) for k, v in ints.items()})
    assert as_ints.output_ids == as_floats.output_ids and len(as_ints.output_ids) == 4
    params = SamplingParams(temperature=2, repetition_penalty=3, top_p=1)
    assert (type(params.temperature), type(params.repetition_penalty), type(params.top_p)) == (
        float,
        float,
        float,
    )


def test_ignore_eos_must_be_a_bool_and_huge_int_biases_are_clamped():
    """ignore_eos="false" (truthy) silently generated past end-of-sequence; an int bias past float's range
    raised OverflowError."""
    for value in ("false", "no", 1, None):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(ignore_eos=value)
        assert info.value.param == "ignore_eos"
    assert SamplingParams(logit_bias={1: 10**400, 2: -(10**400), 3: 7}).logit_bias == {
        1: 100.0,
        2: -100.0,
        3: 7.0,
    }


@pytest.mark.parametrize("key", ["²", "４２", "-1", "1.0"])
def test_logit_bias_keys_are_ascii_decimal_token_ids(key):
    """``"²"`` passed str.isdigit() and then failed int() with a bare ValueError; ``"４２"`` was read as 42."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={key: 1.0})
    assert info.value.param == "logit_bias"
    assert SamplingParams(logit_bias={"42": 1.0}).logit_bias == {42: 1.0}


@pytest.mark.parametrize("temperature", [1.4e-83, 5e-324, 9e-6])
def test_vanishing_temperature_decodes_greedily_instead_of_overflowing(engine, temperature):
    """A fuzzer's temperature=1.4e-83 turned the scaled logits into inf/NaN and failed the whole engine step."""
    prompt = words(20)
    greedy = engine.generate(prompt, max_new_tokens=6, temperature=0.0)
    tiny = engine.generate(prompt, max_new_tokens=6, temperature=temperature, seed=3)
    batch = engine.generate_batch(
        [prompt, prompt], sampling=[{"temperature": temperature}, {}], max_new_tokens=6
    )
    assert tiny.output_ids == greedy.output_ids
    assert [r.output_ids for r in batch] == [greedy.output_ids, greedy.output_ids]


def test_more_logprobs_than_the_vocabulary_is_the_whole_vocabulary(engine, llama):
    """vLLM's max_logprobs -1; torch.topk raised a RuntimeError inside the step (failing every row in it)."""
    vocab = llama.get_input_embeddings().num_embeddings
    result = engine.generate(PROMPT, max_new_tokens=2, logprobs=vocab + 50, ignore_eos=True)
    assert result.logprobs is not None
    for step in result.logprobs:
        assert len(step.top) == vocab
        assert sum(math.exp(v) for _, _, v in step.top) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.5, "seed": 3},
        {"temperature": 1.0, "top_k": 2, "seed": 3},
        {"temperature": 0.0, "repetition_penalty": 1.5},
    ],
)
def test_logprobs_are_the_raw_distribution_whatever_the_sampling(engine, llama, tokenizer, sampling):
    # Regression: in the batched step the sampler edited fp32 logits in place (temperature, top-k -inf,
    # penalties), so an fp32 model's logprobs were the processed distribution while bf16/fp16 ones were raw.
    result = engine.generate(PROMPT, max_new_tokens=1, logprobs=3, ignore_eos=True, **sampling)
    with torch.no_grad():
        raw = llama(torch.tensor([tokenizer(PROMPT)["input_ids"]])).logits[0, -1].log_softmax(-1)
    step = result.logprobs[0]
    assert abs(step.logprob - float(raw[step.token_id])) < 1e-4
    top = raw.topk(3)
    assert [t[0] for t in step.top] == top.indices.tolist()
    assert [t[2] for t in step.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_in_a_batch_equal_each_request_alone(engine, llama):
    """One step computes every row's logprobs together (emitter.token_logprobs): rows asking for 0, 2, 5
    or more than the vocabulary, beside a row without logprobs, get what each gets alone."""
    vocab = llama.get_input_embeddings().num_embeddings
    tops = [0, 2, None, 5, vocab + 3]
    prompts = [f"{PROMPT} {i}" for i in range(len(tops))]
    batch = engine.generate_batch(
        prompts, sampling=[{"logprobs": t} for t in tops], max_new_tokens=4, ignore_eos=True
    )
    for prompt, top, got in zip(prompts, tops, batch):
        alone = engine.generate(prompt, max_new_tokens=4, logprobs=top, ignore_eos=True)
        assert got.output_ids == alone.output_ids
        if top is None:
            assert got.logprobs is None
            continue
        for a, b in zip(got.logprobs, alone.logprobs, strict=True):
            assert (a.token_id, a.token) == (b.token_id, b.token)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t[:2] for t in a.top] == [t[:2] for t in b.top] and len(a.top) == min(top, vocab)
            assert [t[2] for t in a.top] == pytest.approx([t[2] for t in b.top], abs=1e-5)


def test_choose_refuses_nan_logits():
    """The solo path's choice: a NaN in the logits is a typed error, not argmax's NaN index."""
    logits = torch.zeros(16)
    logits[3] = float("nan")
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
        processor = RequestProcessor(params, prompt_len=2, device=torch.device("cpu"))
        with pytest.raises(NonFiniteLogitsError, match="bfloat16 or float32"):
            processor.choose(torch.tensor([1, 2]), logits)
        assert (
            processor.choose(torch.tensor([1, 2]), torch.zeros(16).index_fill(0, torch.tensor([5]), 1.0)) == 5
        )


def test_sampling_params_take_lists_as_generate_does():
    # SamplingParams(stop=["\n"]) was refused ("must be a tuple") though generate(stop=[...]) takes a list.
    params = SamplingParams(stop=["\n", "END"], stop_token_ids=[2, 7])
    assert params.stop == ("\n", "END") and params.stop_token_ids == (2, 7)
    assert params == SamplingParams.build(stop=["\n", "END"], stop_token_ids=[2, 7])
    hash(params.stop)
    assert SamplingParams(stop="END").stop == ("END",)  # one string, as generate(stop="END") (it was refused)
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
