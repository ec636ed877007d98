"""Seam repair for stitched KV: recompute a chosen subset of tokens over the assembled cache."""

from kvb_cache.repair.cacheblend import cacheblend_repair
from kvb_cache.repair.recompute import RecomputeLayout, recompute_tokens
from kvb_cache.repair.selective import selective_positions

__all__ = ["RecomputeLayout", "cacheblend_repair", "recompute_tokens", "selective_positions"]
