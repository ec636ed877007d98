import pytest

from kvb_planner import Ladder, LadderStep, PlannerConfigError


def test_default_ladder_order_is_every_chunk_size_per_precision():
    steps = Ladder.default().steps
    assert steps[:6] == tuple(
        LadderStep(prefill_chunk_size=c, kv_bits=16) for c in (None, 2048, 1024, 512, 256, 128)
    )
    assert steps[6] == LadderStep(prefill_chunk_size=None, kv_bits=8)
    assert steps[-1] == LadderStep(prefill_chunk_size=128, kv_bits=4)
    assert len(steps) == 18


def test_custom_ladder_without_quantization():
    assert Ladder.default(chunk_sizes=(64,), kv_bits=(16,)).steps == (
        LadderStep(prefill_chunk_size=None),
        LadderStep(prefill_chunk_size=64),
    )


def test_slice_tokens():
    assert LadderStep(prefill_chunk_size=None).slice_tokens(300) == 300
    assert LadderStep(prefill_chunk_size=128).slice_tokens(300) == 128
    assert LadderStep(prefill_chunk_size=512).slice_tokens(300) == 300


def test_validation():
    with pytest.raises(PlannerConfigError, match="prefill_chunk_size"):
        LadderStep(prefill_chunk_size=0)
    with pytest.raises(PlannerConfigError, match="kv_bits"):
        LadderStep(prefill_chunk_size=None, kv_bits=2)
    with pytest.raises(PlannerConfigError, match="at least one step"):
        Ladder(steps=())
    with pytest.raises(PlannerConfigError, match="distinct"):
        Ladder(steps=(LadderStep(prefill_chunk_size=8), LadderStep(prefill_chunk_size=8)))
