"""``StreamingScheduler``: which streamed layer sits in which staging slot, and when copies start."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from kvb_streaming.residency import LayerIndex
from kvb_streaming.staging import StagingSlot, Transfer

logger = logging.getLogger(__name__)


class StageableLayer(Protocol):
    """A decoder layer's streamed weights: one host buffer, bound to slot views while the layer runs."""

    @property
    def host_buffer(self) -> torch.Tensor:
        """uint8 ``[nbytes]`` host buffer (pinned when possible)."""
        ...

    def bind(self, device_buffer: torch.Tensor) -> None:
        """Points the layer's modules at views of ``device_buffer`` (a slot holding this layer's bytes)."""
        ...

    def unbind(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamingStats:
    """Counters since load (or the last :meth:`StreamingScheduler.reset_stats`).

    Attributes:
        forwards: model forward passes.
        layer_calls: decoder-layer calls, resident ones included.
        hits: streamed-layer calls whose bytes were already in (or on their way to) a slot.
        misses: streamed-layer calls that had to start their own copy and wait for it.
        synchronous_prefetches: prefetch copies that blocked the caller because the device has no
            asynchronous copy engine (CPU/MPS); 0 on CUDA.
        late_prefetches: hits whose copy was still in flight when the layer started (compute waited part of
            the copy); CUDA only.
        bytes_moved: bytes copied host -> device by the scheduler.
    """

    forwards: int = 0
    layer_calls: int = 0
    hits: int = 0
    misses: int = 0
    synchronous_prefetches: int = 0
    late_prefetches: int = 0
    bytes_moved: int = 0

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)``, or None before any streamed layer ran."""
        calls = self.hits + self.misses
        return self.hits / calls if calls else None


@dataclass(slots=True)
class _Counters:
    forwards: int = 0
    layer_calls: int = 0
    hits: int = 0
    misses: int = 0
    synchronous_prefetches: int = 0
    late_prefetches: int = 0
    bytes_moved: int = 0


class StreamingScheduler:
    """Stages streamed decoder layers into ``n_slots`` device slots, prefetching ahead of compute.

    Driven by three calls (the model's forward hooks make them): :meth:`begin_forward` at the start of
    each model forward, :meth:`before_layer` / :meth:`after_layer` around every decoder layer. Streamed
    layers run in a fixed cyclic order (the last one of a forward is followed by the first one of the next),
    so while layer ``k`` runs the next ``n_slots - 1`` streamed layers are copied into the other slots; the
    slot given up is the one whose occupant is needed furthest in the future (Belady for a cycle). With as
    many slots as streamed layers, everything stays staged after the first pass and nothing more moves.

    Args:
        layers: streamed layers in execution order.
        n_slots: staging slots (capped at the number of streamed layers).
        transfer: copy engine for the compute device.
    """

    def __init__(
        self, *, layers: Mapping[LayerIndex, StageableLayer], n_slots: int, transfer: Transfer
    ) -> None:
        self._layers = dict(layers)
        self._order = tuple(self._layers)
        self._position = {layer: pos for pos, layer in enumerate(self._order)}
        self._transfer = transfer
        capacity = max((layer.host_buffer.numel() for layer in self._layers.values()), default=0)
        n_slots = min(n_slots, len(self._order))
        self._slots = [transfer.make_slot(index, capacity) for index in range(n_slots)]
        self._slot_of: dict[LayerIndex, StagingSlot] = {}
        self._current: LayerIndex | None = None
        self._counters = _Counters()
        if self._order:
            logger.info(
                "streaming %d layers through %d staging slots of %.1f MiB",
                len(self._order),
                n_slots,
                capacity / 2**20,
            )

    @property
    def streamed_layers(self) -> tuple[LayerIndex, ...]:
        return self._order

    @property
    def n_slots(self) -> int:
        return len(self._slots)

    @property
    def slot_bytes(self) -> int:
        """Device bytes held by the staging slots."""
        return sum(slot.buffer.numel() for slot in self._slots)

    def staged(self) -> dict[LayerIndex, int]:
        """Layer -> slot index, for every layer currently in (or being copied into) a slot."""
        return {layer: slot.index for layer, slot in self._slot_of.items()}

    def stats(self) -> StreamingStats:
        c = self._counters
        return StreamingStats(
            forwards=c.forwards,
            layer_calls=c.layer_calls,
            hits=c.hits,
            misses=c.misses,
            synchronous_prefetches=c.synchronous_prefetches,
            late_prefetches=c.late_prefetches,
            bytes_moved=c.bytes_moved,
        )

    def reset_stats(self) -> None:
        self._counters = _Counters()

    def begin_forward(self) -> None:
        """Start of a model forward: stage the first streamed layers (overlaps embeddings / resident layers)."""
        self._counters.forwards += 1
        if self._current is not None:
            # The previous forward raised inside a streamed layer; its after_layer never ran.
            self.after_layer(self._current)
        if self._order:
            self._prefetch(start=0, count=len(self._slots))

    def before_layer(self, layer: LayerIndex) -> None:
        """Decoder layer ``layer`` is about to run: make its weights usable, then prefetch ahead."""
        self._counters.layer_calls += 1
        staged = self._layers.get(layer)
        if staged is None:
            return
        pos = self._position[layer]
        slot = self._slot_of.get(layer)
        if slot is None:
            self._counters.misses += 1
            victim = self._victim(protected=self._window(pos, len(self._slots)), reference=pos)
            assert victim is not None, "a window of n_slots layers with one unstaged leaves a free slot"
            slot = victim
            self._load(layer, slot)
        else:
            self._counters.hits += 1
            if self._transfer.in_flight(slot):
                self._counters.late_prefetches += 1
        self._transfer.wait_ready(slot)
        staged.bind(slot.buffer)
        self._current = layer
        self._prefetch(start=pos + 1, count=len(self._slots) - 1)

    def after_layer(self, layer: LayerIndex) -> None:
        """Decoder layer ``layer`` has been queued: unbind it and let its slot be reused once it has run."""
        staged = self._layers.get(layer)
        if staged is None:
            return
        staged.unbind()
        slot = self._slot_of.get(layer)
        if slot is not None:
            self._transfer.release(slot)
        if self._current == layer:
            self._current = None

    def _window(self, start: int, count: int) -> list[LayerIndex]:
        n = len(self._order)
        return [self._order[(start + offset) % n] for offset in range(min(count, n))]

    def _prefetch(self, *, start: int, count: int) -> None:
        window = self._window(start, count)
        protected = [*window, *([self._current] if self._current is not None else [])]
        for layer in window:
            if layer in self._slot_of:
                continue
            slot = self._victim(protected=protected, reference=start)
            if slot is None:
                return
            self._load(layer, slot)
            if self._transfer.synchronous:
                self._counters.synchronous_prefetches += 1

    def _victim(self, *, protected: Iterable[LayerIndex], reference: int) -> StagingSlot | None:
        """The slot to overwrite: an empty one, else the one whose occupant is needed last after ``reference``."""
        keep = set(protected)
        candidates = [slot for slot in self._slots if slot.layer is None or slot.layer not in keep]
        if not candidates:
            return None
        n = len(self._order)

        def next_use(slot: StagingSlot) -> int:
            return n if slot.layer is None else (self._position[slot.layer] - reference) % n

        return max(candidates, key=next_use)

    def _load(self, layer: LayerIndex, slot: StagingSlot) -> None:
        if slot.layer is not None:
            del self._slot_of[slot.layer]
        host = self._layers[layer].host_buffer
        self._transfer.copy(slot, host)
        slot.layer = layer
        self._slot_of[layer] = slot
        self._counters.bytes_moved += host.numel()
