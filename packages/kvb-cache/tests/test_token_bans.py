"""vLLM's ``allowed_token_ids`` and ``bad_words``: batched loop and solo path, validation, the tokenizer rule."""

from __future__ import annotations

import pytest
import torch
from conftest import words

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost
from kvb_cache.token_bans import bad_words_ids

PROMPT = words(30)
# kv_cache_bits routes a request to the solo generator (generation.run) instead of the batched loop.
PATHS = {"loop": {}, "solo": {"kv_cache_bits": 8}}


@pytest.fixture()
def engine(llama, tokenizer):
    return KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))


def _restricted_greedy(model, ids: list[int], allowed: list[int], steps: int) -> list[int]:
    """Greedy decoding where only ``allowed`` tokens may be chosen: whole-sequence forwards, no cache."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1]
        out.append(allowed[int(torch.argmax(logits[allowed]))])
    return out


@pytest.mark.parametrize("path", PATHS)
def test_allowed_token_ids_restrict_greedy_to_the_best_allowed_token(engine, llama, tokenizer, path):
    free = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True).output_ids
    allowed = sorted({*free[1:4], 7, 11, 13} - {free[0]})  # the unrestricted first choice is not allowed
    got = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True, allowed_token_ids=allowed, **PATHS[path])
    ids = tokenizer(PROMPT)["input_ids"]
    assert got.output_ids == _restricted_greedy(llama, ids, allowed, 8)
    assert set(got.output_ids) <= set(allowed)


@pytest.mark.parametrize("path", PATHS)
def test_allowed_token_ids_restrict_sampling(engine, path):
    allowed = [5, 6, 9]
    got = engine.generate(
        PROMPT,
        max_new_tokens=12,
        ignore_eos=True,
        temperature=1.5,
        seed=3,
        allowed_token_ids=allowed,
        **PATHS[path],
    )
    assert len(got.output_ids) == 12 and set(got.output_ids) <= set(allowed)


@pytest.mark.parametrize("path", PATHS)
def test_bad_words_ids_ban_the_last_token_after_its_prefix_in_the_output(engine, path):
    extra = PATHS[path]
    free = engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True, **extra).output_ids
    # Two tokens: the second is banned only where the first was just generated.
    pair = engine.generate(
        PROMPT, max_new_tokens=10, ignore_eos=True, bad_words_ids=[[free[2], free[3]]], **extra
    ).output_ids
    assert pair[:3] == free[:3] and pair[3] != free[3]
    # One token: banned everywhere.
    single = engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True, bad_words_ids=[[free[0]]], **extra)
    assert free[0] not in single.output_ids
    # As in vLLM, the prompt is never matched: the prompt's last token followed by the first reply token
    # bans nothing at the first step.
    last = engine.tokenizer(PROMPT)["input_ids"][-1]
    kept = engine.generate(
        PROMPT, max_new_tokens=10, ignore_eos=True, bad_words_ids=[[last, free[0]]], **extra
    )
    assert kept.output_ids[0] == free[0]


def test_bad_words_strings_are_tokenized_by_the_engine(engine):
    free = engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True).output_ids
    word = engine.tokenizer.decode([free[0]])
    banned = engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True, bad_words=[word])
    assert free[0] not in banned.output_ids
    streamed = list(engine.stream(PROMPT, max_new_tokens=10, ignore_eos=True, bad_words=[word]))
    assert streamed[-1].result.output_ids == banned.output_ids


def test_a_batch_with_different_bans_equals_each_request_alone(engine):
    free = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True).output_ids
    rows = [
        {"allowed_token_ids": [free[0], 17, 19]},
        {"bad_words_ids": [[free[0]], [free[1], free[2]]]},
        {},
        {"temperature": 1.0, "seed": 5, "allowed_token_ids": [3, 4]},
    ]
    prompts = [PROMPT, words(25, seed=1), words(20, seed=2), PROMPT]
    batch = engine.generate_batch(prompts, sampling=rows, max_new_tokens=8, ignore_eos=True)
    for prompt, row, got in zip(prompts, rows, batch):
        alone = engine.generate(prompt, max_new_tokens=8, ignore_eos=True, **row)
        assert got.output_ids == alone.output_ids


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "options",
    [
        {"allowed_token_ids": [9], "bad_words_ids": [[9]]},  # the only allowed token is banned
        {"allowed_token_ids": [1], "min_tokens": 3},  # the only allowed token is end-of-sequence, held back
    ],
)
def test_options_that_leave_no_token_are_an_error_not_token_zero(engine, path, options):
    """Greedy argmax over a row of -inf returns 0: the request would go on with token 0 as the model's
    choice."""
    with pytest.raises(InvalidRequestError, match="no token can be chosen") as info:
        engine.generate(PROMPT, max_new_tokens=5, **options, **PATHS[path])
    assert info.value.param == "allowed_token_ids"
    assert not engine.has_unfinished()
    # The engine serves the next request as usual.
    assert len(engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True).output_ids) == 3


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),  # past the vocabulary
        ({"allowed_token_ids": "5"}, "allowed_token_ids"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
        ({"bad_words_ids": [[3, True]]}, "bad_words_ids"),
        ({"bad_words_ids": [[3, 10**6]]}, "bad_words_ids"),
        ({"bad_words": "w1"}, "bad_words"),  # a string, not a list of them
        ({"bad_words": ["  "]}, "bad_words"),
    ],
)
def test_bad_ban_options_name_the_parameter(engine, options, param):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(PROMPT, max_new_tokens=3, **options)
    assert info.value.param == param
    assert not engine.has_unfinished()


_BPE = {"Paris": [1, 2], " Paris": [3, 2], "x": [4], " x": [4], "New York": [5, 6], " New York": [7]}


class _Encoder:
    """A BPE-like tokenizer: a word after a space is another token than the word starting the text."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return _BPE[text]


def test_bad_words_are_tokenized_as_they_start_the_text_and_after_a_space():
    # vLLM's rule: the spaced form is added when its first token differs and its length is the same.
    assert bad_words_ids(_Encoder(), ["Paris", "  x", "New York"]) == ((1, 2), (3, 2), (4,), (5, 6))
