"""``gpu_memory_utilization`` (vLLM's flag): the pool gets the share of the device the weights and one
profiled step leave. The CUDA measurement itself needs a GPU; the arithmetic and every refusal are checked
here with the measurement injected."""

from __future__ import annotations

import pytest
import torch

from kvb_cache import ConfigError, EngineArgs, KVBoost
from kvb_cache.gpu_budget import DeviceMemory, blocks_for_utilization, check_utilization, kv_pool_bytes

GiB = 1 << 30


def memory(**kw: int) -> DeviceMemory:
    values = {"total": 80 * GiB, "free": 79 * GiB, "reserved": 0, "weights": 1 * GiB, "activations": 2 * GiB}
    return DeviceMemory(**{**values, **kw})


def test_the_pool_gets_the_share_less_weights_and_activations() -> None:
    assert kv_pool_bytes(memory(), 0.9) == int(80 * GiB * 0.9) - 3 * GiB
    # This process's own reserved memory is part of the share (the weights are in it).
    assert kv_pool_bytes(memory(free=70 * GiB, reserved=9 * GiB), 0.9) == int(80 * GiB * 0.9) - 3 * GiB


def test_a_share_other_processes_hold_is_refused() -> None:
    with pytest.raises(ConfigError, match="other processes hold the rest"):
        kv_pool_bytes(memory(free=40 * GiB), 0.9)


def test_a_share_the_weights_fill_is_refused() -> None:
    with pytest.raises(ConfigError, match="raise gpu_memory_utilization or lower max_num_batched_tokens"):
        kv_pool_bytes(memory(weights=30 * GiB, activations=10 * GiB), 0.5)


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.2, True, "0.9", float("nan")])
def test_a_fraction_outside_0_1_is_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match=r"a fraction in \(0, 1\]"):
        check_utilization(value)
    check_utilization(1.0)
    check_utilization(None)


def test_it_and_num_blocks_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="pass one of them"):
        EngineArgs(gpu_memory_utilization=0.9, num_blocks=64).engine_config()


def test_blocks_follow_the_measured_memory() -> None:
    class OnCuda:  # torch.device("cuda") needs no GPU; nothing is run on it
        device = torch.device("cuda", 0)

    measured: list[int] = []

    def measure(model: object, tokens: int) -> DeviceMemory:
        measured.append(tokens)
        return memory()

    blocks = blocks_for_utilization(
        OnCuda(),
        0.9,
        block_bytes=1 << 20,
        step_tokens=2048,
        measure_memory=measure,  # type: ignore[arg-type]
    )
    assert blocks == (int(80 * GiB * 0.9) - 3 * GiB) // (1 << 20) and measured == [2048]
    with pytest.raises(ConfigError, match="less than two blocks"):
        blocks_for_utilization(
            OnCuda(),  # type: ignore[arg-type]
            0.9,
            block_bytes=40 * GiB,
            step_tokens=16,
            measure_memory=measure,
        )


def test_on_cpu_it_is_refused_before_the_model_loads(llama) -> None:
    with pytest.raises(
        ConfigError, match=r"CUDA device's memory, and the model is on cpu: size it with max_cache_bytes"
    ):
        KVBoost.from_pretrained("/nonexistent", device="cpu", gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match="CUDA device's memory"):
        blocks_for_utilization(llama, 0.9, block_bytes=1024, step_tokens=16)
