import pytest
import torch

from kvb_speculative.sampling import sample_token


def test_zero_probability_tokens_are_never_drawn():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    draws = {sample_token(probs, generator) for _ in range(500)}
    assert draws == {1, 3}


def test_frequencies_follow_unnormalised_weights():
    generator = torch.Generator().manual_seed(0)
    weights = torch.tensor([1.0, 3.0, 6.0])  # not normalised on purpose
    counts = torch.bincount(
        torch.tensor([sample_token(weights, generator) for _ in range(6000)]), minlength=3
    )
    assert counts.tolist() == pytest.approx([600, 1800, 3600], abs=150)


def test_point_mass_and_seed_reproducibility():
    assert sample_token(torch.tensor([0.0, 0.0, 1.0]), None) == 2
    a = [sample_token(torch.ones(10), torch.Generator().manual_seed(7)) for _ in range(3)]
    b = [sample_token(torch.ones(10), torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a == b
