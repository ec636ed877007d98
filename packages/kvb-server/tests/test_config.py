from __future__ import annotations

import pytest

from kvb_server.config import ServerConfig
from kvb_server.sampling import SamplingParams


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"model_names": ()}, "model_names"),
        ({"model_names": ("m",), "max_queue_size": 0}, "max_queue_size"),
        ({"model_names": ("m",), "max_batch_size": 0}, "max_batch_size"),
        ({"model_names": ("m",), "batch_window_ms": -1}, "batch_window_ms"),
        ({"model_names": ("m",), "request_timeout_s": 0}, "request_timeout_s"),
        ({"model_names": ("m",), "api_key": " "}, "api_key"),
    ],
)
def test_server_config_rejects_bad_values(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kw)


def test_sampling_choice_seeds_and_engine_kwargs() -> None:
    p = SamplingParams(max_new_tokens=5, temperature=0.7, seed=10, stop=("x",), logprobs=2)
    assert p.for_choice(0) is p
    assert p.for_choice(3).seed == 13
    assert SamplingParams(max_new_tokens=1).for_choice(2).seed is None
    assert p.engine_kwargs() == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop": ["x"],
        "seed": 10,
        "logprobs": 2,
    }
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=1, top_p=0.0)
