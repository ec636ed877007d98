"""Shared fixtures: a small synthetic model shape and tiny random Llama models (no downloads)."""

from __future__ import annotations

import pytest
import torch

from kvb_planner import ModelShape


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


@pytest.fixture
def tiny_shape() -> ModelShape:
    """L=2, H=64, Hq=4, Hkv=2, d=16, I=128, V=128, fp32: the tiny test Llama's dimensions."""
    return ModelShape(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=128,
        dtype_bytes=4,
        weight_bytes=0,
    )


@pytest.fixture
def smollm2_shape() -> ModelShape:
    """SmolLM2-135M's published dimensions (written out: unit tests never load the real model)."""
    return ModelShape(
        num_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        dtype_bytes=4,
        weight_bytes=538_060_032,
    )


@pytest.fixture
def tiny_llama():
    """A 2-layer random Llama in fp32, eval mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
    )
    return AutoModelForCausalLM.from_config(config).eval()
