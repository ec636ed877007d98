import math

import pytest
import torch

from kvb_speculative import Draft, ExactVerifier, NonFiniteLogitsError, Verdict

NEG = -math.inf


def _draft(tokens, probs=None):
    return Draft(torch.tensor(tokens, dtype=torch.long), probs)


def test_greedy_accepts_up_to_the_first_mismatch_and_commits_the_argmax():
    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 4.0]])  # argmax 1, 0, 2
    verify = ExactVerifier().verify
    assert verify(scores, _draft([1, 0]), greedy=True, generator=None) == Verdict(2, 2)
    assert verify(scores, _draft([1, 2]), greedy=True, generator=None) == Verdict(1, 0)
    assert verify(scores, _draft([0, 0]), greedy=True, generator=None) == Verdict(0, 1)


def test_point_mass_draft_is_accepted_iff_the_target_allows_it():
    generator = torch.Generator().manual_seed(0)
    verify = ExactVerifier().verify
    certain = torch.tensor([[NEG, 0.0, NEG], [0.0, NEG, NEG]])  # p = onehot(1), then onehot(0)
    assert verify(certain, _draft([1]), greedy=False, generator=generator) == Verdict(1, 0)
    # p(2) = 0: always rejected, and the correction is drawn from p without token 2.
    scores = torch.tensor([[0.0, 0.0, NEG], [0.0, 0.0, 0.0]])
    for _ in range(50):
        verdict = verify(scores, _draft([2]), greedy=False, generator=generator)
        assert verdict.num_accepted == 0 and verdict.next_token in (0, 1)


def test_rejected_token_gets_the_residual_mass_only():
    # p = (0.5, 0.5, 0), q = (0.5, 0, 0.5) for a drafted 2: p(2)/q(2) = 0 -> rejected; the residual
    # max(p - q, 0) = (0, 0.5, 0) puts all mass on token 1.
    generator = torch.Generator().manual_seed(0)
    scores = torch.tensor([[0.0, 0.0, NEG], [0.0, 0.0, 0.0]])
    q = torch.tensor([[0.5, 0.0, 0.5]])
    for _ in range(50):
        assert ExactVerifier().verify(scores, _draft([2], q), greedy=False, generator=generator) == Verdict(
            0, 1
        )


def test_identical_distributions_accept_everything():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 6, generator=generator)
    q = torch.softmax(scores[:3], -1)
    for _ in range(50):
        verdict = ExactVerifier().verify(scores, _draft([0, 3, 5], q), greedy=False, generator=generator)
        assert verdict.num_accepted == 3


def test_a_nan_row_the_verdict_uses_raises_instead_of_committing_a_token():
    # torch.argmax returns a NaN's index: without the check, greedy verification would commit token 0 here.
    nan = float("nan")
    generator = torch.Generator().manual_seed(0)
    verify = ExactVerifier().verify
    poisoned_first = torch.tensor([[nan, 0.0, 1.0], [3.0, 0.0, 1.0]])
    for greedy in (True, False):
        with pytest.raises(NonFiniteLogitsError, match="float32"):
            verify(poisoned_first, _draft([2]), greedy=greedy, generator=generator)
    # The bonus row is consulted only when every draft is accepted.
    poisoned_bonus = torch.tensor([[0.0, 5.0, NEG], [nan, 0.0, 1.0]])
    with pytest.raises(NonFiniteLogitsError):
        verify(poisoned_bonus, _draft([1]), greedy=True, generator=None)
    # A NaN after the first rejection decides nothing, so the verdict stands.
    assert verify(poisoned_bonus, _draft([0]), greedy=True, generator=None) == Verdict(0, 1)
    assert isinstance(NonFiniteLogitsError(), ArithmeticError)
