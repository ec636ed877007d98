"""Moving KV between stored chunks and a transformers ``DynamicCache``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache, DynamicCache

from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.live_quant import layer_kv
from kvb_cache.store import ChunkEntry, LayerKV


def assemble_cache(pieces: Sequence[tuple[ChunkEntry, int]], num_layers: int) -> DynamicCache:
    """Concatenate cached pieces into a fresh cache (batch 1).

    Every layer is a plain full ``DynamicLayer`` even for sliding-window models: the model's own sliding
    mask still limits what each query sees, and keeping every key lets the engine slice per-chunk KV back
    out after the forward (a sliding layer would have dropped it).

    Args:
        pieces: ``(entry, n)`` pairs; the first ``n`` tokens of each entry are used.
        num_layers: decoder layers of the model.

    Returns:
        A cache whose layer ``l`` holds keys/values ``[1, kv_heads, sum(n), head_dim]``.
    """
    if not pieces:
        return DynamicCache()
    # entry.layer() is the stored tensors for dense entries and a fresh decode for quantized ones.
    dense = [[entry.layer(layer) for entry, _ in pieces] for layer in range(num_layers)]
    # Initialise full layers with empty views, then hand each its concatenated tensor directly: going
    # through DynamicCache(data) would copy every byte a second time (its update() cats onto an empty tensor).
    cache = DynamicCache([(kv[0][0][:, :, :0], kv[0][1][:, :, :0]) for kv in dense])
    for layer, cache_layer in enumerate(cache.layers):
        keys = [k[:, :, :n] for (k, _), (_, n) in zip(dense[layer], pieces)]
        values = [v[:, :, :n] for (_, v), (_, n) in zip(dense[layer], pieces)]
        # A single piece is used as a view: stored tensors are never written in place (the cache cats
        # new tokens into fresh tensors and crops by slicing).
        cache_layer.keys = keys[0] if len(keys) == 1 else torch.cat(keys, dim=2)
        cache_layer.values = values[0] if len(values) == 1 else torch.cat(values, dim=2)
    return cache


def batch_cache(
    rows: Sequence[DynamicCache | None], lengths: Sequence[int], num_layers: int, like: torch.Tensor
) -> DynamicCache:
    """Stack per-row caches into one batch cache, left-padding each row to the longest (pads are masked).

    Args:
        rows: per row, its assembled cache (None or empty when nothing is cached).
        lengths: per row, its cached token count.
        like: a tensor giving the device of the result.
    """
    width = max(lengths)
    if width == 0:
        return DynamicCache()
    layers = []
    for layer in range(num_layers):
        ref = next(r.layers[layer].keys for r, n in zip(rows, lengths) if n)
        _, heads, _, head_dim = ref.shape
        vdim = next(r.layers[layer].values for r, n in zip(rows, lengths) if n).shape[-1]
        keys = ref.new_zeros((len(rows), heads, width, head_dim), device=like.device)
        values = ref.new_zeros((len(rows), heads, width, vdim), device=like.device)
        for i, (row, n) in enumerate(zip(rows, lengths)):
            if n:
                keys[i, :, width - n :] = row.layers[layer].keys[0]
                values[i, :, width - n :] = row.layers[layer].values[0]
        layers.append((keys, values))
    return DynamicCache(layers)


def slice_kv(cache: Cache, start: int, end: int, *, row: int = 0) -> LayerKV:
    """Copy positions ``[start, end)`` of batch row ``row`` out of ``cache`` (contiguous, batch dim 1);
    live-quantized layers are dequantized first."""
    kv = [layer_kv(layer) for layer in own_kv_layers(cache)]
    return tuple(
        (k[row : row + 1, :, start:end].clone(), v[row : row + 1, :, start:end].clone()) for k, v in kv
    )
