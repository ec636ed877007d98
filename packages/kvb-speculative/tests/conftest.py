"""Session fixtures: tiny random models and a prompt with repeats."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from transformers import LlamaForCausalLM


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # Tiny models gain nothing from intra-op threads, and on shared CI cores they oversubscribe.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="session")
def other_model() -> LlamaForCausalLM:
    """Same vocabulary as ``target``, different weights: a draft model that is often wrong."""
    return tiny_llama(1)


@pytest.fixture(scope="session")
def prompt() -> torch.Tensor:
    """``[1, 24]``: a repeating pattern, so prompt lookup finds matches."""
    base = [5, 17, 33, 9, 41, 5, 17, 60, 12, 5, 17, 33]
    return torch.tensor([base + base])
