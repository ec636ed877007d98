"""Recompute the KV of chosen prompt positions while every other position keeps its cached KV.

The math (one decoder layer ``l``, recomputed positions ``S``, all cached positions ``C``): the hidden states
of ``S`` enter layer ``l``; their fresh keys/values are written *into* the assembled cache at their indices
before attention, so each recomputed query at position ``p`` attends to every key at a position ``<= p``:
fresh ones for ``S``, cached ones for ``C``. Its output feeds layer ``l + 1``. Positions in ``C`` are never
queried, so their KV stays what the cache held. With ``S`` = everything this is an ordinary prefill.

We drive the model's *own* forward (embedding scaling, per-layer rotary tables, norms stay the model's)
with a duck-typed cache whose ``update`` scatters the fresh KV instead of appending it, and either of two
ways to mask attention: on full-attention models served by the engine's ``kvb_paged`` implementation, a
:class:`~kvb_cache.repair.rows.RowAttention` made current with ``row_call`` (each recomputed row attends only
the keys up to its position: the pass costs what it recomputes); otherwise (sliding-window and hybrid
layouts, a model without the engine's attention) a dense 4D mask built from positions (the models return
a 4D mask as-is).

Slicing (:class:`RecomputePass`): the positions may be recomputed in ascending slices with the same result
(up to float summation order). A recomputed row at ``p`` attends only keys at positions ``<= p``; the
earlier recomputed rows among them were written into every layer by the earlier slices, and the later ones
are never attended to. The engine loop runs a long repair one slice per step so it never stalls decoding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.core import kv_dtype
from kvb_cache.core.paged_attention import NAME as PAGED_ATTENTION
from kvb_cache.core.paged_attention import no_mask, row_call
from kvb_cache.repair.rows import RowAttention


class _StopForward(Exception):
    """Raised from the cache after the last wanted layer: the only way to run a prefix of an HF model's layers
    through its own forward (no public API stops early)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecomputeLayout:
    """How attention is masked for a model: sliding window and which layer kinds take which mask."""

    #: Window of sliding-attention layers (None: full attention everywhere).
    sliding_window: int | None = None
    #: True when full and sliding layers are mixed (Gemma 2/3): the model takes a mask per layer kind.
    hybrid: bool = False
    #: The block pool's ``kv_cache_dtype``: fresh KV is rounded to it before it is attended, as the engine
    #: loop writes a step's KV into the pool before attending (``"auto"``: kept as computed).
    kv_cache_dtype: str = "auto"

    @classmethod
    def for_model(
        cls, model: PreTrainedModel, sliding_window: int | None, kv_cache_dtype: str = "auto"
    ) -> RecomputeLayout:
        config = model.config.get_text_config(decoder=True)
        kinds = set(getattr(config, "layer_types", None) or ())
        return cls(
            sliding_window=sliding_window,
            hybrid=sliding_window is not None and len(kinds) > 1,
            kv_cache_dtype=kv_dtype.check_kv_cache_dtype(kv_cache_dtype),
        )


class _ScatterCache:
    """Stands in for a ``transformers.Cache`` during a recompute forward.

    Layer ``l`` holds the assembled keys/values ``[1, kv_heads, N, head_dim]`` (owned by the caller and
    written in place). ``update`` puts the fresh KV of the recomputed positions at ``index`` and returns the
    whole layer, so attention sees cached KV everywhere else.
    """

    is_compileable = False

    def __init__(
        self,
        layers: list[list[torch.Tensor]],
        index: torch.Tensor,
        *,
        last_layer: int | None,
        capture_layer: int | None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.layers_kv = layers
        self.index = index
        self.last_layer = last_layer
        self.capture_layer = capture_layer
        self.kv_cache_dtype = kv_cache_dtype
        #: ``[Q]`` squared L2 distance between fresh and cached KV at ``capture_layer``, per recomputed token.
        self.deviation: torch.Tensor | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # The extra arguments (``cache_kwargs``; ``kwargs=`` from transformers 5.24) carry nothing used here.
        if self.last_layer is not None and layer_idx > self.last_layer:
            raise _StopForward
        keys, values = self.layers_kv[layer_idx]
        # NOTE: in pool precision, as the loop attends a prompt it computes: positions before the first
        # stitched piece are registered as exact prefix blocks, whose hits must equal the same engine without
        # reuse (unrounded, fp8 hits were 0.13 off).
        key_states = kv_dtype.as_pool(key_states, self.kv_cache_dtype)
        value_states = kv_dtype.as_pool(value_states, self.kv_cache_dtype)
        if layer_idx == self.capture_layer:
            old_k, old_v = keys[:, :, self.index].float(), values[:, :, self.index].float()
            self.deviation = ((key_states.float() - old_k) ** 2).sum(dim=(0, 1, 3)) + (
                (value_states.float() - old_v) ** 2
            ).sum(dim=(0, 1, 3))
        keys[:, :, self.index] = key_states.to(keys.dtype)
        values[:, :, self.index] = value_states.to(values.dtype)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers_kv[layer_idx][0].shape[2]


def position_mask(
    positions: torch.Tensor, kv_length: int, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """Additive mask ``[1, 1, Q, kv_length]``: query at position ``p`` sees cache index ``j`` iff ``j <= p``
    (and ``j > p - window`` for sliding attention). Cache index equals position: the cache is contiguous."""
    keys = torch.arange(kv_length, device=positions.device)
    allowed = keys[None, :] <= positions[:, None]
    if window is not None:
        allowed &= keys[None, :] > positions[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _mask_for(layout: RecomputeLayout, positions: torch.Tensor, kv_length: int, dtype: torch.dtype):
    full = position_mask(positions, kv_length, dtype)
    if layout.sliding_window is None:
        return full
    sliding = position_mask(positions, kv_length, dtype, layout.sliding_window)
    return {"full_attention": full, "sliding_attention": sliding} if layout.hybrid else sliding


@torch.inference_mode()
def recompute_tokens(
    model: PreTrainedModel,
    layers: list[list[torch.Tensor]],
    ids: Sequence[int],
    positions: torch.Tensor,
    layout: RecomputeLayout,
    *,
    last_layer: int | None = None,
    capture_layer: int | None = None,
) -> torch.Tensor | None:
    """Recompute positions ``positions`` (``[Q]``, ascending) of the prompt ``ids`` in place in ``layers``.

    Args:
        layers: per layer ``[keys, values]``, each ``[1, kv_heads, N, head_dim]``, covering prompt positions
            ``[0, N)``; the recomputed positions are overwritten layer by layer.
        last_layer: stop after this layer (later layers keep their cached KV).
        capture_layer: measure each recomputed token's KV deviation from the cache on this layer.

    Returns:
        ``[Q]`` deviations when ``capture_layer`` is set, else None.
    """
    if positions.numel() == 0:
        return None
    device = layers[0][0].device
    positions = positions.to(device)
    tokens = torch.tensor([ids[p] for p in positions.tolist()], device=device).unsqueeze(0)
    cache = _ScatterCache(
        layers,
        positions,
        last_layer=last_layer,
        capture_layer=capture_layer,
        kv_cache_dtype=layout.kv_cache_dtype,
    )
    if layout.sliding_window is None and model.config._attn_implementation == PAGED_ATTENTION:
        attention = row_call(RowAttention(positions))
        mask = no_mask(device)
    else:
        attention = contextlib.nullcontext()
        mask = _mask_for(layout, positions, layers[0][0].shape[2], model.dtype)
    with contextlib.suppress(_StopForward), attention:
        # The base model: the LM head is not needed, only the KV the layers write.
        model.base_model(
            input_ids=tokens,
            position_ids=positions.unsqueeze(0),
            attention_mask=mask,
            **cache_kwargs(model.base_model, cache),
            use_cache=True,
        )
    return cache.deviation


class RepairWork(Protocol):
    """A repair that runs in slices: :class:`RecomputePass`, :class:`~kvb_cache.repair.CacheBlendRepair`."""

    @property
    def done(self) -> bool: ...

    def run(self, budget: int | None = None) -> int:
        """Recompute at most ``budget`` more positions (None: all that is left); returns how many ran."""
        ...


class RecomputePass:
    """:func:`recompute_tokens` over ``positions``, run in ascending slices (see the module docstring).

    Args:
        layers: per layer ``[keys, values]``, each ``[1, kv_heads, N, head_dim]`` (written in place).
        positions: prompt positions to recompute, each ``< N``; sorted here.
        last_layer, capture_layer: as for :func:`recompute_tokens`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layers: list[list[torch.Tensor]],
        ids: Sequence[int],
        positions: Sequence[int],
        layout: RecomputeLayout,
        *,
        last_layer: int | None = None,
        capture_layer: int | None = None,
    ) -> None:
        self.model = model
        self.layers = layers
        self.ids = ids
        self.positions = sorted(positions)
        self.layout = layout
        self.last_layer = last_layer
        self.capture_layer = capture_layer
        self.cursor = 0
        self._deviations: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return self.cursor >= len(self.positions)

    def run(self, budget: int | None = None) -> int:
        stop = len(self.positions) if budget is None else min(len(self.positions), self.cursor + budget)
        if stop <= self.cursor:
            return 0
        chunk = torch.tensor(self.positions[self.cursor : stop], dtype=torch.long)
        deviation = recompute_tokens(
            self.model,
            self.layers,
            self.ids,
            chunk,
            self.layout,
            last_layer=self.last_layer,
            capture_layer=self.capture_layer,
        )
        if deviation is not None:
            self._deviations.append(deviation)
        ran, self.cursor = stop - self.cursor, stop
        return ran

    def deviation(self) -> torch.Tensor | None:
        """``[len(positions)]`` deviations (``capture_layer`` set and every slice run), else None."""
        if not self._deviations:
            return None
        return torch.cat(self._deviations) if len(self._deviations) > 1 else self._deviations[0]
