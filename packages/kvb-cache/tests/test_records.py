"""Chunk records: full round trip of every field, and every kind of bad record rejected."""

from __future__ import annotations

import pytest
import torch

from kvb_cache.codecs import AbsmaxInt8Codec, DenseCodec, KiviCodec
from kvb_cache.hashing import ChunkHash, content_hash, prefix_hash, root_hash
from kvb_cache.records import MAGIC, RecordError, RecordFormat, decode_record, encode_record
from kvb_cache.store import ChunkEntry
from kvb_cache.tiers.transcode import with_codec

FINGERPRINT = "f" * 64
ROOT = root_hash(FINGERPRINT)


def make_entry(
    tokens=(5, 6, 7, 8), parent: ChunkHash = ROOT, start=0, complete=True, dtype=torch.float32
) -> ChunkEntry:
    g = torch.Generator().manual_seed(len(tokens) + start)
    kv = tuple(
        (
            torch.randn(1, 2, len(tokens), 16, generator=g).to(dtype),
            torch.randn(1, 2, len(tokens), 16, generator=g).to(dtype),
        )
        for _ in range(3)
    )
    return ChunkEntry(
        key=prefix_hash(parent, tokens),
        parent=parent,
        content=content_hash(ROOT, tokens),
        token_ids=tuple(tokens),
        kv=kv,
        start=start,
        complete=complete,
    )


def fmt(codec=None, fingerprint=FINGERPRINT) -> RecordFormat:
    return RecordFormat(fingerprint=fingerprint, codec=codec or DenseCodec())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_record_round_trips_every_field_bit_exactly(dtype):
    first = make_entry()
    entry = make_entry(tokens=(9, 10, 11), parent=first.key, start=4, complete=False, dtype=dtype)
    back = decode_record(encode_record(entry, fmt()), fmt())
    assert (back.key, back.parent, back.content, back.token_ids, back.start, back.complete) == (
        entry.key,
        first.key,
        entry.content,
        (9, 10, 11),
        4,
        False,
    )
    assert back.encoded is None and len(back.kv) == 3
    for (k, v), (k2, v2) in zip(entry.kv, back.kv):
        assert k2.dtype == dtype and torch.equal(k, k2) and torch.equal(v, v2)


def test_quantized_record_keeps_the_encoded_form():
    codec = KiviCodec(bits=4, group_size=32)
    held = with_codec(make_entry(), codec)
    back = decode_record(encode_record(held, fmt(codec)), fmt(codec))
    assert back.kv == () and back.encoded is not None and back.nbytes == held.nbytes
    for i in range(3):
        assert torch.equal(back.layer(i)[0], held.layer(i)[0]) and torch.equal(
            back.layer(i)[1], held.layer(i)[1]
        )


def test_record_encodes_dense_entry_into_the_tier_codec():
    codec = KiviCodec(bits=8, group_size=32)
    entry = make_entry()
    back = decode_record(encode_record(entry, fmt(codec)), fmt(codec))
    assert back.encoded.codec.name == "kivi8-g32"
    k, _ = back.layer(0)
    assert (k - entry.kv[0][0]).abs().max() < 0.05


def test_every_single_byte_flip_is_detected():
    data = bytearray(encode_record(make_entry(), fmt()))
    for offset in range(len(MAGIC), len(data), max(1, len(data) // 97)):
        bad = bytearray(data)
        bad[offset] ^= 0x01
        with pytest.raises(RecordError):
            decode_record(bytes(bad), fmt())


@pytest.mark.parametrize("cut", [0, 7, 40, 100, -1])
def test_truncated_records_are_rejected(cut):
    data = encode_record(make_entry(), fmt())
    with pytest.raises(RecordError):
        decode_record(data[:cut], fmt())


def test_other_fingerprint_or_codec_is_rejected():
    data = encode_record(make_entry(), fmt())
    with pytest.raises(RecordError, match="fingerprint"):
        decode_record(data, fmt(fingerprint="0" * 64))
    with pytest.raises(RecordError, match="codec"):
        decode_record(data, fmt(KiviCodec(bits=8)))


def test_record_whose_key_does_not_hash_from_its_tokens_is_rejected():
    entry = make_entry()
    forged = ChunkEntry(
        key=prefix_hash(ROOT, (1, 2, 3, 4)),
        parent=ROOT,
        content=entry.content,
        token_ids=entry.token_ids,
        kv=entry.kv,
        start=0,
    )
    with pytest.raises(RecordError, match="does not hash"):
        decode_record(encode_record(forged, fmt()), fmt())


def test_record_is_not_a_pickle():
    data = encode_record(make_entry(), fmt())
    assert data.startswith(MAGIC) and b"\x80\x04" not in data[:64]
    header_len = int.from_bytes(data[40:48], "little")
    assert data[48:49] == b"{" and b'"fingerprint":"' + FINGERPRINT.encode() in data[48 : 48 + header_len]


def _forge(data: bytes, mutate) -> bytes:
    """A record rewritten by someone else: fields changed by ``mutate(tensors, metadata)``, checksum valid."""
    import hashlib
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    blob = data[len(MAGIC) + 32 :]
    meta = dict(json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"])
    tensors = st_load(blob)
    mutate(tensors, meta)
    forged = st_save(tensors, metadata=meta)
    return MAGIC + hashlib.sha256(forged).digest() + forged


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t, m: m.update(num_layers="x"),
        lambda t, m: m.update(num_layers="0"),
        lambda t, m: m.pop("start"),
        lambda t, m: m.update(key="zz"),
        lambda t, m: t.update(__token_ids__=t["__token_ids__"].float()),
        lambda t, m: m.update(start="-5"),
        lambda t, m: m.update(start=str(10**30)),
    ],
    ids=[
        "layers-not-int",
        "zero-layers",
        "no-start",
        "key-not-hex",
        "float-token-ids",
        "start<0",
        "start-huge",
    ],
)
def test_well_checksummed_record_with_malformed_fields_is_a_record_error(mutate):
    # The checksum only says the bytes are those written: a record written by another program (or version)
    # into a shared Redis has a valid one. Its malformed fields raised ValueError / KeyError / TypeError,
    # which the tiers (catching RecordError) let escape into the request.
    data = _forge(encode_record(make_entry(), fmt()), mutate)
    with pytest.raises(RecordError):
        decode_record(data, fmt())


@pytest.mark.parametrize(
    ("codec", "mutate"),
    [
        (
            KiviCodec(bits=8),
            lambda t: t.update(
                {
                    "0.k.q": torch.zeros(300, 1, 1, dtype=torch.uint8),
                    "0.k.scale": torch.ones(1, 300, 1, dtype=t["0.k.scale"].dtype),
                    "0.k.min": torch.zeros(1, 1, 300, dtype=t["0.k.min"].dtype),
                }
            ),
        ),
        (
            KiviCodec(bits=4),
            lambda t: t.update({"1.v.scale": torch.ones(1, 2, 4, 16, 16, dtype=t["1.v.scale"].dtype)}),
        ),
        (
            AbsmaxInt8Codec(),
            lambda t: t.update(
                {"0.v.q": torch.zeros(3000, 1, dtype=torch.int8), "0.v.scale": torch.ones(1, 3000)}
            ),
        ),
    ],
    ids=["kivi8-cube", "kivi4-scale-wider-than-codes", "absmax-square"],
)
def test_forged_quantized_record_cannot_broadcast_into_a_larger_tensor(codec, mutate):
    """A forged record's codes and scales broadcast into N**2-N**3 floats (300**3 here: 108 MB from ~1 KB;
    the audit's N=1500 wanted 13.5 GB) before the decoded KV's shape was checked: refused while decoding,
    with nothing larger than the codes allocated."""
    from kvb_cache.core.kv_storage import LayerShape
    from kvb_cache.records import checked_kv

    encoded = with_codec(make_entry(), codec)
    data = _forge(encode_record(encoded, fmt(codec)), lambda t, m: mutate(t))
    entry = decode_record(data, fmt(codec))
    shapes = [LayerShape(kv_heads=2, key_dim=16, value_dim=16, dtype=torch.float32)] * 3
    with pytest.raises(RecordError, match="do not fit"):
        checked_kv(entry, shapes)


def test_dense_tensors_in_another_dtype_than_the_record_names_are_rejected():
    """A well-checksummed record labelled fp32 holding fp16 KV (another program writing a shared folder or
    Redis) was upcast and served as an exact hit, 3e-3 off no-cache (an audit, 2026-12-01)."""
    import hashlib
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    data = encode_record(make_entry(), fmt())
    blob = data[len(MAGIC) + 32 :]
    meta = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    assert "float32" in meta["dtype"]
    halved = {n: t if n.startswith("__") else t.half() for n, t in st_load(blob).items()}
    forged = st_save(halved, metadata=meta)
    with pytest.raises(RecordError, match="dtype"):
        decode_record(MAGIC + hashlib.sha256(forged).digest() + forged, fmt())
    assert decode_record(data, fmt()).kv[0][0].dtype == torch.float32  # the honest record still reads
