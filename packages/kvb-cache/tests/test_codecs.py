"""KV codecs: exact grids, per-channel vs per-token grouping, packing, byte ratios, error bounds."""

from __future__ import annotations

import math

import pytest
import torch

from kvb_cache.codecs import (
    AbsmaxInt8Codec,
    DenseCodec,
    EncodedKV,
    KiviCodec,
    bytes_ratio,
    chunk_snr_db,
    codec_for_bits,
    codec_from_name,
    snr_db,
)
from kvb_cache.codecs.packing import pack_nibbles, unpack_nibbles
from kvb_cache.errors import ConfigError


def gaussian_kv(layers=2, heads=2, tokens=128, dim=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        (
            torch.randn(1, heads, tokens, dim, generator=g, dtype=dtype),
            torch.randn(1, heads, tokens, dim, generator=g, dtype=dtype),
        )
        for _ in range(layers)
    )


def test_dense_is_zero_copy_and_bit_exact():
    kv = gaussian_kv()
    enc = EncodedKV.from_dense(DenseCodec(), kv)
    k, v = enc.layer(1)
    assert k.data_ptr() == kv[1][0].data_ptr() and v.data_ptr() == kv[1][1].data_ptr()
    assert chunk_snr_db(kv, enc) == math.inf


@pytest.mark.parametrize("bits", [8, 4])
def test_kivi_reproduces_values_on_its_grid_exactly(bits):
    # Integers spanning exactly 2**bits - 1 steps from a negative minimum: scale 1, zero point -5.
    levels = (1 << bits) - 1
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, levels + 1, (1, 2, 64, 32), generator=g).float() - 5
    # Every key group (32 tokens of one channel) and value group (32 channels of one token) spans the grid.
    x[..., 0::32, :] = -5
    x[..., 1::32, :] = levels - 5
    x[..., :, 0] = -5
    x[..., :, 1] = levels - 5
    codec = KiviCodec(bits=bits, group_size=32)
    enc = EncodedKV.from_dense(codec, ((x, x.clone()),))
    k, v = enc.layer(0)
    assert torch.equal(k, x) and torch.equal(v, x)


def test_kivi_keys_are_grouped_per_channel_values_per_token():
    kv = gaussian_kv(layers=1)
    keys, values = kv[0]
    keys[..., 5] *= 100  # an outlier key channel (as RoPE produces)
    values[..., 7, :] *= 100  # an outlier value token
    enc = EncodedKV.from_dense(KiviCodec(bits=4, group_size=32), kv)
    k, v = enc.layer(0)
    # Per-channel key scales: the outlier channel does not inflate the error of the other channels.
    other = [c for c in range(64) if c != 5]
    assert snr_db(keys[..., other], k[..., other]) > 19
    # Per-token value scales: the outlier token does not inflate the error of the other tokens.
    rest = [t for t in range(128) if t != 7]
    assert snr_db(values[:, :, rest], v[:, :, rest]) > 19
    # The wire codec groups keys per channel too (head_dim tokens of one channel), values per token.
    wire = EncodedKV.from_dense(AbsmaxInt8Codec(), kv).layer(0)
    assert snr_db(keys[..., other], wire.keys[..., other]) > 40
    assert snr_db(values[:, :, rest], wire.values[:, :, rest]) > 40


@pytest.mark.parametrize(
    ("codec", "min_db", "max_db"),
    [
        (KiviCodec(bits=8), 42, 50),
        (KiviCodec(bits=4), 18, 24),
        (KiviCodec(bits=8, group_size=128), 40, 50),
        (AbsmaxInt8Codec(), 40, 48),
    ],
    ids=lambda c: getattr(c, "name", ""),
)
def test_snr_on_gaussian_kv_is_in_the_expected_band(codec, min_db, max_db):
    kv = gaussian_kv()
    snr = chunk_snr_db(kv, EncodedKV.from_dense(codec, kv))
    assert min_db < snr < max_db


@pytest.mark.parametrize(
    ("codec", "bits_per_element"),
    [
        (KiviCodec(bits=8, group_size=32), 9),
        (KiviCodec(bits=4, group_size=32), 5),
        (KiviCodec(bits=4, group_size=64), 4.5),
        (AbsmaxInt8Codec(), 8.25),
    ],
    ids=lambda c: getattr(c, "name", ""),
)
def test_bytes_against_fp16_include_scales_and_zero_points(codec, bits_per_element):
    kv = gaussian_kv(tokens=128, dim=64, dtype=torch.float16)
    assert bytes_ratio(kv, EncodedKV.from_dense(codec, kv)) == pytest.approx(bits_per_element / 16)


@pytest.mark.parametrize("tokens", [1, 5, 37, 128, 130])
@pytest.mark.parametrize(
    "codec", [KiviCodec(bits=8), KiviCodec(bits=4), AbsmaxInt8Codec()], ids=lambda c: c.name
)
def test_any_chunk_length_decodes_to_its_shape_and_dtype(tokens, codec):
    kv = gaussian_kv(layers=1, tokens=tokens, dtype=torch.bfloat16)
    k, v = EncodedKV.from_dense(codec, kv).layer(0)
    assert k.shape == v.shape == (1, 2, tokens, 64) and k.dtype == v.dtype == torch.bfloat16
    assert snr_db(kv[0][0], k) > (15 if codec.name.startswith("kivi4") else 35)


def test_nibble_packing_round_trips():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 16) and torch.equal(unpack_nibbles(packed), codes)
    assert packed[0, 0].item() == 0x10  # low nibble = even index, high nibble = odd index


def test_codecs_by_name_and_bits():
    assert codec_for_bits(16).name == "none"
    assert codec_for_bits(8, 64).name == "kivi8-g64"
    assert codec_for_bits(4).name == "kivi4-g32"
    for name in ("none", "absmax8", "kivi8-g32", "kivi4-g128"):
        assert codec_from_name(name).name == name
    with pytest.raises(ConfigError, match=r"16 .*8 or 4"):
        codec_for_bits(2)
    with pytest.raises(ConfigError, match="unknown KV codec"):
        codec_from_name("zstd")
    with pytest.raises(ValueError, match="group_size"):
        KiviCodec(bits=8, group_size=1)


@pytest.mark.parametrize("scale", [1e-6, 1e-9, 3e5])
@pytest.mark.parametrize(
    "codec", [KiviCodec(bits=8), KiviCodec(bits=4), AbsmaxInt8Codec()], ids=lambda c: c.name
)
def test_kv_beyond_fp16_range_keeps_its_snr(codec, scale):
    """Scales and zero points outside fp16's normal range are stored in fp32: at 3e5 an fp16 scale was inf
    (decoded NaN, every record refused); at 1e-6 a subnormal one decoded worse than zeros."""
    kv = tuple((k * scale, v * scale) for k, v in gaussian_kv(layers=1, tokens=37))
    encoded = EncodedKV.from_dense(codec, kv)
    k, v = encoded.layer(0)
    floor = 15 if codec.name.startswith("kivi4") else 35
    assert snr_db(kv[0][0], k) > floor and snr_db(kv[0][1], v) > floor
    # Ordinary magnitudes keep fp16 statistics (their bytes are what the docs count).
    plain = codec.encode(gaussian_kv(layers=1, tokens=37))
    assert all(t.dtype != torch.float32 for t in plain.values())


@pytest.mark.parametrize(
    "codec", [KiviCodec(bits=8), KiviCodec(bits=4), AbsmaxInt8Codec()], ids=lambda c: c.name
)
def test_non_finite_kv_is_refused_at_encode(codec):
    from kvb_cache.errors import NonFiniteLogitsError

    kv = gaussian_kv(layers=1, tokens=16)
    kv[0][1][0, 0, 3, 5] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN or inf"):
        codec.encode(kv)


def test_odd_codes_do_not_pack_and_odd_4bit_groups_are_refused():
    with pytest.raises(ValueError, match="must be even"):
        pack_nibbles(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="must be even"):
        KiviCodec(bits=4, group_size=5)
    with pytest.raises(ConfigError, match="8 or 4"):
        KiviCodec(bits=8.0)
    assert KiviCodec(bits=8, group_size=5).name == "kivi8-g5"  # 8-bit codes are not packed
