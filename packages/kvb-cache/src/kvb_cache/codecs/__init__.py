"""KV codecs for stored chunks: dense passthrough, KIVI int8/int4, and the absmax int8 wire codec."""

from kvb_cache.codecs.absmax import AbsmaxInt8Codec
from kvb_cache.codecs.base import EncodedKV, KVCodec, LayerPair, TensorMap
from kvb_cache.codecs.dense import DenseCodec
from kvb_cache.codecs.kivi import KiviCodec
from kvb_cache.codecs.metrics import bytes_ratio, chunk_snr_db, snr_db
from kvb_cache.codecs.registry import codec_for_bits, codec_from_name

__all__ = [
    "AbsmaxInt8Codec",
    "DenseCodec",
    "EncodedKV",
    "KVCodec",
    "KiviCodec",
    "LayerPair",
    "TensorMap",
    "bytes_ratio",
    "chunk_snr_db",
    "codec_for_bits",
    "codec_from_name",
    "snr_db",
]
