"""The engine hands a speculative decoder the request's token budget, so drafts never run past the context
window (GPT-2's learned positions raised ``IndexError: index out of range`` on the last rounds), and decoders
written against the five-argument protocol keep working."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from conftest import VOCAB, words

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.decoding import start_decode

N_POSITIONS = 64


class _BudgetedDecoder:
    """Greedy decoding that, like a speculative decoder, runs ``gamma`` positions per forward: the tokens it
    has committed plus ``gamma - 1`` look-ahead tokens, but never past the budget when it gets one."""

    def __init__(self, gamma: int = 6) -> None:
        self.gamma = gamma
        self.budgets: list[int | None] = []

    def decode(self, model, cache, input_ids, next_logits, processor, *, max_new_tokens=None):
        self.budgets.append(max_new_tokens)
        history = input_ids[0].tolist()
        prompt_len = len(history)
        logits = next_logits
        while True:
            token = int(torch.argmax(processor.process(torch.tensor(history), logits)))
            history.append(token)
            produced = len(history) - prompt_len
            # Look-ahead positions a drafter would verify after this token (dropped again: cropped below).
            room = self.gamma if max_new_tokens is None else min(self.gamma, max_new_tokens - produced)
            start = cache.get_seq_length()
            ids = torch.tensor([[token] * max(room, 1)])
            positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
            with torch.no_grad():
                out = model(
                    input_ids=ids, position_ids=positions, use_cache=True, **cache_kwargs(model, cache)
                )
            cache.crop(-(cache.get_seq_length() - start - 1)) if ids.shape[1] > 1 else None
            logits = out.logits[0, 0].float()
            yield token


class _LegacyDecoder:
    """The five-argument protocol: no budget keyword."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, model, cache, input_ids, next_logits, processor):
        self.calls += 1
        history = input_ids[0]
        logits = next_logits
        while True:
            token = int(torch.argmax(processor.process(history, logits)))
            history = torch.cat([history, torch.tensor([token])])
            start = cache.get_seq_length()
            with torch.no_grad():
                out = model(
                    input_ids=torch.tensor([[token]]),
                    position_ids=torch.tensor([[start]]),
                    use_cache=True,
                    **cache_kwargs(model, cache),
                )
            logits = out.logits[0, -1].float()
            yield token


@pytest.fixture(scope="module")
def gpt2() -> T.PreTrainedModel:
    torch.manual_seed(0)
    config = T.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=N_POSITIONS, initializer_range=0.2
    )
    config.eos_token_id, config.pad_token_id = 1, 0
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_decoder_gets_the_budget_and_stays_inside_the_context(gpt2, tokenizer):
    prompt = list(range(20, 20 + N_POSITIONS - 12))
    plain = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16)).generate(
        prompt, max_new_tokens=12, ignore_eos=True
    )
    decoder = _BudgetedDecoder()
    engine = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16), drafter=decoder)
    out = engine.generate(prompt, max_new_tokens=12, ignore_eos=True)  # prompt + 12 == n_positions
    assert decoder.budgets == [12]
    assert out.output_ids == plain.output_ids


def test_a_decoder_without_the_budget_keyword_still_works(gpt2, tokenizer):
    prompt = list(range(20, 40))
    plain = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16)).generate(
        prompt, max_new_tokens=8, ignore_eos=True
    )
    decoder = _LegacyDecoder()
    engine = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16), drafter=decoder)
    assert engine.generate(prompt, max_new_tokens=8, ignore_eos=True).output_ids == plain.output_ids
    assert decoder.calls == 1


class _IteratorDecoder:
    """A decoder returning a plain ``Iterator[int]`` (what the protocol's annotation allows), not a generator:
    it has no ``close``."""

    def decode(self, model, cache, input_ids, next_logits, processor):
        return iter(_LegacyDecoder().decode(model, cache, input_ids, next_logits, processor).__next__, None)


def test_a_decoder_returning_a_plain_iterator_works(gpt2, tokenizer):
    # The engine called ``tokens.close()``, which only generators have: every request failed with a bare
    # AttributeError after its tokens were produced.
    prompt = list(range(20, 40))
    plain = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16)).generate(
        prompt, max_new_tokens=8, ignore_eos=True
    )
    engine = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16), drafter=_IteratorDecoder())
    assert engine.generate(prompt, max_new_tokens=8, ignore_eos=True).output_ids == plain.output_ids


def test_a_cancelled_request_closes_its_decoders_generator(gpt2, tokenizer):
    """A stream closed early (client gone) closes the decoder's generator too (its ``finally`` runs), as a
    finished request does, before the request's cache is stored (explicitly, not by reference counting)."""
    closed: list[bool] = []

    class Tracked(_LegacyDecoder):
        def decode(self, *args):
            try:
                yield from super().decode(*args)
            finally:
                closed.append(True)

    engine = KVBoost(gpt2, tokenizer, config=EngineConfig(chunk_size=16), drafter=Tracked())
    stream = engine.stream(list(range(20, 40)), max_new_tokens=8, ignore_eos=True)
    next(iter(stream))
    stream.close()
    assert closed == [True]


def test_start_decode_passes_the_budget_only_where_accepted():
    seen: list[dict] = []

    class Kwargs:
        def decode(self, model, cache, input_ids, next_logits, processor, **extra):
            seen.append(extra)
            return iter(())

    start_decode(Kwargs(), None, None, None, None, None, max_new_tokens=3)
    start_decode(_LegacyDecoder(), None, None, None, None, None, max_new_tokens=3)  # no TypeError
    assert seen == [{"max_new_tokens": 3}]


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=0.7, frequency_penalty=-0.5),
        dict(repetition_penalty=1.5, presence_penalty=-2.0),
    ],
)
def test_a_decoder_sees_the_batched_samplers_penalty_order(llama, tokenizer, penalties):
    # The processor handed to decoders (the solo path) applied presence/frequency penalties before the
    # repetition penalty; the batched sampler (and vLLM) apply repetition first. When a subtraction flips a
    # logit's sign the two differ, so a speculative request's greedy output was not plain greedy's.
    prompt = tokenizer(words(30, 3) + " " + words(30, 3))["input_ids"]
    plain = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    solo = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=_LegacyDecoder())
    want = plain.generate(prompt, max_new_tokens=24, ignore_eos=True, **penalties).output_ids
    assert solo.generate(prompt, max_new_tokens=24, ignore_eos=True, **penalties).output_ids == want


def _drain(engine: KVBoost) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                done[out.request_id] = out.result.output_ids
    return done


def test_a_request_arriving_beside_others_decodes_in_the_batch(llama, tokenizer):
    # A speculative request runs solo (batch-1 forwards of its own), so 8 concurrent speculative requests
    # ran 8 forwards per step instead of one batched forward and were slower than no drafter at all
    # (docs/speculative.md). Only a request that arrives alone speculates now; the outputs are the same.
    from kvb_cache import SamplingParams

    prompts = [tokenizer(words(20, seed))["input_ids"] for seed in range(3)]
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    want = [plain.generate(p, max_new_tokens=10, ignore_eos=True).output_ids for p in prompts]
    decoder = _LegacyDecoder()
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=decoder)
    ids = [engine.add_request(p, greedy) for p in prompts]
    assert list(engine.core.solo) == ids[:1]  # the first arrived alone: it speculates
    done = _drain(engine)
    assert [done[i] for i in ids] == want
    assert decoder.calls == 1
    # Alone again: the next request speculates.
    engine.generate(prompts[0], max_new_tokens=4, ignore_eos=True)
    assert decoder.calls == 2


def test_a_seeded_sampled_request_keeps_its_path_under_load(llama, tokenizer):
    # Its sample depends on the path (speculative sampling draws other random numbers), so it speculates
    # whether or not others run: the same request gives the same text under any load.
    from kvb_cache import SamplingParams

    prompt = tokenizer(words(20, 7))["input_ids"]
    seeded = SamplingParams(max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    decoder = _LegacyDecoder()
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=decoder)
    alone = engine.add_request(prompt, seeded)
    first = _drain(engine)[alone]
    busy = engine.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    again = engine.add_request(prompt, seeded)
    assert list(engine.core.solo) == [busy, again]
    assert _drain(engine)[again] == first
