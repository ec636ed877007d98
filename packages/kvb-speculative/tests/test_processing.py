import pytest
import torch

from kvb_speculative import LogitsTokenProcessor, SamplingParams, SpeculativeConfigError, TokenProcessor


def test_greedy_keeps_raw_logits():
    processor = LogitsTokenProcessor(SamplingParams())
    logits = torch.tensor([0.5, 2.0, -1.0])
    assert processor.greedy and processor.generator is None
    assert torch.equal(processor.process(torch.tensor([0]), logits), logits)
    assert isinstance(processor, TokenProcessor)


def test_temperature_top_k_and_repetition_penalty():
    processor = LogitsTokenProcessor(SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0))
    out = processor.process(torch.tensor([1]), torch.tensor([1.0, 4.0, 3.0, -2.0]))
    # token 1 penalised 4 -> 2; temperature doubles; top-2 of (2, 4, 6, -4) keeps tokens 1 and 2.
    assert out.tolist() == [-float("inf"), 4.0, 6.0, -float("inf")]
    assert not processor.greedy


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    processor = LogitsTokenProcessor(SamplingParams(temperature=1.0, min_p=0.2))
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    out = processor.process(torch.tensor([0]), logits)
    # threshold 0.2 x 0.5 = 0.1: the 0.05 token goes, the rest keep their logits
    assert torch.isinf(out[3]) and torch.allclose(out[:3], logits[:3])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_k": 0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"min_p": -0.1},
    ],
)
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(SpeculativeConfigError):
        SamplingParams(**kwargs)
