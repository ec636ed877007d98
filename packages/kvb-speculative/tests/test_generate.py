import pytest
import torch
from helpers import greedy, plain_decode

from kvb_speculative import PromptLookupDrafter, SpeculativeConfigError, speculative_generate


def test_matches_transformers_generate_including_the_stop_token(target, prompt):
    reference = plain_decode(target, prompt, greedy(), 30)
    stop = reference[11]
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=stop)
    out = speculative_generate(
        target, prompt, PromptLookupDrafter(), gamma=4, max_new_tokens=30, eos_token_id=stop
    )
    assert out.tokens.tolist() == expected[0, prompt.shape[1] :].tolist()
    assert out.tokens.tolist() == reference[: reference.index(stop) + 1]


def test_stops_at_max_new_tokens_and_reports_times(target, prompt):
    out = speculative_generate(
        target, prompt, PromptLookupDrafter(), gamma=6, max_new_tokens=9, eos_token_id=[]
    )
    assert out.tokens.shape == (9,)
    assert out.stats.committed_tokens == 9  # the budget shortens the last drafts: nothing wasted
    assert out.prefill_seconds > 0 and out.decode_seconds > 0


def test_sampling_is_reproducible_with_a_seed(target, prompt):
    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return speculative_generate(
            target,
            prompt,
            PromptLookupDrafter(),
            max_new_tokens=12,
            temperature=1.0,
            top_p=0.9,
            generator=generator,
            eos_token_id=[],
        ).tokens.tolist()

    assert run(3) == run(3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        # nan / inf ran until end-of-sequence (forever without one); 2.5 gave 3 tokens
        ({"max_new_tokens": float("nan")}, "max_new_tokens"),
        ({"max_new_tokens": float("inf")}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        # nan sampled from a meaningless distribution, inf uniformly
        ({"max_new_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": 4, "temperature": float("inf")}, "temperature"),
        ({"max_new_tokens": 4, "top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_arguments_are_refused(target, prompt, kwargs, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        speculative_generate(target, prompt, PromptLookupDrafter(), **kwargs)


def test_batch_of_two_is_refused(target, prompt):
    with pytest.raises(SpeculativeConfigError, match="batch size 1"):
        speculative_generate(target, prompt.repeat(2, 1), PromptLookupDrafter(), max_new_tokens=4)
    # An empty prompt failed deep in the model (cannot reshape a tensor of 0 elements).
    with pytest.raises(SpeculativeConfigError, match="non-empty"):
        speculative_generate(target, prompt[:, :0], PromptLookupDrafter(), max_new_tokens=4)
