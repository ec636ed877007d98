"""verify_correctness: zero drift for exact reuse, measured drift for stitched reuse."""

from __future__ import annotations

import pytest
import torch
from conftest import words

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost, StitchConfig
from kvb_cache.fidelity import default_prompts, kl_divergence


def _rag(tokenizer):
    docs = [tokenizer(words(40, seed=s))["input_ids"] for s in (1, 2, 3)]
    system = tokenizer(words(20, seed=9))["input_ids"]
    return [system + docs[i % 3] + docs[(i + 1) % 3] + docs[(i + 2) % 3] + [5 + i] for i in range(3)]


def test_exact_reuse_shows_no_drift(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    prompts = _rag(tokenizer)
    report = engine.verify_correctness([prompts[0], prompts[0] + [7, 8, 9]], new_tokens=8)
    assert report.prompts[1].reuse_ratio > 0.9
    assert report.identical_rate == 1.0 and report.top1_agreement == 1.0
    assert report.max_abs_logit_diff < 1e-5 and report.max_kl < 1e-9


def test_stitched_reuse_is_reported(llama, tokenizer):
    engine = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=16, stitching=StitchConfig(recompute_strategy="none")),
    )
    report = engine.verify_correctness(_rag(tokenizer), new_tokens=8)
    first, later = report.prompts[0], report.prompts[1:]
    assert first.reuse_ratio == 0.0 and first.identical and first.kl < 1e-9
    assert all(p.reuse_ratio > 0.5 for p in later)
    assert all(p.recomputed_tokens == 0 for p in later)
    # Approximate reuse really drifts on a random model: the harness measures how much on a real one.
    assert max(p.max_abs_logit_diff for p in later) > 1e-3


def test_kl_divergence_values():
    a = torch.tensor([0.0, 0.0])
    assert kl_divergence(a, a) == 0.0
    expected = 0.5 * torch.log(torch.tensor(0.5 / 0.2)) + 0.5 * torch.log(torch.tensor(0.5 / 0.8))
    other = torch.log(torch.tensor([0.2, 0.8]))
    assert abs(kl_divergence(a, other) - float(expected)) < 1e-6


def test_default_prompts_share_documents_in_rotated_orders():
    prompts = default_prompts()
    assert len(prompts) == 4
    starts = [p.index("Document (assignment)") for p in prompts]
    assert len(set(starts)) == 4  # the same document at four different offsets
    assert all(p.count("Document (") == 4 for p in prompts)


@pytest.mark.parametrize("new_tokens", [0, -3, 2.5])
def test_new_tokens_below_one_is_a_typed_error(llama, tokenizer, new_tokens):
    # 0 reached the no-cache reference model.generate and raised transformers' bare ValueError.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    with pytest.raises(InvalidRequestError, match="new_tokens") as info:
        engine.verify_correctness([[5, 6, 7]], new_tokens=new_tokens)
    assert info.value.param == "new_tokens"


def test_a_request_past_the_context_is_refused_before_the_reference_runs(llama, tokenizer, monkeypatch):
    """The no-cache reference generates on the bare model, which nothing bounds: new_tokens=10**9 ran until
    killed, and a single string was read as one prompt per character."""
    import kvb_cache.fidelity as fidelity
    from kvb_cache import ContextLengthError

    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    ran = []
    monkeypatch.setattr(fidelity, "_no_cache", lambda *a: ran.append(a))
    with pytest.raises(ContextLengthError):
        engine.verify_correctness([[5, 6, 7]], new_tokens=10**9)
    with pytest.raises(ContextLengthError):
        engine.verify_correctness([[5] * (engine.context_length + 1)], new_tokens=1)
    assert not ran
    with pytest.raises(InvalidRequestError, match=r"\[prompt\]") as info:
        engine.verify_correctness("Hello")
    assert info.value.param == "prompts" and not ran
    # No prompt passed: "shorten the prompt" named nothing the caller could change (an audit, 2026-12-01).
    small = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_model_len=256))
    with pytest.raises(ContextLengthError, match=r"built-in verification prompts need .* pass your own"):
        small.verify_correctness()
    assert not ran
