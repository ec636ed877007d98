"""Model fingerprints: what makes two engines share cached KV, and what must keep them apart."""

from __future__ import annotations

import torch
from conftest import make_model

from kvb_cache.config import EngineConfig
from kvb_cache.fingerprint import model_fingerprint, weights_digest


def _with_packed_buffer(value: int) -> torch.nn.Module:
    """A model carrying AWQ-style int32 packed weights as a persistent buffer (as quantized layers do)."""
    model = make_model("llama")
    model.model.layers[0].register_buffer("qweight", torch.full((4, 8), value, dtype=torch.int32))
    return model


def test_same_weights_same_fingerprint():
    assert model_fingerprint(make_model("llama"), EngineConfig()) == model_fingerprint(
        make_model("llama"), EngineConfig()
    )


def test_persistent_buffers_tell_quantized_checkpoints_apart():
    # 2**30 and 2**30 + 1 are the same float32: packed words must be hashed as integers.
    assert weights_digest(_with_packed_buffer(2**30)) != weights_digest(_with_packed_buffer(2**30 + 1))


def test_non_persistent_buffers_are_ignored():
    base = make_model("llama")
    other = make_model("llama")
    other.model.layers[0].register_buffer("scratch", torch.randn(3), persistent=False)
    assert weights_digest(base) == weights_digest(other)
