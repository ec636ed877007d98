"""Prompt scoring (``KVBoost.prompt_logprobs``: OpenAI's echo + logprobs, lm-eval's loglikelihood)."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, make_model, words

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost, SamplingParams


def _reference(model, ids):
    """``[n - 1]`` log-probabilities of ``ids[1:]`` and ``[n - 1, V]`` log-softmax from one plain forward."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], logp


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("slice_size", [None, 7])
def test_prompt_logprobs_equal_one_plain_forward(arch, slice_size, tokenizer):
    """Every prompt token after the first, scored in slices (sliding-window layers included: 7-token slices
    of a 60-token prompt cross the 24-token window), equals one forward over the whole prompt."""
    model = make_model(arch)
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16, prefill_chunk_size=slice_size))
    ids = tokenizer(words(60, seed=3))["input_ids"]
    entries = engine.prompt_logprobs(ids, top_logprobs=3)
    want, logp = _reference(model, ids)
    assert [e.token_id for e in entries] == ids[1:]
    torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), want, atol=2e-5, rtol=0)
    for e, row in zip(entries, logp):
        values, indices = torch.topk(row, 3)
        assert [i for i, _, _ in e.top] == indices.tolist() or torch.allclose(
            torch.tensor([v for *_, v in e.top]), values, atol=2e-5
        )  # a near-tie may order equal values either way
        assert e.token == engine.token_text(e.token_id)
        # vLLM's rank: 1 + the tokens more likely than the prompt's own (near-ties within 2e-5 either way).
        above = int((row > row[e.token_id] + 2e-5).sum()) + 1
        assert above <= e.rank <= int((row > row[e.token_id] - 2e-5).sum()) + 1


def test_scoring_reads_and_writes_no_cache(llama, tokenizer):
    """A cached prefix has no logits, so scoring runs the whole prompt and leaves the cache as it was; a
    generated token's logprob and the same token scored as part of a prompt agree."""
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    ids = tokenizer(words(50, seed=4))["input_ids"]
    first = engine.generate(ids, max_new_tokens=1, logprobs=2)
    before = engine.cache_stats()["entries"]
    scored = engine.prompt_logprobs(ids + first.output_ids, top_logprobs=2)
    assert engine.cache_stats()["entries"] == before
    assert len(scored) == len(ids)
    generated = first.logprobs[0]
    assert scored[-1].token_id == generated.token_id
    assert scored[-1].logprob == pytest.approx(generated.logprob, abs=1e-4)
    assert [i for i, _, _ in scored[-1].top] == [i for i, _, _ in generated.top]


def test_scoring_edge_cases_and_bad_input(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    assert engine.prompt_logprobs([5]) == []
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        engine.prompt_logprobs([5, 6], top_logprobs=-1)
    # More alternatives than the vocabulary holds: all of it, best first (topk raised a RuntimeError).
    (whole,) = engine.prompt_logprobs([5, 6], top_logprobs=10**6)
    assert len(whole.top) == llama.get_input_embeddings().num_embeddings
    assert [v for _, _, v in whole.top] == sorted((v for _, _, v in whole.top), reverse=True)
    with pytest.raises(InvalidRequestError):
        engine.prompt_logprobs([])


def test_scorer_slices_interleave_with_running_requests(llama, tokenizer):
    """``prompt_scorer`` scores one ``prefill_chunk_size`` slice per ``advance()``; a request stepped between
    the slices keeps decoding, and both end as they would alone (scores equal ``prompt_logprobs``, tokens
    equal a solo greedy run)."""
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, prefill_chunk_size=8))
    ids = tokenizer(words(40, seed=5))["input_ids"]
    other = tokenizer(words(12, seed=6))["input_ids"]
    alone = engine.generate(other, max_new_tokens=6).output_ids
    engine.clear_cache()
    want = engine.prompt_logprobs(ids, top_logprobs=2)

    scorer = engine.prompt_scorer(ids, top_logprobs=2)
    rid = engine.add_request(other, SamplingParams(max_new_tokens=6))
    slices, tokens = 0, []
    while not scorer.done:
        with pytest.raises(RuntimeError, match="advance"):
            scorer.result()
        scorer.advance()
        slices += 1
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    assert slices == -(-(len(ids) - 1) // 8)  # ceil: one slice of at most 8 positions per call
    # The request decoded on every step taken between slices, once its own prompt was in (8 per step).
    prefill_steps = -(-len(other) // 8)
    assert slices > prefill_steps and len(tokens) == min(slices - prefill_steps + 1, 6)
    got = scorer.result()
    assert [e.token_id for e in got] == [e.token_id for e in want]
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in got]), torch.tensor([e.logprob for e in want]), atol=1e-6, rtol=0
    )
    assert scorer.advance() is True and len(scorer.result()) == len(ids) - 1  # done stays done
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    assert tokens == alone


def test_scorer_validates_when_made(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        engine.prompt_scorer([5, 6], top_logprobs=-1)
    scorer = engine.prompt_scorer([5])
    assert scorer.done and scorer.result() == []
