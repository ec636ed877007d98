"""Small pieces shared by the engine and its mixins: throwaway lookup requests, caches over given tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request
from kvb_cache.hashing import ChunkHash
from kvb_cache.sampling import SamplingParams


def probe_request(ids: Sequence[int], *, root: ChunkHash | None = None) -> Request:
    """A request that only looks up or stores KV (no sampling state), under chain ``root`` (None: the
    engine's unsalted root)."""
    return Request(
        request_id=RequestId("probe"),
        tokens=list(ids),
        prompt_len=len(ids),
        params=_GREEDY,
        processor=None,
        emitter=None,
        arrival=0.0,
        root=root,
    )  # type: ignore[arg-type]


_GREEDY = SamplingParams(max_new_tokens=1)


def dense_cache(layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A ``DynamicCache`` holding ``layers`` (``[1, kv_heads, seq, dim]`` each) without another copy."""
    cache = DynamicCache([(k[:, :, :0], v[:, :, :0]) for k, v in layers])
    for layer, (k, v) in zip(cache.layers, layers):
        layer.keys, layer.values = k, v
    return cache
