"""Predicted outputs (OpenAI's ``prediction``, ``SamplingParams.prediction_ids``): the prediction's tokens are
drafted and verified in the batched step, so the output is what it is without them, in fewer steps where
they match."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, words
from test_step_speculation import FakeDrafter, drain, plain_outputs

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost, SamplingParams
from kvb_cache.prediction import PREDICTION_DRAFT_TOKENS, PredictionSession

NEW = 24


def proposals(session: PredictionSession, generated: list[int], prompt_len: int = 3) -> list[int]:
    history = torch.tensor([7] * prompt_len + generated, dtype=torch.long)
    return session.propose(history, 4, None).tokens.tolist()


def test_the_session_follows_the_prediction_and_resynchronises_after_an_edit():
    prediction = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19)
    s = PredictionSession(prediction, 3)
    assert proposals(s, [10]) == [11, 12, 13, 14]
    assert proposals(s, [10, 11, 12]) == [13, 14, 15, 16]  # two more committed, both as predicted
    # An edit: 99 instead of 13. Out of step until the last generated tokens occur in the prediction again.
    assert proposals(s, [10, 11, 12, 99]) == []
    assert proposals(s, [10, 11, 12, 99, 14]) == []  # one token is not enough to resynchronise on
    assert proposals(s, [10, 11, 12, 99, 14, 15]) == [16, 17, 18, 19]
    assert proposals(s, [10, 11, 12, 99, 14, 15, 16, 17, 18, 19]) == []  # the prediction is spent


def test_resynchronising_prefers_the_occurrence_after_where_the_reply_had_got_to():
    prediction = (1, 2, 3, 50, 1, 2, 4, 60, 1, 2, 5)
    s = PredictionSession(prediction, 0)
    assert proposals(s, [1, 2, 3, 50], prompt_len=0) == [1, 2, 4, 60]
    assert proposals(s, [1, 2, 3, 50, 1, 2, 4, 70, 1, 2], prompt_len=0) == [5]  # not [3, 50, ...]
    fresh = PredictionSession(prediction, 0)
    assert proposals(fresh, [9, 1, 2], prompt_len=0) == [3, 50, 1, 2]  # nothing reached: the first one


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_output_is_unchanged_and_a_right_prediction_saves_steps(arch, tokenizer):
    model = make_model(arch)
    prompts = [tokenizer(words(n, seed))["input_ids"] for n, seed in ((30, 1), (12, 2), (45, 3))]
    want = plain_outputs(model, tokenizer, prompts, NEW)

    def run(predictions) -> tuple[list[list[int]], int, list]:
        engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
        ids = [
            engine.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True, prediction_ids=pred))
            for p, pred in zip(prompts, predictions)
        ]
        results = {}
        steps = 0
        while engine.has_unfinished():
            steps += 1
            for out in engine.step():
                assert out.error is None, out.error
                if out.result is not None:
                    results[out.request_id] = out.result
        assert engine.paged_stats().blocks_used == 0
        return [results[i].output_ids for i in ids], steps, [results[i] for i in ids]

    plain, plain_steps, _ = run([None] * 3)
    assert plain == want
    right, right_steps, results = run(want)  # the prediction is the reply itself
    assert right == want
    assert right_steps < plain_steps / 3  # 8 drafts + 1 token per verification
    for r in results:
        # The 23 tokens after the prefill's first: three verifications of 8, 8 and 4 drafts (the budget's
        # last), each also committing the token after its drafts.
        assert r.accepted_prediction_tokens == 8 + 8 + 4
        assert r.rejected_prediction_tokens == 0
    # A prediction with an edit in the middle and a wrong one: the same text.
    edited = [[*w[:10], (w[10] + 1) % 50, *w[11:]] for w in want]
    out, _, results = run(edited)
    assert out == want and all(r.accepted_prediction_tokens > 0 for r in results)
    wrong = [[(t + 1) % 50 for t in w] for w in want]
    out, _, results = run(wrong)
    assert out == want and all(r.accepted_prediction_tokens == 0 for r in results)


def test_sampled_requests_draft_their_prediction_too(tokenizer):
    model = make_model("llama")
    prompt = tokenizer(words(20, 5))["input_ids"]
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    greedy = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
    # Unseeded and cold (nearly greedy): verified by speculative sampling against the point-mass drafts.
    again = engine.generate(
        prompt, max_new_tokens=NEW, ignore_eos=True, temperature=0.05, prediction_ids=greedy.output_ids
    )
    assert len(again.output_ids) == NEW
    assert again.accepted_prediction_tokens > 0


def test_where_a_prediction_is_not_used_it_is_ignored(tokenizer):
    """Seeded sampling (solo path), logprobs and penalties keep their own paths: no drafts, same text."""
    model = make_model("llama")
    prompt = tokenizer(words(20, 6))["input_ids"]
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    for params in ({"temperature": 0.7, "seed": 3}, {"logprobs": 2}, {"repetition_penalty": 1.3}):
        base = engine.generate(prompt, max_new_tokens=12, ignore_eos=True, **params)
        with_prediction = engine.generate(
            prompt, max_new_tokens=12, ignore_eos=True, prediction_ids=base.output_ids, **params
        )
        assert with_prediction.output_ids == base.output_ids, params
        assert with_prediction.accepted_prediction_tokens == with_prediction.rejected_prediction_tokens == 0


def test_a_prediction_takes_the_place_of_the_engine_drafter_for_its_request(tokenizer):
    model = make_model("llama")
    prompts = [tokenizer(words(n, seed))["input_ids"] for n, seed in ((25, 7), (15, 8))]
    want = plain_outputs(model, tokenizer, prompts, NEW)
    drafter = FakeDrafter({tuple(p): w for p, w in zip(prompts, want)}, "wrong")
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    predicted = engine.add_request(
        prompts[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True, prediction_ids=want[0])
    )
    drafted = engine.add_request(prompts[1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    done, _ = drain(engine)
    assert done[predicted] == want[0] and done[drafted] == want[1]
    assert len(drafter.sessions) == 1  # only the request without a prediction used the drafter
    assert max(drafter.proposed) <= drafter.gamma < PREDICTION_DRAFT_TOKENS


@pytest.mark.parametrize(
    ("value", "match"),
    [("some text", "tokenize"), ([1, -2], ">= 0"), ([1, True], ">= 0"), (5, "list of token ids")],
)
def test_bad_predictions_are_request_errors(value, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(prediction_ids=value)
    assert info.value.param == "prediction_ids"


def test_a_prediction_token_outside_the_vocabulary_is_refused(tokenizer):
    engine = KVBoost(make_model("llama"), tokenizer, config=EngineConfig(chunk_size=16))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as info:
        engine.generate("a b c", max_new_tokens=2, prediction_ids=[1, 10**6])
    assert info.value.param == "prediction_ids"


def test_a_rejected_proposal_shortens_the_next_and_a_kept_one_doubles_it():
    prediction = tuple(range(100, 140))
    s = PredictionSession(prediction, 0)

    def propose(generated: list[int]) -> list[int]:
        return s.propose(torch.tensor(generated, dtype=torch.long), 16, None).tokens.tolist()

    assert propose([100]) == list(range(101, 101 + PREDICTION_DRAFT_TOKENS))
    s.rollback(0)  # none kept: the reply wrote something else (here: the same text in other tokens)
    assert propose([100, 7, 101, 102]) == [103]  # resynchronised, one token proposed
    s.rollback(1)
    assert len(propose([100, 7, 101, 102, 103, 104])) == 2
    s.rollback(2)
    assert len(propose([100, 7, 101, 102, 103, 104, 105, 106, 107])) == 4
    s.rollback(1)  # part kept: the next proposal is what was kept
    assert len(propose([100, 7, 101, 102, 103, 104, 105, 106, 107, 108, 109])) == 1


def test_counts_hold_only_what_the_reply_holds_when_a_stop_ends_it_inside_a_kept_run(tokenizer):
    model = make_model("llama")
    prompt = tokenizer(words(18, 9))["input_ids"]
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    want = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True).output_ids
    stop = want[4]  # the fifth token: inside the first verification's kept run of 8
    result = engine.generate(prompt, max_new_tokens=NEW, stop_token_ids=[stop], prediction_ids=want)
    cut = want.index(stop) + 1
    assert result.output_ids == want[:cut]
    # Every token after the prefill's first came from the prediction: exactly those, not the 8 verified.
    assert result.accepted_prediction_tokens == cut - 1 and result.rejected_prediction_tokens == 0


def test_a_long_prediction_is_cut_and_a_failing_one_keeps_its_counts(tokenizer, monkeypatch):
    from kvb_cache.core import speculation
    from kvb_cache.prediction import prediction_limit

    model = make_model("llama")
    prompt = tokenizer(words(18, 10))["input_ids"]
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    want = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True).output_ids
    seen = []
    start = speculation.StepSpeculation.predicted

    def predicted(prediction, prompt_ids, max_new_tokens):
        seen.append(len(prediction))
        return start(prediction, prompt_ids, max_new_tokens)

    monkeypatch.setattr(speculation.StepSpeculation, "predicted", staticmethod(predicted))
    long = want + [1] * 100_000
    assert (
        engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, prediction_ids=long).output_ids == want
    )
    assert seen == [prediction_limit(NEW)]
    # A drafting failure after a kept round: no more drafts, the counts so far still reported.
    calls = {"n": 0}
    propose = PredictionSession.propose

    def flaky(self, history, max_tokens, processor):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("drafting broke")
        return propose(self, history, max_tokens, processor)

    monkeypatch.setattr(PredictionSession, "propose", flaky)
    result = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, prediction_ids=want)
    assert result.output_ids == want and result.accepted_prediction_tokens == 2 * PREDICTION_DRAFT_TOKENS
