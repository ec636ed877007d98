"""The paged pool's tensors: per layer, keys and values for every slot (``block * block_size + offset``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.core import kv_dtype
from kvb_cache.errors import ConfigError, KVBoostError, ModelLoadError, UnsupportedModelError
from kvb_cache.kv_sharing import own_kv_layers


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerShape:
    """KV shape of one attention layer: ``kv_heads`` heads of ``key_dim`` / ``value_dim`` channels."""

    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype


def probe_layer_shapes(model: PreTrainedModel) -> tuple[LayerShape, ...]:
    """Read every layer's KV shape from a one-token forward (works for any architecture's cache layout).

    Layers that share an earlier layer's keys/values (:mod:`kvb_cache.kv_sharing`) hold none and get no
    shape: the result has one entry per layer with KV of its own, the model's first layers."""
    cache = DynamicCache(config=model.config)
    token = torch.zeros((1, 1), dtype=torch.long, device=model.device)
    try:
        with torch.inference_mode():
            model(input_ids=token, position_ids=token, **cache_kwargs(model, cache), use_cache=True)
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        if isinstance(exc, KVBoostError):
            raise
        # The engine's first forward: a checkpoint that cannot run escaped as a traceback at start-up.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(
            f"{type(model).__name__} failed a one-token forward ({type(exc).__name__}: {first}); the "
            "checkpoint does not run as loaded (try model(input_ids=...) in transformers)"
        ) from exc
    empty = [i for i, layer in enumerate(own_kv_layers(cache)) if getattr(layer, "keys", None) is None]
    if empty:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s layers {empty[:4]}{'...' if len(empty) > 4 else ''} keep no keys/values "
            "for the prompt's tokens (cross-attention layers, which attend to an image's states, as in Mllama); "
            "KVBoost's pool holds per-token keys/values of self-attention layers only"
        )
    return tuple(
        LayerShape(
            kv_heads=layer.keys.shape[1],
            key_dim=layer.keys.shape[-1],
            value_dim=layer.values.shape[-1],
            dtype=layer.keys.dtype,
        )
        for layer in own_kv_layers(cache)
    )


def bytes_per_block(shapes: Sequence[LayerShape], block_size: int, kv_cache_dtype: str = "auto") -> int:
    """Pool bytes of one block, every layer's keys and values, held in ``kv_cache_dtype``."""
    return sum(
        s.kv_heads
        * block_size
        * (s.key_dim + s.value_dim)
        * torch.empty((), dtype=kv_dtype.pool_dtype(kv_cache_dtype, s.dtype)).element_size()
        for s in shapes
    )


class KVStorage:
    """Keys ``[kv_heads, num_blocks * block_size, key_dim]`` and values (same, ``value_dim``) per layer
    (one block more with ``scratch``), held in ``kv_cache_dtype`` (:mod:`kvb_cache.core.kv_dtype`; each
    layer's :attr:`LayerShape.dtype` for ``"auto"``). :meth:`read` returns them in the layer's dtype.

    Slots are laid out head-major so that gathering a sequence's slots gives ``[kv_heads, seq, dim]``
    directly, the layout attention consumes.
    """

    def __init__(
        self,
        shapes: Sequence[LayerShape],
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        shared: Mapping[int, int] | None = None,
        scratch: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.shapes = tuple(shapes)
        self.kv_cache_dtype = kv_dtype.check_kv_cache_dtype(kv_cache_dtype)
        #: ``{layer: producer layer}`` for the model's layers that attend another layer's keys/values
        #: (:func:`kvb_cache.kv_sharing.shared_map`): they read its slots and write none.
        self.shared = dict(shared or {})
        self.block_size = block_size
        self.num_blocks = num_blocks
        #: With ``scratch``, one block past ``num_blocks`` that no request owns (the block pool hands out
        #: ``0..num_blocks-1``): padding rows of a captured decode step write and read its first slot.
        self.scratch_slot: int | None = num_blocks * block_size if scratch else None
        slots = (num_blocks + scratch) * block_size
        try:
            self.keys = [
                torch.zeros((s.kv_heads, slots, s.key_dim), dtype=self._dtype(s), device=device)
                for s in shapes
            ]
            self.values = [
                torch.zeros((s.kv_heads, slots, s.value_dim), dtype=self._dtype(s), device=device)
                for s in shapes
            ]
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError subclasses RuntimeError
            raise ConfigError(
                f"cannot allocate a KV pool of {num_blocks} blocks x {block_size} tokens on {device}: {exc}; "
                "lower num_blocks / max_cache_bytes"
            ) from exc

    @property
    def narrowed(self) -> bool:
        """Whether some layer is held in another dtype than it is computed in (``kv_cache_dtype``)."""
        return any(k.dtype != s.dtype for k, s in zip(self.keys, self.shapes))

    def _dtype(self, shape: LayerShape) -> torch.dtype:
        return kv_dtype.check_narrower(self.kv_cache_dtype, shape.dtype)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def slots(
        self, block_ids: Sequence[int], length: int, *, device: torch.device | None = None
    ) -> torch.Tensor:
        """``[length]`` slot indices of a sequence's first ``length`` tokens given its block table."""
        table = torch.tensor(block_ids, dtype=torch.long)
        pos = torch.arange(length)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.to(device or self.keys[0].device)

    def copy_tokens(self, src_block: int, dst_block: int, count: int) -> None:
        """Copy the first ``count`` token slots of ``src_block`` into ``dst_block`` (every layer)."""
        s, d = src_block * self.block_size, dst_block * self.block_size
        for keys, values in zip(self.keys, self.values):
            keys[:, d : d + count] = keys[:, s : s + count]
            values[:, d : d + count] = values[:, s : s + count]

    def read(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)`` ``[1, kv_heads, len(slots), dim]`` in the layer's dtype (copies)."""
        slots = slots.to(self.keys[0].device)
        return [
            (kv_dtype.gather(k, slots, s.dtype).unsqueeze(0), kv_dtype.gather(v, slots, s.dtype).unsqueeze(0))
            for k, v, s in zip(self.keys, self.values, self.shapes)
        ]

    def write(self, slots: torch.Tensor, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write per-layer ``(keys, values)`` ``[1, kv_heads, len(slots), dim]`` into ``slots``."""
        slots = slots.to(self.keys[0].device)
        for (k, v), keys, values in zip(layers, self.keys, self.values):
            kv_dtype.put(keys, slots, k[0].to(keys.device))
            kv_dtype.put(values, slots, v[0].to(values.device))
