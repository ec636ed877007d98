from __future__ import annotations

import pytest

from kvb_streaming.config import StreamingConfig
from kvb_streaming.errors import StreamingConfigError


def test_defaults_stream_everything_through_two_slots() -> None:
    config = StreamingConfig()
    assert config.residency_mode == "full_stream"
    assert config.n_staging_slots == 2
    assert config.quant_kernel == "auto"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"residency_mode": "half"}, "residency_mode must be one of"),
        (
            {"residency_mode": "partial_resident", "keep_first_k": -1},
            "keep_first_k must be a non-negative int",
        ),
        (
            {"residency_mode": "partial_resident", "keep_last_k": 1.5},
            "keep_last_k must be a non-negative int",
        ),
        (
            {"residency_mode": "partial_resident", "keep_first_k": True},
            "keep_first_k must be a non-negative int",
        ),
        ({"keep_first_k": 2}, "has no effect with residency_mode='full_stream'"),
        ({"residency_mode": "full_resident", "keep_last_k": 1}, "use residency_mode='partial_resident'"),
        ({"n_staging_slots": 0}, "n_staging_slots must be an int >= 1"),
        ({"quant_kernel": "marlin"}, "quant_kernel must be one of"),
        ({"dequant_chunk_bytes": 1024}, "dequant_chunk_bytes must be an int >= 1 MiB"),
        ({"pin_memory": 1}, "pin_memory must be True or False"),
    ],
)
def test_invalid_values_raise_with_a_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(StreamingConfigError, match=message):
        StreamingConfig(**kwargs)  # type: ignore[arg-type]


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        StreamingConfig(n_staging_slots=-3)


def test_keep_allowed_with_partial_and_ffn_modes() -> None:
    assert StreamingConfig(residency_mode="partial_resident", keep_first_k=2, keep_last_k=1).keep_last_k == 1
    assert StreamingConfig(residency_mode="ffn_only_stream", keep_first_k=3).keep_first_k == 3
