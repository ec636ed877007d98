"""The in-memory chunk store and its eviction policy."""

from kvb_cache.store.entry import ChunkEntry, LayerKV
from kvb_cache.store.eviction import EvictionPolicy, FrequencyRecencyPolicy
from kvb_cache.store.ram import ChunkStore, StoreStats

__all__ = ["ChunkEntry", "ChunkStore", "EvictionPolicy", "FrequencyRecencyPolicy", "LayerKV", "StoreStats"]
