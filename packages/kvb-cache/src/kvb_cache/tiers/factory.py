"""Build the engine's store from its configuration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvb_cache.codecs import KVCodec, codec_for_bits, codec_from_name
from kvb_cache.config import EngineConfig
from kvb_cache.hashing import ChunkHash
from kvb_cache.records import RecordFormat
from kvb_cache.store import ChunkStore
from kvb_cache.tiers.disk import DiskTier
from kvb_cache.tiers.remote import RedisTier
from kvb_cache.tiers.tiered import LowerTier, TieredStore
from kvb_cache.tiers.writer import BackgroundWriter

if TYPE_CHECKING:
    from kvb_cache.core.kv_storage import LayerShape


def storage_codec(config: EngineConfig) -> KVCodec:
    """The codec chunks are held in (RAM and disk), from ``kv_cache_bits``."""
    return codec_for_bits(config.kv_cache_bits, config.kv_group_size)


def codec_label(config: EngineConfig) -> str:
    """What the model fingerprint records about codecs: every codec any tier stores KV in."""
    label = storage_codec(config).name
    tiers = config.tiers
    if tiers is not None and tiers.remote_codec is not None:
        label += f"+remote:{codec_from_name(tiers.remote_codec).name}"
    return label


def build_store(
    config: EngineConfig,
    *,
    fingerprint: str,
    root: ChunkHash,
    shapes: Sequence[LayerShape] | None = None,
) -> ChunkStore | TieredStore:
    """A plain RAM store for exact KV without tiers (the zero-overhead default), else a TieredStore.

    ``shapes`` (the model's per-layer KV shapes) makes the TieredStore drop promoted records of another KV
    layout as corrupt; without it no layout check runs until an engine given the store fills it in.
    """
    codec = storage_codec(config)
    tiers = config.tiers
    if codec.exact and (tiers is None or not tiers.enabled):
        return ChunkStore(config.max_cache_bytes)
    lower = lower_tiers(config, fingerprint=fingerprint)
    writer = BackgroundWriter(tiers.max_pending_writes if tiers is not None else 256)
    ram = ChunkStore(config.max_cache_bytes)
    store = TieredStore(ram, root=root, codec=codec, lower=lower, writer=writer, shapes=shapes)
    ram.on_evict = store.demote
    return store


def lower_tiers(config: EngineConfig, *, fingerprint: str) -> list[LowerTier]:
    """The disk and Redis tiers ``config.tiers`` asks for, in lookup order (fastest first)."""
    codec = storage_codec(config)
    tiers = config.tiers
    lower: list[LowerTier] = []
    if tiers is not None and tiers.disk_cache_dir is not None:
        disk = DiskTier(tiers.disk_cache_dir, namespace=fingerprint, max_bytes=tiers.disk_cache_bytes)
        lower.append(LowerTier(tier=disk, format=RecordFormat(fingerprint=fingerprint, codec=codec)))
    if tiers is not None and tiers.remote_url is not None:
        remote = RedisTier(
            tiers.remote_url,
            namespace=fingerprint,
            ttl_s=tiers.remote_ttl_s,
            timeout_s=tiers.remote_timeout_s,
        )
        remote.check_reachable()
        remote_codec = codec_from_name(tiers.remote_codec) if tiers.remote_codec else codec
        lower.append(LowerTier(tier=remote, format=RecordFormat(fingerprint=fingerprint, codec=remote_codec)))
    return lower
