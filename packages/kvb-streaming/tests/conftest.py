"""Shared fixtures: tiny random Llama-family models, AWQ-packed by our own packer (no hub access)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvb_streaming.packer import save_awq_checkpoint

GROUP_SIZE = 32


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    values: dict[str, object] = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_mixtral_config(**overrides: object):
    """A tiny Mixtral (transformers 5 keeps its experts as fused 3-D parameters)."""
    from transformers import MixtralConfig

    values: dict[str, object] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    values.update(overrides)
    return MixtralConfig(**values)


@pytest.fixture(scope="session")
def make_tiny_config() -> Callable[..., LlamaConfig]:
    """Factory of tiny Llama configs with optional overrides."""
    return tiny_llama_config


@pytest.fixture(scope="session")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config()).eval()


@pytest.fixture(scope="session")
def awq_llama_dir(tiny_llama: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_awq_checkpoint(tiny_llama, tmp_path_factory.mktemp("awq_llama"), group_size=GROUP_SIZE)


@pytest.fixture(scope="session")
def awq_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: q/k/v projections with biases, tied embeddings."""
    torch.manual_seed(1)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases are zero-initialized; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return save_awq_checkpoint(model, tmp_path_factory.mktemp("awq_qwen"), group_size=GROUP_SIZE)
