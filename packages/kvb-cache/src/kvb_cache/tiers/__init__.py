"""Cache tiers below RAM (disk, Redis) and the store that composes them."""

from kvb_cache.tiers.base import RecordTier, TierStats
from kvb_cache.tiers.config import DEFAULT_DISK_CACHE_BYTES, DEFAULT_REMOTE_TIMEOUT_S, TierConfig
from kvb_cache.tiers.disk import DiskTier
from kvb_cache.tiers.factory import build_store, codec_label, storage_codec
from kvb_cache.tiers.remote import RedisTier
from kvb_cache.tiers.tiered import LowerTier, TieredStore
from kvb_cache.tiers.writer import BackgroundWriter

__all__ = [
    "DEFAULT_DISK_CACHE_BYTES",
    "DEFAULT_REMOTE_TIMEOUT_S",
    "BackgroundWriter",
    "DiskTier",
    "LowerTier",
    "RecordTier",
    "RedisTier",
    "TierConfig",
    "TierStats",
    "TieredStore",
    "build_store",
    "codec_label",
    "storage_codec",
]
