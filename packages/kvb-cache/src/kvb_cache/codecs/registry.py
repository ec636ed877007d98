"""Codecs by name and by ``kv_cache_bits``."""

from __future__ import annotations

import re

from kvb_cache.codecs.absmax import AbsmaxInt8Codec
from kvb_cache.codecs.base import KVCodec
from kvb_cache.codecs.dense import DenseCodec
from kvb_cache.codecs.kivi import KiviCodec
from kvb_cache.errors import ConfigError

_KIVI = re.compile(r"kivi(?P<bits>[48])-g(?P<group>\d+)")


def codec_for_bits(bits: int, group_size: int = 32) -> KVCodec:
    """The storage codec for ``kv_cache_bits``: 16 keeps KV as computed, 8 and 4 use KIVI."""
    if bits == 16:
        return DenseCodec()
    if bits in (8, 4):
        return KiviCodec(bits=bits, group_size=group_size)
    raise ConfigError(f"kv_cache_bits must be 16 (exact), 8 or 4 (KIVI quantized), got {bits!r}")


def codec_from_name(name: str) -> KVCodec:
    """The codec a record names (``"none"``, ``"absmax8"``, ``"kivi8-g32"``...)."""
    if name == DenseCodec.name:
        return DenseCodec()
    if name == AbsmaxInt8Codec.name:
        return AbsmaxInt8Codec()
    match = _KIVI.fullmatch(name)
    if match:
        return KiviCodec(bits=int(match["bits"]), group_size=int(match["group"]))
    raise ConfigError(f"unknown KV codec {name!r}; use 'none', 'absmax8' or 'kivi8-g<N>' / 'kivi4-g<N>'")
