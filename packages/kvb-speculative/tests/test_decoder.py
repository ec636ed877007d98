"""Greedy exactness of the decode loop, rollback of both caches, and the stats it records."""

import itertools

import pytest
import torch
from fakes import ScriptedDrafter
from helpers import greedy, plain_decode, tiny_llama

from kvb_speculative import (
    Draft,
    DraftModelDrafter,
    LogitsTokenProcessor,
    NonFiniteLogitsError,
    PromptLookupConfig,
    PromptLookupDrafter,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeConfigError,
    SpeculativeDecoder,
    prefill,
)

NUM_TOKENS = 24


def _decode(model, prompt, drafter, gamma, processor, num_tokens=NUM_TOKENS, observe=None):
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=gamma))
    cache, logits = prefill(model, prompt)
    out = []
    stream = decoder.decode(model, cache, prompt, logits, processor)
    for token in itertools.islice(stream, num_tokens):
        if observe is not None:
            observe(cache, out)
        out.append(token)
    stream.close()
    return out, decoder.speculative_stats()


def _drafters(name, reference, target, other_model):
    return {
        "oracle": lambda: ScriptedDrafter(reference),
        "always_wrong": lambda: ScriptedDrafter(reference, wrong=True),
        "prompt_lookup": lambda: PromptLookupDrafter(PromptLookupConfig(min_ngram=1)),
        "draft_model": lambda: DraftModelDrafter(target, other_model),
        "self_draft": lambda: DraftModelDrafter(target, target),
    }[name]()


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("drafter", ["oracle", "always_wrong", "prompt_lookup", "draft_model", "self_draft"])
def test_greedy_output_equals_plain_greedy(target, other_model, prompt, gamma, drafter):
    reference = plain_decode(target, prompt, greedy(), NUM_TOKENS + 8)
    out, stats = _decode(target, prompt, _drafters(drafter, reference, target, other_model), gamma, greedy())
    assert out == reference[:NUM_TOKENS]
    assert stats.committed_tokens >= NUM_TOKENS
    assert sum(stats.accepted_histogram) == stats.rounds
    if drafter in ("oracle", "self_draft"):
        assert stats.acceptance_rate == 1.0
        assert stats.plain_steps == 0
        assert stats.accepted_histogram[gamma] == stats.rounds
    if drafter == "always_wrong":
        assert stats.accepted_tokens == 0
        assert stats.accepted_histogram[0] == stats.rounds
        assert stats.committed_tokens == stats.rounds


def test_greedy_matches_transformers_generate(target, prompt):
    expected = target.generate(prompt, max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None)
    out, _ = _decode(target, prompt, PromptLookupDrafter(), 5, greedy())
    assert out == expected[0, prompt.shape[1] :].tolist()


def test_greedy_with_repetition_penalty_is_exact(target, other_model, prompt):
    processor = LogitsTokenProcessor(SamplingParams(temperature=0.0, repetition_penalty=1.3))
    reference = plain_decode(target, prompt, processor, NUM_TOKENS)
    out, _ = _decode(target, prompt, DraftModelDrafter(target, other_model), 4, processor)
    assert out == reference
    out, _ = _decode(target, prompt, ScriptedDrafter(reference + [0] * 8), 4, processor)
    assert out == reference


def test_cache_holds_every_yielded_token_but_the_last(target, prompt):
    """The engine contract: at the i-th yield the cache holds the prompt and the i - 1 earlier tokens."""
    reference = plain_decode(target, prompt, greedy(), NUM_TOKENS + 8)
    # Right for 3 tokens, then wrong: every round is a partial acceptance followed by a rollback.
    script = [t if i % 4 != 3 else (t + 1) % 128 for i, t in enumerate(reference)]
    lengths = []
    out, stats = _decode(
        target,
        prompt,
        ScriptedDrafter(script),
        5,
        greedy(),
        observe=lambda cache, before: lengths.append((cache.get_seq_length() - prompt.shape[1], len(before))),
    )
    assert out == reference[:NUM_TOKENS]
    assert stats.accepted_histogram[3] == stats.rounds
    # Each round commits 3 drafts + 1 correction; after its rollback the cache holds exactly the prompt and
    # the tokens up to the correction, whichever of the 4 is being yielded (the correction has KV next round).
    assert lengths == [(4 * (done // 4) + 3, done) for done in range(NUM_TOKENS)]


def test_target_and_draft_caches_have_the_right_length_after_rollback(target, other_model, prompt):
    drafter = DraftModelDrafter(target, other_model)
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=4))
    cache, logits = prefill(target, prompt)
    history = prompt[0]
    session = drafter.start(history)
    pending = logits
    for _ in range(6):
        draft = session.propose(history, 4, greedy())
        # Before verification the draft cache holds the history and all proposals but the last.
        assert session.cache.get_seq_length() == history.shape[0] + 3
        committed = decoder._round(target, cache, history, pending, greedy(), session, draft)
        accepted = len(committed) - 1
        assert cache.get_seq_length() == history.shape[0] + accepted
        assert session.cache.get_seq_length() == history.shape[0] + min(accepted, 3)
        history = torch.cat([history, torch.tensor(committed)])
        pending = None
    assert decoder.speculative_stats().rounds == 6


def test_budget_shortens_drafts(target, prompt):
    reference = plain_decode(target, prompt, greedy(), 12)
    decoder = SpeculativeDecoder(ScriptedDrafter(reference + [0] * 8), SpeculativeConfig(gamma=5))
    cache, logits = prefill(target, prompt)
    out = list(itertools.islice(decoder.decode(target, cache, prompt, logits, greedy(), max_new_tokens=8), 8))
    assert out == reference[:8]
    stats = decoder.speculative_stats()
    # 6 tokens in round 1 (5 drafts + bonus), then a single draft + bonus: never more than the budget.
    assert stats.committed_tokens == 8
    assert stats.drafted_tokens == 6


def test_the_budget_ends_the_iterator(target, prompt):
    # It only shortened drafts: list(decode(..., max_new_tokens=8)) never returned.
    reference = plain_decode(target, prompt, greedy(), 12)
    decoder = SpeculativeDecoder(ScriptedDrafter(reference + [0] * 8), SpeculativeConfig(gamma=5))
    cache, logits = prefill(target, prompt)
    assert list(decoder.decode(target, cache, prompt, logits, greedy(), max_new_tokens=8)) == reference[:8]


def test_decode_checks_its_inputs(target, prompt):
    decoder = SpeculativeDecoder(ScriptedDrafter([]), SpeculativeConfig(gamma=2))
    cache, logits = prefill(target, prompt[:, :-1])  # the prompt's last token is not in the cache
    with pytest.raises(SpeculativeConfigError, match="prefill the prompt"):
        next(decoder.decode(target, cache, prompt, logits, greedy()))
    cache, logits = prefill(target, prompt)
    for budget in (0, 2.5, float("nan")):
        with pytest.raises(SpeculativeConfigError, match="max_new_tokens"):
            next(decoder.decode(target, cache, prompt, logits, greedy(), max_new_tokens=budget))


def test_stats_accumulate_and_reset(target, prompt):
    reference = plain_decode(target, prompt, greedy(), NUM_TOKENS + 8)
    decoder = SpeculativeDecoder(ScriptedDrafter(reference), SpeculativeConfig(gamma=3))
    for _ in range(2):
        cache, logits = prefill(target, prompt)
        list(itertools.islice(decoder.decode(target, cache, prompt, logits, greedy()), 8))
    stats = decoder.speculative_stats()
    assert stats.rounds == 4  # 4 tokens per round, 8 tokens per request, 2 requests
    assert stats.tokens_per_round == 4.0
    assert stats.accepted_histogram == (0, 0, 0, 4)
    assert stats.verify_seconds > 0 and stats.draft_seconds > 0 and stats.rollback_seconds > 0
    assert stats.as_dict()["acceptance_rate"] == 1.0
    decoder.reset_stats()
    assert decoder.speculative_stats().rounds == 0


def test_reset_during_a_request_counts_everything_after_it(target, prompt):
    # The decode loop held the recorder it started with: after reset_stats() a request in flight recorded its
    # plain steps into the discarded recorder and its rounds into the new one (committed != rounds' tokens).
    reference = plain_decode(target, prompt, greedy(), 16)
    script = reference[:4] + [-1] * 4 + reference[8:]  # no draft for tokens 5..8: plain steps there
    drafter = ScriptedDrafter([t if t >= 0 else 0 for t in script])
    drafter.start = lambda ids, start=drafter.start: _gapped(start(ids), range(4, 8))
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=2))
    cache, logits = prefill(target, prompt)
    stream = decoder.decode(target, cache, prompt, logits, greedy())
    assert list(itertools.islice(stream, 3)) == reference[:3]  # one round of 3 (2 drafts + bonus)
    decoder.reset_stats()
    rest = list(itertools.islice(stream, 13))
    stream.close()
    assert rest == reference[3:16]
    stats = decoder.speculative_stats()
    assert stats.plain_steps > 0 and stats.rounds > 0
    # Every token since the reset (the last round may commit past the 13 consumed).
    assert stats.committed_tokens == stats.plain_steps + stats.accepted_tokens + stats.rounds >= 13


def _gapped(session, gap):
    """``session`` proposing nothing while the output length is in ``gap``."""
    propose = session.propose

    def gapped(history, max_tokens, processor):
        if history.shape[0] - session.offset in gap:
            return Draft(torch.empty(0, dtype=torch.long), None)
        return propose(history, max_tokens, processor)

    session.propose = gapped
    return session


@pytest.mark.parametrize("gamma", [0, 65, 2.5, "3", True])
def test_gamma_out_of_range_is_refused(gamma):
    # 2.5 and "3" were accepted (or failed the comparison untyped) and broke the first decode.
    with pytest.raises(SpeculativeConfigError, match="gamma"):
        SpeculativeConfig(gamma=gamma)


@pytest.mark.parametrize("drafter", ["oracle", "always_wrong", "none"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_target_logits_raise_instead_of_committing_a_token(prompt, drafter, temperature):
    """argmax of NaN logits is the NaN's index: a silently wrong token. Verification rounds and plain steps
    (no draft) both stop with NonFiniteLogitsError."""
    model = tiny_llama(0)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    script = [3, 4, 5, 6, 7, 8]
    drafters = {
        "oracle": ScriptedDrafter(script),
        "always_wrong": ScriptedDrafter(script, wrong=True),
        "none": ScriptedDrafter([]),
    }
    processor = LogitsTokenProcessor(
        SamplingParams(temperature=temperature), torch.Generator().manual_seed(0)
    )
    with pytest.raises(NonFiniteLogitsError, match="bfloat16 or float32"):
        _decode(model, prompt, drafters[drafter], 3, processor, num_tokens=4)
