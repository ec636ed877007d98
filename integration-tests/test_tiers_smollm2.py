"""Codecs and tiers on the embedded SmolLM2-135M: SNR on real KV, quantized agreement, disk restore."""

from __future__ import annotations

import pytest
import torch

from kvb_cache import EngineConfig, KVBoost, TierConfig
from kvb_cache.cache_kwarg import output_cache
from kvb_cache.codecs import AbsmaxInt8Codec, EncodedKV, KiviCodec, chunk_snr_db
from kvb_cache.kv import slice_kv
from kvb_cache.tiers.text import benchmark_token_ids


@pytest.fixture(scope="module")
def prompt_ids(smollm2) -> list[int]:
    return benchmark_token_ids(smollm2[1], 513)


@pytest.fixture(scope="module")
def real_kv(smollm2, prompt_ids):
    model, _ = smollm2
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids[:512]]), use_cache=True)
    return [slice_kv(output_cache(out), s, s + 128) for s in range(0, 512, 128)]


@pytest.mark.parametrize(
    ("codec", "min_db"),
    # Measured 51.0 / 26.4 / 48.9 / 46.9 dB on these chunks (docs/tiers.md); bounds leave ~1 dB.
    [
        (KiviCodec(bits=8), 50.0),
        (KiviCodec(bits=4), 25.5),
        (KiviCodec(bits=8, group_size=128), 48.0),
        (AbsmaxInt8Codec(), 45.0),
    ],
    ids=lambda c: getattr(c, "name", ""),
)
def test_codec_snr_on_real_kv(real_kv, codec, min_db):
    snrs = [chunk_snr_db(kv, EncodedKV.from_dense(codec, kv)) for kv in real_kv]
    assert min(snrs) >= min_db


def _prompts(tokenizer) -> list[list[int]]:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics) if len(topics[k]) > 3000][:12]
    return [tokenizer(t, add_special_tokens=False)["input_ids"][: 200 + 13 * i] for i, t in enumerate(texts)]


def test_int8_prefix_restored_from_disk_agrees_with_uncompressed(smollm2, tmp_path):
    """A writer engine stores the prefixes as int8 records; a fresh engine (empty RAM) restores them. Its
    next-token logits are quantized ones (they differ from no-cache's: a single engine would have served
    the exact pool and measured nothing) and pick the same top token on all 12 prompts."""
    model, tokenizer = smollm2
    config = EngineConfig(kv_cache_bits=8, tiers=TierConfig(disk_cache_dir=tmp_path))
    prompts = _prompts(tokenizer)
    writer = KVBoost(model, tokenizer, config=config)
    for ids in prompts:
        writer.warm(ids[:-1])
    writer.close()  # drains the write-behind queue
    reader = KVBoost(model, tokenizer, config=config)
    agree, largest = 0, 0.0
    for ids in prompts:
        got = reader.next_token_logits(ids)
        assert got.cached_tokens >= 128
        with torch.inference_mode():
            ref = model(torch.tensor([ids])).logits[0, -1]
        agree += int(got.logits.argmax() == ref.argmax())
        largest = max(largest, (got.logits - ref).abs().max().item())
    reader.close()
    assert agree == len(prompts)
    assert largest > 1e-3  # the restored KV went through the codec (the exact path is within 1e-4)


def test_disk_restore_of_a_512_token_prefix_is_exact(smollm2, prompt_ids, tmp_path):
    model, tokenizer = smollm2
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = KVBoost(model, tokenizer, config=EngineConfig(tiers=tiers))
    first.warm(prompt_ids[:512])
    first.close()  # drains the write-behind queue
    fresh = KVBoost(model, tokenizer, config=EngineConfig(tiers=tiers))  # empty RAM, as after a restart
    got = fresh.next_token_logits(prompt_ids[:513])
    with torch.inference_mode():
        ref = model(torch.tensor([prompt_ids[:513]])).logits[0, -1]
    assert got.cached_tokens == 512
    assert torch.allclose(got.logits, ref, atol=1e-4)
