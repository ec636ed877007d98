"""``CPUPagedEngine``: the seed's name for the engine loop over a paged block pool.

Every :class:`~kvb_cache.engine.KVBoost` is a paged engine now (on every device); this subclass keeps the
seed's constructor, which takes the pool's shape up front.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from kvb_cache.config import DEFAULT_MAX_CACHE_BYTES, EngineConfig
from kvb_cache.engine import KVBoost


class CPUPagedEngine(KVBoost):
    """A :class:`KVBoost` built from the pool's shape (``block_size``, ``num_blocks``)."""

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        model: str | PreTrainedModel,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
        block_size: int = 16,
        num_blocks: int | None = None,
        **options: Any,
    ) -> CPUPagedEngine:
        """Wrap a loaded model (its tokenizer from ``tokenizer`` or its ``name_or_path``) or load one by name.

        ``options`` are :meth:`KVBoost.from_pretrained` keywords when ``model`` is a name, or
        :class:`EngineConfig` fields when it is a loaded model.
        """
        if isinstance(model, str):
            engine = KVBoost.from_pretrained(
                model,
                max_cache_bytes=max_cache_bytes,
                block_size=block_size,
                num_blocks=num_blocks,
                **options,
            )
            engine.__class__ = cls
            return engine  # type: ignore[return-value]
        tok = tokenizer or AutoTokenizer.from_pretrained(model.config.name_or_path)
        config = EngineConfig(
            max_cache_bytes=max_cache_bytes, block_size=block_size, num_blocks=num_blocks, **options
        )
        return cls(model, tok, config=config)
