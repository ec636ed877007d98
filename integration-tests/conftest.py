"""Shared fixtures for cross-package tests on the embedded SmolLM2-135M-Instruct model."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvb_cache.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """``(model, tokenizer)``, fp32 on CPU."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return model, tokenizer
