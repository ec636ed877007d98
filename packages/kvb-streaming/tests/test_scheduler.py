from __future__ import annotations

import torch

from kvb_streaming.residency import LayerIndex
from kvb_streaming.scheduler import StreamingScheduler
from kvb_streaming.staging import SyncTransfer


class FakeLayer:
    """A streamed layer whose host bytes are all equal to its index; records what it was bound to."""

    def __init__(self, index: int, nbytes: int = 64) -> None:
        self.index = index
        self.host_buffer = torch.full((nbytes,), index, dtype=torch.uint8)
        self.bound: torch.Tensor | None = None

    def bind(self, device_buffer: torch.Tensor) -> None:
        # The slot must hold exactly this layer's bytes when it is bound.
        assert bool((device_buffer[: self.host_buffer.numel()] == self.index).all())
        self.bound = device_buffer

    def unbind(self) -> None:
        self.bound = None


def make(n_layers: int, n_slots: int, streamed: list[int] | None = None) -> tuple[StreamingScheduler, dict]:
    indices = streamed if streamed is not None else list(range(n_layers))
    layers = {LayerIndex(i): FakeLayer(i) for i in indices}
    scheduler = StreamingScheduler(layers=layers, n_slots=n_slots, transfer=SyncTransfer(torch.device("cpu")))
    return scheduler, layers


def run_forward(scheduler: StreamingScheduler, n_layers: int, layers: dict) -> None:
    scheduler.begin_forward()
    for i in range(n_layers):
        scheduler.before_layer(LayerIndex(i))
        if i in layers:
            assert layers[i].bound is not None
        scheduler.after_layer(LayerIndex(i))
        if i in layers:
            assert layers[i].bound is None


def test_two_slots_hit_every_time_and_copy_each_layer_once_per_forward() -> None:
    scheduler, layers = make(4, 2)
    for _ in range(3):
        run_forward(scheduler, 4, layers)
    stats = scheduler.stats()
    assert (stats.forwards, stats.layer_calls, stats.hits, stats.misses) == (3, 12, 12, 0)
    assert stats.hit_rate == 1.0
    # Forward 1: 2 staged at begin + layers 2, 3 + layer 0 of the next forward = 5; then 4 per forward.
    assert stats.bytes_moved == (5 + 4 + 4) * 64
    assert stats.synchronous_prefetches == 13  # every copy was a (blocking) prefetch on CPU
    assert stats.late_prefetches == 0


def test_one_slot_only_the_first_streamed_layer_is_prefetched() -> None:
    scheduler, layers = make(4, 1)
    for _ in range(2):
        run_forward(scheduler, 4, layers)
    stats = scheduler.stats()
    # begin_forward stages layer 0 (overlapping embeddings); layers 1..3 are on-demand misses.
    assert (stats.hits, stats.misses) == (2, 6)
    assert stats.hit_rate == 0.25
    assert stats.bytes_moved == 8 * 64


def test_as_many_slots_as_layers_stops_copying_after_the_first_pass() -> None:
    scheduler, layers = make(3, 5)  # capped at 3 slots
    assert scheduler.n_slots == 3
    for _ in range(4):
        run_forward(scheduler, 3, layers)
    stats = scheduler.stats()
    assert (stats.hits, stats.misses, stats.bytes_moved) == (12, 0, 3 * 64)
    assert scheduler.staged() == {0: 0, 1: 1, 2: 2}


def test_resident_layers_count_as_calls_but_not_hits() -> None:
    scheduler, layers = make(5, 2, streamed=[1, 2, 3])
    run_forward(scheduler, 5, layers)
    stats = scheduler.stats()
    assert (stats.layer_calls, stats.hits, stats.misses) == (5, 3, 0)


def test_three_slots_prefetch_two_ahead_with_furthest_use_eviction() -> None:
    scheduler, _ = make(4, 3)
    scheduler.begin_forward()
    assert scheduler.staged() == {0: 0, 1: 1, 2: 2}
    scheduler.before_layer(LayerIndex(0))
    assert scheduler.staged() == {0: 0, 1: 1, 2: 2}  # window 1, 2 already staged
    scheduler.after_layer(LayerIndex(0))
    scheduler.before_layer(LayerIndex(1))
    # Window 2, 3: layer 3 replaces layer 0 (needed furthest in the future), never the running layer 1.
    assert scheduler.staged() == {1: 1, 2: 2, 3: 0}


def test_out_of_order_call_is_a_miss_and_still_correct() -> None:
    scheduler, layers = make(4, 2)
    scheduler.begin_forward()  # stages 0 and 1
    scheduler.before_layer(LayerIndex(3))
    assert layers[3].bound is not None
    scheduler.after_layer(LayerIndex(3))
    assert (scheduler.stats().hits, scheduler.stats().misses) == (0, 1)


def test_exception_inside_a_layer_is_recovered_by_the_next_forward() -> None:
    scheduler, layers = make(3, 2)
    scheduler.begin_forward()
    scheduler.before_layer(LayerIndex(0))  # the layer raises: after_layer never runs
    scheduler.begin_forward()
    assert layers[0].bound is None
    run_forward(scheduler, 3, layers)
    assert scheduler.stats().misses == 0


def test_no_streamed_layers_is_a_no_op() -> None:
    scheduler, layers = make(2, 2, streamed=[])
    run_forward(scheduler, 2, layers)
    stats = scheduler.stats()
    assert scheduler.n_slots == 0 and stats.hit_rate is None and stats.bytes_moved == 0
    assert stats.layer_calls == 2


def test_reset_stats() -> None:
    scheduler, layers = make(2, 2)
    run_forward(scheduler, 2, layers)
    scheduler.reset_stats()
    assert scheduler.stats().layer_calls == 0
