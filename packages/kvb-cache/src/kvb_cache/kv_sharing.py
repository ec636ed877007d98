"""Keys/values shared across layers (Gemma 3n, Gemma 4 E2B / E4B).

The last ``num_kv_shared_layers`` decoder layers of these models compute no keys/values of their own: each
attends to those of the last earlier layer of its type (sliding or full). transformers gives such layers a
``DummyLayer`` in the cache and passes them the producer's keys/values. KVBoost follows the same layout: the
pool, the chunk store and the tiers hold the producer layers only (``kv_layers``, always the first layers),
and the paged attention reads a consumer layer's context from its producer's slots.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import Cache

try:  # transformers >= 5.x marks KV-less cache layers with DummyLayer
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - older 5.x: no shared-KV caches to skip

    class DummyLayer:  # type: ignore[no-redef]
        pass


def kv_sources(config: object, num_layers: int) -> tuple[int, ...]:
    """Per decoder layer, the layer whose keys/values it attends (itself, or its producer when shared).

    ``config`` is the text config: ``num_kv_shared_layers`` trailing layers read the last earlier layer of
    their ``layer_types`` entry (transformers' rule for Gemma 3n and Gemma 4).

    Raises:
        ValueError: a shared layer's type has no earlier layer to read from.
    """
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared <= 0:
        return tuple(range(num_layers))
    first = num_layers - shared
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    sources = list(range(first))
    for layer in range(first, num_layers):
        earlier = [i for i in range(first) if types[i] == types[layer]]
        if not earlier:
            raise ValueError(
                f"layer {layer} ({types[layer]}) shares keys/values but no earlier layer has its type"
            )
        sources.append(earlier[-1])
    return tuple(sources)


def own_kv_layers(cache: Cache) -> list:
    """The layers of a transformers cache that hold keys/values (KV-shared layers' ``DummyLayer`` skipped),
    in layer order: index ``i`` is the model's layer ``i`` (shared layers are always the last)."""
    return [layer for layer in cache.layers if not isinstance(layer, DummyLayer)]


def shared_map(sources: Sequence[int]) -> dict[int, int]:
    """``{consumer layer: producer layer}`` for the layers of ``sources`` that read another layer's KV."""
    return {layer: source for layer, source in enumerate(sources) if source != layer}
