"""``kvboost.KVBoost``: the kvb-cache engine, with ``from_pretrained`` composing the optional parts.

The engine class is kvb_cache's own; this subclass only adds the arguments whose providers live in
sibling distributions. kvb_cache defines the speculative-decoding protocol its engine calls
(:class:`kvb_cache.decoding.SpeculativeDecoder`); kvb_speculative satisfies it without importing
kvb_cache, and this module is where the two meet.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import PreTrainedModel

from kvb_cache import KVBoost as _Engine
from kvb_cache import StitchConfig
from kvb_cache.config import DEFAULT_MAX_CACHE_BYTES
from kvb_cache.loading import load_model_and_tokenizer
from kvb_cache.tiers import DEFAULT_DISK_CACHE_BYTES


class KVBoost(_Engine):
    """:class:`kvb_cache.KVBoost` plus speculative decoding (kvb-speculative) in ``from_pretrained``."""

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model_name_or_path: str,
        *,
        chunk_size: int = 128,
        boundary_window: int = 0,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        attn_implementation: str | None = None,
        kv_cache_bits: int = 16,
        kv_group_size: int = 32,
        disk_cache_dir: str | os.PathLike[str] | None = None,
        disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
        remote_url: str | None = None,
        remote_codec: str | None = None,
        stitching: StitchConfig | None = None,
        recompute_strategy: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 1024,
        speculative: str | None = None,
        draft_model: str | PreTrainedModel | None = None,
        gamma: int = 5,
    ) -> KVBoost:
        """Load a model and wrap it; the cache arguments are :meth:`kvb_cache.KVBoost.from_pretrained`'s.

        Args:
            speculative: ``"prompt_lookup"`` (n-gram drafts copied from the prompt: no extra model) or
                ``"draft_model"``; None turns speculative decoding off unless ``draft_model`` is given.
                Greedy and sampled outputs stay exactly those of plain decoding (kvb-speculative's
                verification is exact); requests asking for ``logprobs`` decode plainly.
            draft_model: a small model sharing the target's vocabulary: a loaded model, or a folder / hub
                id in the local cache, loaded on the same device and dtype as the target.
            gamma: the most drafted tokens verified per target forward.

        Raises:
            kvb_speculative.SpeculativeConfigError: an unknown ``speculative`` mode or an inconsistent setting.
            kvb_speculative.VocabularyMismatchError: the draft model's vocabulary differs from the target's.
        """
        engine = super().from_pretrained(
            model_name_or_path,
            chunk_size=chunk_size,
            boundary_window=boundary_window,
            max_cache_bytes=max_cache_bytes,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            kv_cache_bits=kv_cache_bits,
            kv_group_size=kv_group_size,
            disk_cache_dir=disk_cache_dir,
            disk_cache_bytes=disk_cache_bytes,
            remote_url=remote_url,
            remote_codec=remote_codec,
            stitching=stitching,
            recompute_strategy=recompute_strategy,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        if speculative is None and draft_model is None:
            return engine  # type: ignore[return-value]
        from kvb_speculative import make_decoder

        draft_tokenizer = None
        if isinstance(draft_model, str):
            loaded = load_model_and_tokenizer(
                draft_model,
                device=engine.device,
                dtype=engine.model.dtype,
                attn_implementation=attn_implementation,
            )
            draft_model, draft_tokenizer = loaded.model, loaded.tokenizer
        engine.drafter = make_decoder(
            engine.model,
            speculative=speculative,
            draft_model=draft_model,
            gamma=gamma,
            target_tokenizer=engine.tokenizer,
            draft_tokenizer=draft_tokenizer,
        )
        return engine  # type: ignore[return-value]

    def speculative_stats(self) -> dict[str, Any] | None:
        """Drafted / accepted tokens, acceptance rate and timings since load; None without a drafter."""
        stats = getattr(self.drafter, "speculative_stats", None)
        return stats().as_dict() if stats is not None else None

    def cache_stats(self) -> dict[str, Any]:
        """:meth:`kvb_cache.KVBoost.cache_stats` plus ``"speculative"`` when a drafter is set."""
        stats = super().cache_stats()
        speculative = self.speculative_stats()
        if speculative is not None:
            stats["speculative"] = speculative
        return stats
