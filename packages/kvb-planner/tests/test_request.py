import pytest

from kvb_planner import PlannerConfigError, PlanRequest


def test_total_tokens_adds_prompt_and_generation():
    assert PlanRequest(prompt_tokens=100, max_new_tokens=28).total_tokens == 128


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt_tokens": 0, "max_new_tokens": 1}, "prompt_tokens"),
        ({"prompt_tokens": 1, "max_new_tokens": -1}, "max_new_tokens"),
        ({"prompt_tokens": 1, "max_new_tokens": 1, "batch_size": 0}, "batch_size"),
        ({"prompt_tokens": 100.5, "max_new_tokens": 1}, "prompt_tokens must be an int"),
        ({"prompt_tokens": "100", "max_new_tokens": 1}, "prompt_tokens must be an int"),
        ({"prompt_tokens": 1, "max_new_tokens": 2.0}, "max_new_tokens must be an int"),
        ({"prompt_tokens": 1, "max_new_tokens": 1, "batch_size": True}, "batch_size must be an int"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(PlannerConfigError, match=field):
        PlanRequest(**kwargs)


def test_is_frozen_and_keyword_only():
    request = PlanRequest(prompt_tokens=1, max_new_tokens=1)
    with pytest.raises(AttributeError):
        request.prompt_tokens = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        PlanRequest(1, 1)  # type: ignore[misc]
