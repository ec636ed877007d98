"""Model fingerprints: what makes two engines share cached KV, and what must keep them apart."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from kvb_cache import fingerprint
from kvb_cache.config import EngineConfig
from kvb_cache.fingerprint import _device_checksums, model_fingerprint, weights_digest


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


def test_an_edit_inside_a_tensor_changes_the_fingerprint():
    # Only the first and last 4096 elements of each tensor were hashed: a model whose edit lay inside one
    # (an embedding row, a slice of a projection) read another model's disk/Redis records as exact hits.
    base = make_model("llama")
    edited = make_model("llama")
    embed = edited.model.embed_tokens.weight
    assert embed.numel() > 2 * 4096
    with torch.no_grad():
        embed[embed.shape[0] // 2, 3] += 1e-3
    assert weights_digest(base) != weights_digest(edited)
    assert model_fingerprint(base, EngineConfig()) != model_fingerprint(edited, EngineConfig())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_device_checksums_see_every_element(dtype):
    # The reduction accelerator-resident weights get (run here on the CPU: the same torch integer ops).
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(3 * 4096 + 17, generator=g) * 50).to(dtype)
    same = flat.clone()
    assert _device_checksums(flat) == _device_checksums(same)
    seen = {_device_checksums(flat)}
    for index in (0, 4096 + 5, flat.numel() // 2, flat.numel() - 1):
        changed = flat.clone()
        changed[index] = changed[index] + 1  # the smallest step the dtype has there, or more
        assert not torch.equal(changed, flat)
        seen.add(_device_checksums(changed))
    swapped = flat.clone()
    swapped[[10, 11]] = flat[[11, 10]]  # position-weighted: a permutation is a change too
    if not torch.equal(swapped, flat):
        seen.add(_device_checksums(swapped))
        assert len(seen) == 6
    else:
        assert len(seen) == 5


def test_device_checksums_span_chunks(monkeypatch):
    monkeypatch.setattr(fingerprint, "_CHUNK", 1000)
    flat = torch.arange(10_000, dtype=torch.int32)
    whole = _device_checksums(flat)
    changed = flat.clone()
    changed[7_777] = -1
    assert _device_checksums(changed) != whole
    monkeypatch.setattr(fingerprint, "_CHUNK", 1 << 22)
    assert _device_checksums(flat) == whole  # chunking does not change the checksums
