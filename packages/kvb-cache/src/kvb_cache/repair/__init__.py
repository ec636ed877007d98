"""Seam repair for stitched KV: recompute a chosen subset of tokens over the assembled cache."""

from kvb_cache.repair.cacheblend import CacheBlendRepair
from kvb_cache.repair.recompute import RecomputeLayout, RecomputePass, RepairWork, recompute_tokens
from kvb_cache.repair.selective import selective_positions

__all__ = [
    "CacheBlendRepair",
    "RecomputeLayout",
    "RecomputePass",
    "RepairWork",
    "recompute_tokens",
    "selective_positions",
]
