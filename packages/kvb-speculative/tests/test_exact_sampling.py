"""Speculative sampling preserves the target distribution: chi-square goodness of fit, fixed seeds.

The target is a bigram model with a 5-token vocabulary, so the exact joint distribution of the first two
tokens is known in closed form (25 cells). Each test decodes 1,000 requests and checks the counts against
it; a deliberately wrong acceptance rule run through the same harness is rejected decisively
(p < 1e-6 with 400 samples, while the exact rule passes at p > 1e-3 with 1,000).
"""

from __future__ import annotations

import pytest
import torch
from bigram import bigram
from fakes import FixedDrafter
from helpers import plain_decode

from kvb_speculative import (
    Draft,
    DraftModelDrafter,
    ExactVerifier,
    LogitsTokenProcessor,
    SamplingParams,
    SpeculativeConfig,
    SpeculativeDecoder,
    Verdict,
    prefill,
)
from kvb_speculative.sampling import sample_token

VOCAB = 5
SAMPLES = 1000
#: The wrong rule is off by far more than sampling noise: fewer samples already reject it at p < 1e-6.
WRONG_RULE_SAMPLES = 400
PROMPT = torch.tensor([[0, 3, 1]])


def _processor(params: SamplingParams, seed: int) -> LogitsTokenProcessor:
    return LogitsTokenProcessor(params, torch.Generator().manual_seed(seed))


def _exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """``[VOCAB * VOCAB]`` probabilities of the first two tokens under plain sampling."""
    processor = _processor(params, 0)
    table = model.table.weight.detach()
    history = PROMPT[0]
    first = torch.softmax(processor.process(history, table[history[-1]]), -1)
    rows = [
        torch.softmax(processor.process(torch.cat([history, torch.tensor([x])]), table[x]), -1)
        for x in range(VOCAB)
    ]
    return (first[:, None] * torch.stack(rows)).flatten()


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target excludes was produced"
    expected = counts.sum() * probs[support]
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def _speculative_counts(
    model, drafter, params, *, gamma=3, verifier=None, seed=0, samples=SAMPLES
) -> torch.Tensor:
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=gamma), verifier=verifier)
    processor = _processor(params, seed)
    counts = torch.zeros(VOCAB * VOCAB)
    for _ in range(samples):
        cache, logits = prefill(model, PROMPT)
        stream = decoder.decode(model, cache, PROMPT, logits, processor)
        first, second = next(stream), next(stream)
        stream.close()
        counts[first * VOCAB + second] += 1
    return counts


class ResampleFromTarget(ExactVerifier):
    """A classic bug: on rejection, draw from p instead of the residual norm(max(p - q, 0))."""

    def verify(self, scores, draft: Draft, *, greedy, generator) -> Verdict:
        p = torch.softmax(scores, -1)
        for j, token in enumerate(draft.tokens.tolist()):
            q = 1.0 if draft.probs is None else float(draft.probs[j, token])
            if float(torch.rand((), generator=generator)) < float(p[j, token]) / q:
                continue
            return Verdict(j, sample_token(p[j], generator))
        return Verdict(len(draft.tokens), sample_token(p[-1], generator))


TEMPERATURE_1 = SamplingParams(temperature=1.0)
SHARP_TOP_K = SamplingParams(temperature=0.7, top_k=3)


@pytest.fixture(scope="module")
def target():
    return bigram(0, VOCAB)


@pytest.fixture(scope="module")
def draft():
    return bigram(1, VOCAB)


def test_harness_accepts_plain_sampling(target):
    processor = _processor(TEMPERATURE_1, 1)
    counts = torch.zeros(VOCAB * VOCAB)
    for _ in range(SAMPLES):
        first, second = plain_decode(target, PROMPT, processor, 2)
        counts[first * VOCAB + second] += 1
    assert _chi_square_pvalue(counts, _exact_joint(target, TEMPERATURE_1)) > 1e-3


def test_draft_model_and_target_really_differ(target, draft):
    p = torch.softmax(target.table.weight.detach(), -1)
    q = torch.softmax(draft.table.weight.detach(), -1)
    # Total variation well above 0: acceptance is partial, so the residual rule matters.
    assert float((p - q).abs().sum(-1).min()) / 2 > 0.2


@pytest.mark.parametrize("params", [TEMPERATURE_1, SHARP_TOP_K], ids=["t1", "t0.7-top3"])
def test_draft_model_sampling_matches_the_target(target, draft, params):
    counts = _speculative_counts(target, DraftModelDrafter(target, draft), params)
    assert _chi_square_pvalue(counts, _exact_joint(target, params)) > 1e-3


def test_deterministic_drafter_sampling_matches_the_target(target):
    # Point-mass proposals: token 2 then 4, whatever the history.
    counts = _speculative_counts(target, FixedDrafter([2, 4]), TEMPERATURE_1, gamma=2)
    assert _chi_square_pvalue(counts, _exact_joint(target, TEMPERATURE_1)) > 1e-3


@pytest.mark.parametrize("drafter", ["draft_model", "fixed"])
def test_wrong_residual_rule_fails_the_same_test(target, draft, drafter):
    chosen = DraftModelDrafter(target, draft) if drafter == "draft_model" else FixedDrafter([2, 4])
    counts = _speculative_counts(
        target, chosen, TEMPERATURE_1, gamma=2, verifier=ResampleFromTarget(), samples=WRONG_RULE_SAMPLES
    )
    assert _chi_square_pvalue(counts, _exact_joint(target, TEMPERATURE_1)) < 1e-6
