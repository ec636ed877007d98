"""``gpu_memory_utilization`` (vLLM's flag): the pool gets the share of the device the weights and one
profiled step leave. The CUDA measurement itself needs a GPU; the arithmetic and every refusal are checked
here with the measurement injected."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from kvb_cache import ConfigError, EngineArgs, KVBoost
from kvb_cache.core import paged_attention
from kvb_cache.core.kv_storage import probe_layer_shapes
from kvb_cache.gpu_budget import (
    CAPTURE_STREAM_WORKSPACES,
    DeviceMemory,
    blocks_for_utilization,
    check_utilization,
    decode_graph_bytes,
    kv_pool_bytes,
    loop_attention_bytes,
)

GiB = 1 << 30


def memory(**kw: int) -> DeviceMemory:
    values = {"total": 80 * GiB, "free": 79 * GiB, "reserved": 0, "weights": 1 * GiB, "activations": 2 * GiB}
    return DeviceMemory(**{**values, **kw})


def test_the_pool_gets_the_share_less_weights_and_activations() -> None:
    assert kv_pool_bytes(memory(), 0.9) == int(80 * GiB * 0.9) - 3 * GiB
    # This process's own reserved memory is part of the share (the weights are in it).
    assert kv_pool_bytes(memory(free=70 * GiB, reserved=9 * GiB), 0.9) == int(80 * GiB * 0.9) - 3 * GiB


def test_the_loop_attention_comes_out_of_the_pool() -> None:
    assert kv_pool_bytes(memory(loop_attention=GiB), 0.9) == int(80 * GiB * 0.9) - 4 * GiB
    with pytest.raises(ConfigError, match="lower max_num_batched_tokens or max_model_len"):
        kv_pool_bytes(memory(weights=30 * GiB, activations=5 * GiB, loop_attention=5 * GiB), 0.5)


def test_loop_attention_is_charged_from_the_shapes(llama, monkeypatch) -> None:
    """The tiny Llama: 4 query / 2 KV heads of 16 dims, fp32. Gathered K + V of one layer over the larger of
    the decode sub-batch and the context; the prefill block's [G * rows, ctx] bool mask, SDPA's fp32 copy and
    the aligned copy of it (1 + 2 * 4 bytes an element)."""
    gather = 2 * max(paged_attention.DECODE_GATHER_TOKENS, 512) * 2 * 16 * 4
    assert (
        loop_attention_bytes(llama, probe_layer_shapes(llama), step_tokens=256, context=512)
        == gather + 2 * 256 * 512 * 9
    )
    # A slice longer than the context is cut to it.
    assert (
        loop_attention_bytes(llama, probe_layer_shapes(llama), step_tokens=4096, context=512)
        == gather + 2 * 512 * 512 * 9
    )
    # A slice longer than a mask block is charged one block: 2 * 100 * 512 elements here.
    monkeypatch.setattr(paged_attention, "PREFILL_MASK_ELEMENTS", 2 * 100 * 512)
    assert (
        loop_attention_bytes(llama, probe_layer_shapes(llama), step_tokens=256, context=512)
        == gather + 2 * 100 * 512 * 9
    )


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_eager_attention_adds_its_scores(arch: str) -> None:
    """Soft-capping (Gemma 2) and sinks (gpt-oss) run the eager formula: [KVH, G * q, ctx] fp32 scores and
    probabilities."""
    model = make_model(arch)
    with_scores = loop_attention_bytes(model, probe_layer_shapes(model), step_tokens=64, context=128)
    gather = 2 * max(paged_attention.DECODE_GATHER_TOKENS, 128) * 2 * 16 * 4
    mask_elements = 2 * 64 * 128
    assert with_scores == gather + mask_elements * 9 + 2 * 4 * 2 * mask_elements


def test_a_share_other_processes_hold_is_refused() -> None:
    with pytest.raises(ConfigError, match="other processes hold the rest"):
        kv_pool_bytes(memory(free=40 * GiB), 0.9)


def test_a_share_the_weights_fill_is_refused() -> None:
    with pytest.raises(ConfigError, match="raise gpu_memory_utilization, or lower max_num_batched_tokens"):
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


def test_captured_decode_graphs_come_out_of_the_pool(llama) -> None:
    """CUDA graphs keep a decode step's transients, the shared logits buffer and every bucket's static
    inputs for good: charged beside the profiled step, growing with rows and context."""
    assert kv_pool_bytes(memory(graphs=GiB), 0.9) == int(80 * GiB * 0.9) - 4 * GiB
    shapes = probe_layer_shapes(llama)
    small = decode_graph_bytes(llama, shapes, rows=4, context=256, step_peak=0)
    vocab = llama.get_output_embeddings().weight.shape[0]
    element = shapes[0].dtype.itemsize
    gathered = 2 * 4 * 256 * shapes[0].kv_heads * shapes[0].key_dim * element
    assert small == gathered + 4 * vocab * 4 + 4 * (2 * 256 + 3) * 8 + CAPTURE_STREAM_WORKSPACES
    assert decode_graph_bytes(llama, shapes, rows=4, context=256, step_peak=1000) == small + 1000
    assert decode_graph_bytes(llama, shapes, rows=32, context=8192, step_peak=0) > small + (8 << 20)


def test_blocks_follow_the_measured_memory() -> None:
    class OnCuda:  # torch.device("cuda") needs no GPU; nothing is run on it
        device = torch.device("cuda", 0)

    measured: list[int] = []

    def measure(model: object, tokens: int, rows: int) -> DeviceMemory:
        measured.append((tokens, rows))
        return memory()

    blocks = blocks_for_utilization(
        OnCuda(),
        0.9,
        block_bytes=1 << 20,
        step_tokens=2048,
        sample_rows=32,
        loop_attention=GiB,
        measure_memory=measure,  # type: ignore[arg-type]
    )
    assert blocks == (int(80 * GiB * 0.9) - 4 * GiB) // (1 << 20) and measured == [(2048, 32)]
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
