import pytest
import torch

from kvb_planner import PlannerConfigError, ProbeSettings
from kvb_planner.probes import (
    FALLBACK_DECODE_STEP_MS,
    copy_bandwidth,
    decode_step_latency,
    run_bounded,
)


class FakeClock:
    """Advances by a fixed step per reading, so budgets are exercised without real time."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_median_of_samples_after_warm_up():
    values = iter([99.0, 3.0, 1.0, 2.0])  # 99 is the discarded warm-up
    result = run_bounded(
        lambda: next(values),
        settings=ProbeSettings(max_samples=3, budget_s=10),
        fallback=-1.0,
        clock=FakeClock(0.1),
    )
    assert result == (2.0, True, 3)


def test_budget_stops_sampling():
    # Clock readings (exact in binary): 0.25 sets the deadline 1.25; 0.5, 0.75, 1.0 pass; 1.25 stops.
    result = run_bounded(
        lambda: 5.0,
        settings=ProbeSettings(max_samples=100, budget_s=1.0),
        fallback=-1.0,
        clock=FakeClock(0.25),
    )
    assert result == (5.0, True, 3)


def test_overrun_or_failure_falls_back():
    slow = run_bounded(lambda: 5.0, settings=ProbeSettings(budget_s=0.5), fallback=7.0, clock=FakeClock(1.0))
    assert slow == (7.0, False, 0)

    def boom() -> float:
        raise RuntimeError("CUDA out of memory")

    assert run_bounded(boom, settings=ProbeSettings(), fallback=7.0) == (7.0, False, 0)


def test_cpu_copy_bandwidth_is_measured():
    result = copy_bandwidth(
        torch.device("cpu"), settings=ProbeSettings(buffer_bytes=1 << 20, budget_s=0.2), fallback=-1.0
    )
    assert result.measured and result.samples >= 1 and result.value > 0


def test_decode_latency_on_a_tiny_model_keeps_the_model_unchanged(tiny_llama):
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    tiny_llama.train()
    result = decode_step_latency(tiny_llama, settings=ProbeSettings(decode_context_tokens=16, budget_s=0.5))
    assert result.measured and 0 < result.value < FALLBACK_DECODE_STEP_MS
    assert tiny_llama.training  # mode restored
    assert all(torch.equal(before[k], v) for k, v in tiny_llama.state_dict().items())


def test_decode_latency_cache_stays_at_the_context_length(tiny_llama):
    seen: list[int] = []
    original = tiny_llama.forward

    def spy(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            seen.append(cache.get_seq_length())
        return original(*args, **kwargs)

    tiny_llama.forward = spy
    decode_step_latency(
        tiny_llama, settings=ProbeSettings(decode_context_tokens=12, max_samples=4, budget_s=5)
    )
    assert seen and set(seen) == {12}


def test_settings_validation():
    with pytest.raises(PlannerConfigError, match="budget_s"):
        ProbeSettings(budget_s=0)
    with pytest.raises(PlannerConfigError, match="max_samples"):
        ProbeSettings(max_samples=0)


def test_cache_keyword_follows_the_forward_signature(tiny_llama):
    import inspect

    from kvb_planner.probes import cache_keyword

    class TakesCache(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=True):  # transformers >= 5.24
            return cache

    assert cache_keyword(TakesCache()) == "cache"
    # The installed transformers' own forward: whichever of the two names it declares.
    declared = inspect.signature(type(tiny_llama).forward).parameters
    assert cache_keyword(tiny_llama) == ("cache" if "cache" in declared else "past_key_values")
