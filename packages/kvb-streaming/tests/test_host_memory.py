from __future__ import annotations

import logging

import pytest
import torch

from kvb_streaming.host_memory import ALIGNMENT, HostAllocator, pack_layer


def test_pack_layer_aligns_and_round_trips() -> None:
    tensors = {
        "a.qweight": torch.arange(10, dtype=torch.int32).reshape(2, 5),
        "a.scales": torch.randn(3, 7, dtype=torch.float16),
        "b.x": torch.randn(4, dtype=torch.float32),
    }
    packed = pack_layer(tensors, HostAllocator(pin=False))
    assert not packed.pinned
    assert [s.offset for s in packed.slices.values()] == [0, ALIGNMENT, 2 * ALIGNMENT]
    assert packed.nbytes == 3 * ALIGNMENT
    for key, tensor in tensors.items():
        assert torch.equal(packed.slices[key].view(packed.buffer), tensor)
    # A copy of the buffer (what a staging slot receives) yields the same tensors through the same slices.
    slot = torch.zeros(packed.nbytes + 512, dtype=torch.uint8)
    slot[: packed.nbytes].copy_(packed.buffer)
    assert torch.equal(packed.slices["a.scales"].view(slot), tensors["a.scales"])


def test_pin_failure_falls_back_to_pageable_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_empty = torch.empty

    def empty(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (memlock)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    allocator = HostAllocator(pin=True)
    with caplog.at_level(logging.WARNING, logger="kvb_streaming.host_memory"):
        first = allocator.allocate(1024)
        second = allocator.allocate(2048)
    assert not first.pinned and not second.pinned
    assert first.tensor.numel() == 1024 and second.tensor.numel() == 2048
    assert allocator.pin_failures == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ulimit -l" in warnings[0].getMessage()


def test_no_pin_requested_allocates_pageable() -> None:
    buffer = HostAllocator(pin=False).allocate(64)
    assert buffer.pinned is False and not buffer.tensor.is_pinned()
