"""A prompt prepared for generation: its ids, chunk spans and the cache its reused prefix was assembled into."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import Cache

from kvb_cache.chunking import ChunkSpan
from kvb_cache.hashing import ChunkHash
from kvb_cache.results import ChunkHit

Prompt = str | Sequence[int]


@dataclass(slots=True, kw_only=True)
class PreparedPrompt:
    """A tokenized prompt with its cached prefix assembled into a cache, ready for prefill."""

    ids: list[int]
    spans: tuple[ChunkSpan, ...]
    #: A DynamicCache, or a :class:`kvb_cache.live_quant.LiveQuantizedCache` for ``kv_cache_bits`` 8/4.
    cache: Cache
    cached_tokens: int
    chunks: tuple[ChunkHit, ...]
    prefill_chunk_size: int | None = None
    #: Prompt tokens served from cache (exact + partial + stitched); None: ``cached_tokens``.
    reused_tokens: int | None = None
    #: Stitched tokens recomputed by seam repair.
    recomputed_tokens: int = 0
    #: Only ``ids[:exact_until]`` hold exact KV (a stitched request); None: all of them.
    exact_until: int | None = None
    #: Stitched prompt ranges ``(start, end)`` whose KV was copied from stored chunks (not recomputed).
    copied: tuple[tuple[int, int], ...] = ()
    #: A stitched document was held by fewer than ``StitchConfig.idle_copies`` copies (queue the prompt for
    #: idle time once computed: :mod:`kvb_cache.core.idle`).
    under_held: bool = False
    #: Chain root the prompt was looked up (and is stored) under: the request's salted root; None: the
    #: engine's unsalted root.
    root: ChunkHash | None = None

    @property
    def served_tokens(self) -> int:
        return self.cached_tokens if self.reused_tokens is None else self.reused_tokens

    def storable(self, seq: list[int]) -> list[int]:
        """The part of ``seq`` whose KV may be stored under prefix hashes (see :mod:`kvb_cache.stitching`)."""
        return seq if self.exact_until is None else seq[: self.exact_until]


@dataclass(frozen=True, slots=True, kw_only=True)
class NextTokenLogits:
    """``logits`` ``[V]`` for the token after a prompt, and how much of the prompt came from cache."""

    logits: torch.Tensor
    cached_tokens: int
    prompt_tokens: int
    #: Stitched tokens recomputed by seam repair.
    recomputed_tokens: int = 0
