"""KVBoost's prefix cache as plain ``transformers`` caches, for code paths outside the engine loop.

Mixed into :class:`~kvb_cache.engine.KVBoost`. :meth:`HFCacheBridge.lookup_cache` copies the longest cached
prefix of a token sequence out of the engine's block pool (promoting blocks from disk/Redis on the way)
into a ``DynamicCache`` that plain ``model(...)`` / ``model.generate(...)`` calls continue;
:meth:`HFCacheBridge.store_cache` writes the KV such a call computed back into the pool, registered as full
blocks of the same prefix-hash chain the engine's own requests use, so the engine loop, the server and
other processes sharing the tiers hit it. See ``docs/composition.md``.

Only exact KV crosses this boundary: stitched (non-prefix) reuse stays inside the engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import transformers
from transformers import Cache, DynamicCache, PreTrainedModel

from kvb_cache.cache_kwarg import cache_argument
from kvb_cache.errors import InvalidRequestError, PromptTypeError
from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.pool_io import dense_cache, probe_request
from kvb_cache.request_checks import token_id_list
from kvb_cache.serialized import serialized

if TYPE_CHECKING:
    from kvb_cache.core.kv_manager import KVCacheManager
    from kvb_cache.hashing import ChunkHash
    from kvb_cache.writeback import WritebackResult

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCache:
    """What :meth:`HFCacheBridge.lookup_cache` found for a token sequence.

    Attributes:
        cache: a ``DynamicCache`` holding the KV of ``token_ids[:cached_tokens]`` (per layer
            ``[1, kv_heads, cached_tokens, head_dim]``; sliding-window layers keep their last window),
            on the model's device and in its dtype. A private copy: generating into it never touches the pool.
        cached_tokens: how many leading tokens of ``token_ids`` it covers (0 on a miss).
        token_ids: the sequence that was looked up.
        device: the model's device (where :meth:`generate_inputs` puts its tensors).
        cache_argument: the keyword the model takes a cache under: ``cache`` from transformers 5.24,
            ``past_key_values`` before (see :mod:`kvb_cache.cache_kwarg`).
    """

    cache: DynamicCache
    cached_tokens: int
    token_ids: tuple[int, ...]
    device: torch.device
    cache_argument: str = "past_key_values"

    @property
    def remaining_ids(self) -> list[int]:
        """The tokens still to feed after the cache (never empty with the default ``min_uncached=1``)."""
        return list(self.token_ids[self.cached_tokens :])

    def generate_inputs(self, *, suffix_only: bool = False) -> dict[str, torch.Tensor | DynamicCache]:
        """Keyword arguments for ``model.generate(**hit.generate_inputs(), ...)``.

        Args:
            suffix_only: False (default): ``input_ids`` is the whole sequence ``[1, S]``, so logits processors,
                stopping criteria and streamers see the prompt exactly as without a cache. True: ``input_ids``
                is only :attr:`remaining_ids` with an ``attention_mask`` over the whole sequence, the form
                ``generate`` reads as "the cache holds the rest"; needed for assisted generation
                (``assistant_model=`` / ``prompt_lookup_num_tokens=``) on transformers 5.x, whose assisted
                loop feeds the whole ``input_ids`` on its first step whatever the cache holds (the output
                then starts with the suffix, and the assistant and processors see only the suffix).

        Returns:
            ``input_ids`` ``[1, n]``, ``attention_mask`` ``[1, S]`` (ones) and the cache (under
            :attr:`cache_argument`).
        """
        if suffix_only and not assisted_decoding_resumes_exactly():
            warnings.warn(
                f"transformers {transformers.__version__}'s assisted decoding (assistant_model=, "
                "prompt_lookup_num_tokens=) from a prefilled cache gives other tokens than without one (a "
                "transformers bug fixed in 5.18): upgrade transformers, or generate without the cache",
                stacklevel=2,
            )
        ids = self.remaining_ids if suffix_only else list(self.token_ids)
        return {
            "input_ids": torch.tensor([ids], dtype=torch.long, device=self.device),
            "attention_mask": torch.ones((1, len(self.token_ids)), dtype=torch.long, device=self.device),
            self.cache_argument: self.cache,
        }


def assisted_decoding_resumes_exactly() -> bool:
    """Whether this transformers' assisted decoding continues a prefilled cache exactly (5.18 and later)."""
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 18)


class HFCacheBridge:
    """Prefix-cache lookups and stores in ``transformers`` ``Cache`` form (see the module docstring)."""

    kv: KVCacheManager
    model: PreTrainedModel

    if TYPE_CHECKING:  # provided by KVBoost and CacheTransfers; declared here for type checkers only

        def _salted_root(self, cache_salt: object) -> ChunkHash | None: ...

        def _check_model_unmoved(self) -> None: ...

        def store_sequence(
            self, ids: Sequence[int], cache: Cache, *, root: ChunkHash | None = None
        ) -> WritebackResult: ...

    @serialized
    def lookup_cache(
        self,
        token_ids: TokenIds,
        *,
        cache_salt: str | None = None,
        min_uncached: int = 1,
        full_layers: bool = False,
    ) -> PrefixCache:
        """The longest cached prefix of ``token_ids`` as a prefilled ``DynamicCache``.

        Feed it with the *whole* sequence: ``model.generate(input_ids, **cache_kwargs(model, hit.cache))``
        (:func:`kvb_cache.cache_kwarg.cache_kwargs`: ``cache=`` on transformers >= 5.24, else
        ``past_key_values=``) runs only ``input_ids[:, hit.cached_tokens:]`` through the model. An exact hit gives the same logits as
        no cache (fp32: within 1e-5). Assisted generation needs the suffix-only form instead
        (:meth:`PrefixCache.generate_inputs`).

        Args:
            token_ids: ``[S]`` ids (a list, or a 1-D or ``[1, S]`` tensor such as a tokenizer's
                ``input_ids``).
            cache_salt: the tenant whose chain to search (the engine's requests' ``cache_salt``); only KV
                stored under the same salt is found.
            min_uncached: leave at least this many trailing tokens uncached. The default 1 is what
                ``generate`` needs (it must feed one token to get the first logits), so a fully cached
                sequence comes back with ``cached_tokens == len(token_ids) - 1``. 0 returns all of it (for
                callers that only want the KV).
            full_layers: build every layer as a full ``DynamicLayer`` holding every position, even on
                sliding-window models (the model still masks its window, so outputs are the same). Needed
                to :meth:`store_cache` the cache a sliding-window model grew past its window; costs memory
                beyond the window. Default: the layer types ``DynamicCache(config=model.config)`` builds,
                as ``generate`` would.

        Raises:
            PromptTypeError: ``token_ids`` is not a sequence of ints or a 1-D / ``[1, S]`` tensor.
            InvalidRequestError: empty ``token_ids``, ids outside the vocabulary, a bad ``cache_salt`` or
                ``min_uncached``.
        """
        self._check_model_unmoved()  # KV of the old dtype/device would be handed to the moved model
        ids = self._bridge_ids(token_ids)
        root = self._salted_root(cache_salt)
        if isinstance(min_uncached, bool) or not isinstance(min_uncached, int) or min_uncached < 0:
            raise InvalidRequestError(
                f"min_uncached must be an int >= 0 (1 for generate), got {min_uncached!r}",
                param="min_uncached",
            )
        probe = probe_request(ids, root=root)
        hit = self.kv.admit(probe, max_tokens=max(len(ids) - min_uncached, 0))
        try:
            # storage.read gathers: the layers are copies, so the caller may grow or crop them freely.
            layers = self.kv.storage.read(self.kv.slots(probe, hit.tokens)) if hit.tokens else None
        finally:
            self.kv.free(probe)
        return PrefixCache(
            cache=self._hf_cache(layers, full_layers=full_layers),
            cached_tokens=hit.tokens,
            token_ids=tuple(ids),
            device=self.model.device,
            cache_argument=cache_argument(self.model) or "past_key_values",
        )

    @serialized
    def store_cache(self, token_ids: TokenIds, cache: Cache, *, cache_salt: str | None = None) -> int:
        """Store the KV ``cache`` holds for ``token_ids`` in the engine's block pool.

        ``cache`` must hold this model's KV of ``token_ids`` at positions ``0..`` of batch row 0, as a
        forward or ``generate`` over them left it (a hit's cache after ``generate``: pass
        ``out.sequences[0]`` and the cache; the last generated token, never fed, is simply not stored). Full
        blocks are registered in the prefix-hash chain of ``cache_salt`` (the engine's requests with that salt
        then hit them) and written behind to the disk/Redis tiers when configured; a partial last block is kept
        as a token-granular tail. Blocks already cached are not rewritten.

        The caller vouches for the KV: a cache from another model or another history would be served to later
        exact hits of this prefix. Keep untrusted callers apart with ``cache_salt``.

        Returns:
            How many leading tokens of ``token_ids`` the pool now holds, counting a prefix that was cached
            before (0 when caching is off; only what was already cached when the pool has no free block).

        Raises:
            PromptTypeError: ``token_ids`` is not ids, or ``cache`` is not a ``transformers.Cache``.
            InvalidRequestError: ``cache`` does not fit this model (layer count, batch, heads, dtype), lacks
                positions (a sliding-window or quantized layer dropped them), or ``cache_salt`` is bad.
        """
        ids = self._bridge_ids(token_ids)
        root = self._salted_root(cache_salt)
        if isinstance(cache, Cache) and cache.get_seq_length() == 0:
            # Nothing to store: the empty cache of a lookup_cache miss (its layers hold no tensors yet) handed
            # back, a natural round trip, was a 400.
            return 0
        dense = self._dense_layers(cache)
        length = min(len(ids), dense[0][0].shape[2])
        if length == 0 or not self.kv.caching:
            return 0
        self.store_sequence(ids[:length], dense_cache(dense), root=root)
        return self._cached_len(ids[:length], root)

    # ----------------------------------------------------------------------------------- internals
    def _bridge_ids(self, token_ids: object) -> list[int]:
        if isinstance(token_ids, (str, bytes)):
            raise PromptTypeError(
                f"token_ids must be a list of token ids, got {type(token_ids).__name__}; "
                "tokenize text with engine.tokenizer first",
                param="token_ids",
            )
        # A list or tuple (numpy ints too), or a 1-D / [1, S] integer tensor or array, as generate takes.
        ids = token_id_list(token_ids, param="token_ids")
        if not ids:
            raise InvalidRequestError("token_ids is empty; pass at least one token", param="token_ids")
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="token_ids")
        return ids

    def _hf_cache(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None, *, full_layers: bool
    ) -> DynamicCache:
        if full_layers:
            return dense_cache(layers) if layers is not None else DynamicCache()
        return DynamicCache(layers, config=self.model.config)

    def _dense_layers(self, cache: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``cache``'s per-layer ``(keys, values)`` ``[1, kv_heads, seq, dim]``, checked against the pool and
        moved to its device (views where nothing moves)."""
        if not isinstance(cache, Cache):
            raise PromptTypeError(
                f"cache must be a transformers Cache (e.g. DynamicCache), got {type(cache).__name__}",
                param="cache",
            )
        storage = self.kv.storage
        layers = own_kv_layers(cache)
        if len(layers) != storage.num_layers:
            raise InvalidRequestError(
                f"cache has {len(layers)} layers, the model {storage.num_layers}; pass a cache this "
                "model filled",
                param="cache",
            )
        out = []
        for i, (layer, pool_k, shape) in enumerate(zip(layers, storage.keys, storage.shapes)):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
                raise InvalidRequestError(
                    f"cache layer {i} holds no dense KV tensors (empty, or a layer type the pool cannot read); "
                    "pass a DynamicCache that a forward over token_ids filled",
                    param="cache",
                )
            held, seen = keys.shape[2], layer.get_seq_length()
            if seen > held:
                raise InvalidRequestError(
                    f"cache layer {i} ({type(layer).__name__}) holds {held} of its {seen} positions (a sliding "
                    "window or a quantized layer dropped the rest); the pool needs every position. Look the "
                    "prefix up with lookup_cache(..., full_layers=True) or pass DynamicCache() to generate",
                    param="cache",
                )
            if keys.shape[0] != 1:
                raise InvalidRequestError(
                    f"cache has batch size {keys.shape[0]}; store one sequence at a time (batch row 0)",
                    param="cache",
                )
            if keys.shape[1] != pool_k.shape[0] or keys.shape[3] != pool_k.shape[2]:
                raise InvalidRequestError(
                    f"cache layer {i} has {keys.shape[1]} kv heads of {keys.shape[3]} channels, the model "
                    f"{pool_k.shape[0]} of {pool_k.shape[2]}; pass a cache this model filled",
                    param="cache",
                )
            if keys.dtype != shape.dtype:
                raise InvalidRequestError(
                    f"cache dtype {keys.dtype} differs from the model's KV dtype {shape.dtype}; exact hits "
                    "need KV computed in the model's own dtype",
                    param="cache",
                )
            # Positions past get_seq_length() (a StaticCache's unused tail) are not KV.
            keys, values = keys[:, :, :seen], values[:, :, :seen]
            out.append((keys.to(pool_k.device), values.to(pool_k.device)))
        if len({k.shape[2] for k, _ in out}) != 1:
            raise InvalidRequestError(
                "cache layers hold different lengths; pass the cache of one finished forward", param="cache"
            )
        return out

    def _cached_len(self, ids: list[int], root: ChunkHash | None) -> int:
        """Leading tokens of ``ids`` the pool holds now: full blocks by hash, then a tail indexed after them
        (read only: nothing is shared, copied or counted)."""
        probe = probe_request(ids, root=root)
        full = self.kv.cached_prefix_len(probe, len(ids))
        rest = ids[full:]
        if not rest or not self.kv.store_partial_tail:
            return full
        blocks = full // self.kv.block_size
        parent = probe.block_hashes[blocks - 1] if blocks else self.kv.root_of(probe)
        tail = self.kv.pool.longest_child(parent, rest)[1]
        return full + min(tail, len(rest))
