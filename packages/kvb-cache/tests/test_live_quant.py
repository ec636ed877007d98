"""Per-request ``kv_cache_bits``: the live KV held KIVI-quantized through transformers' QuantizedLayer."""

from __future__ import annotations

import pytest
import torch
from conftest import PATH_ARCHITECTURES, make_model, words

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost
from kvb_cache.cache_kwarg import cache_kwargs, output_cache
from kvb_cache.codecs import snr_db
from kvb_cache.live_quant import (
    KiviLiveLayer,
    LiveQuantizedCache,
    cache_kv_bytes,
    is_live_quantized,
    layer_kv,
    quantize_live,
)

CHUNK = 16
NEW = 12


def reference_greedy(model, ids: list[int], n: int = NEW) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def kv(tokens: int, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, 2, tokens, 16, generator=g)
    keys[..., 3] *= 8  # an outlier channel, as RoPE'd keys have
    return keys, torch.randn(batch, 2, tokens, 16, generator=g)


def capture_caches(engine: KVBoost) -> list:
    """Record every working cache the engine hands to ``store_sequence`` (the cache a request ran on)."""
    seen: list = []
    original = engine.store_sequence

    def spy(ids, cache, **kw):
        seen.append(cache)
        return original(ids, cache, **kw)

    engine.store_sequence = spy  # type: ignore[method-assign]
    return seen


# ----------------------------------------------------------------------------------------- the layer
# Bytes of 200 quantized tokens ([1, 2 heads, T, 16]) + a 100-token fp32 residual window (25,600 B). Keys: T padded
# to 4 groups of 64 -> 256 * 32 codes * bits / 8 + 2 fp16 (scale, min) * 4 groups * 32 channels; values: one
# group of 16 channels per token (16 does not divide by 64) -> 200 * 32 * bits / 8 + 2 fp16 * 200 tokens * 2 heads.
EXPECTED_BYTES = {8: 8192 + 512 + 6400 + 1600 + 25_600, 4: 4096 + 512 + 3200 + 1600 + 25_600}


@pytest.mark.parametrize(("bits", "min_snr"), [(8, 35.0), (4, 12.0)])
def test_layer_holds_quantized_kv_and_returns_it_dense(bits, min_snr):
    keys, values = kv(300)
    layer = KiviLiveLayer(bits=bits)
    layer.update(keys[:, :, :200], values[:, :, :200])  # first update: everything quantized
    layer.update(keys[:, :, 200:], values[:, :, 200:])
    assert layer.get_seq_length() == 300
    dense_k, dense_v = layer.dense()
    assert dense_k.shape == keys.shape and dense_v.shape == values.shape
    assert snr_db(keys, dense_k) > min_snr and snr_db(values, dense_v) > min_snr
    assert layer.nbytes == EXPECTED_BYTES[bits]  # against 76,800 B of fp32 K and V


def test_layer_crop_and_batch_select():
    keys, values = kv(150, batch=3)
    layer = KiviLiveLayer(bits=8)
    layer.update(keys[:, :, :140], values[:, :, :140])
    layer.update(keys[:, :, 140:], values[:, :, 140:])  # 10 tokens in the full-precision residual window
    before_k, _ = layer.dense()
    layer.crop(-4)  # inside the residual window: exact
    assert layer.get_seq_length() == 146
    torch.testing.assert_close(layer.dense().keys, before_k[:, :, :146], rtol=0, atol=0)
    layer.crop(-40)  # into the quantized part: re-quantized from dequantized values
    assert layer.get_seq_length() == 106
    assert snr_db(keys[:, :, :106], layer.dense().keys) > 35
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)
    rows_before = layer.dense()
    layer.batch_select_indices(torch.tensor([2, 0]))
    torch.testing.assert_close(layer.dense().keys, rows_before.keys[[2, 0]], rtol=0, atol=0)
    torch.testing.assert_close(layer.dense().values, rows_before.values[[2, 0]], rtol=0, atol=0)


def test_quantize_live_keeps_the_source_and_layer_kv_is_identity_for_dense():
    from transformers import DynamicCache

    keys, values = kv(40)
    dense = DynamicCache([(keys, values), (keys * 2, values * 2)])
    live = quantize_live(dense, num_layers=2, bits=4)
    assert is_live_quantized(live) and not is_live_quantized(dense)
    assert live.get_seq_length() == 40
    assert layer_kv(dense.layers[0]).keys is dense.layers[0].keys  # the exact path gets its own tensor
    assert torch.equal(dense.layers[0].keys, keys)  # untouched
    assert cache_kv_bytes(live) < cache_kv_bytes(dense)
    empty = quantize_live(DynamicCache(), num_layers=2, bits=8)
    assert empty.get_seq_length() == 0 and len(empty.layers) == 2


# ----------------------------------------------------------------------------------------- the engine
def greedy_on(model, ids: list[int], cache, n: int = NEW) -> list[int]:
    """Plain greedy loop over ``cache`` (what the engine's decode loop must reproduce)."""
    out: list[int] = []
    tokens = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits = model(tokens, **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            tokens = torch.tensor([[out[-1]]])
    return out


def teacher_forced_agreement(model, ids: list[int], continuation: list[int], cache) -> float:
    """Share of positions where the argmax over ``cache`` picks the reference's next token."""
    full = torch.tensor([ids + continuation])
    with torch.no_grad():
        logits = model(full[:, : len(ids)], **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
        preds = [int(logits.argmax())]
        for t in range(len(ids), full.shape[1] - 1):
            preds.append(
                int(
                    model(full[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
                    .logits[0, -1]
                    .argmax()
                )
            )
    return sum(p == r for p, r in zip(preds, continuation)) / len(continuation)


def test_quantized_requests_follow_no_cache_greedy(llama, tokenizer):
    ids = tokenizer(words(150, seed=7))["input_ids"]
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    out8 = engine.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=8).output_ids
    assert out8 == reference_greedy(llama, ids)
    # 4 bits on a random head_dim-16 model drifts within a few tokens; the engine must still be exactly a
    # greedy loop over transformers' QuantizedLayer with the KIVI codec.
    out4 = engine.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=4).output_ids
    assert out4 == greedy_on(llama, ids, LiveQuantizedCache(num_layers=2, bits=4))


def test_teacher_forced_agreement(llama, tokenizer):
    """Over 64 reference tokens (measured: 8 bits 61-64/64, 4 bits 42-44/64 on three prompts)."""
    from transformers import DynamicCache

    ids = tokenizer(words(150, seed=1))["input_ids"]
    continuation = reference_greedy(llama, ids, 64)
    assert teacher_forced_agreement(llama, ids, continuation, DynamicCache()) == 1.0
    assert teacher_forced_agreement(llama, ids, continuation, LiveQuantizedCache(num_layers=2, bits=8)) >= 0.9
    assert (
        teacher_forced_agreement(llama, ids, continuation, LiveQuantizedCache(num_layers=2, bits=4)) >= 0.55
    )


def test_working_cache_bytes_drop(llama, tokenizer):
    ids = tokenizer(words(200, seed=8))["input_ids"]
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    caches = capture_caches(engine)
    engine.generate(ids, max_new_tokens=4, ignore_eos=True, kv_cache_bits=8)
    engine.generate(ids, max_new_tokens=4, ignore_eos=True, kv_cache_bits=4)
    with torch.no_grad():  # the exact path's KV for the same tokens, as a plain transformers cache holds it
        dense_cache = output_cache(llama(torch.tensor([[*ids, 5, 6, 7]]), use_cache=True))
    caches.insert(0, dense_cache)
    dense, q8, q4 = (cache_kv_bytes(c) for c in caches)
    assert all(c.get_seq_length() == len(ids) + 3 for c in caches)
    assert isinstance(caches[1], LiveQuantizedCache) and isinstance(caches[2], LiveQuantizedCache)
    # fp32 KV, head_dim 16: int8 codes + fp16 scales/minima ~ 0.3x, int4 ~ 0.17x (plus the residual window).
    assert q8 < 0.4 * dense and q4 < 0.25 * dense, (dense, q8, q4)


def test_sixteen_bits_is_the_exact_path(llama, tokenizer):
    ids = tokenizer(words(70, seed=9))["input_ids"]
    expected = reference_greedy(llama, ids)
    outs = []
    for bits in (None, 16):
        engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
        engine.warm(ids[:40])
        result = engine.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=bits)
        outs.append((result.output_ids, result.cached_tokens, engine.cache_stats()["entries"]))
    assert outs[0] == outs[1]
    assert outs[0][0] == expected and outs[0][1] == 40  # the warmed partial tail chunk counts too


def test_override_mutates_no_engine_state(llama, tokenizer):
    ids = tokenizer(words(60, seed=10))["input_ids"]
    other = tokenizer(words(60, seed=10) + " " + words(10, seed=11))["input_ids"]
    used = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    used.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=4)
    assert used.cache_stats()["entries"] == 0  # quantized KV is never stored
    assert used.config == EngineConfig(chunk_size=CHUNK)
    fresh = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    for prompt in (ids, other):
        a = used.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
        b = fresh.generate(prompt, max_new_tokens=NEW, ignore_eos=True)
        assert (a.output_ids, a.cached_tokens) == (b.output_ids, b.cached_tokens)
    assert used.cache_stats()["entries"] == fresh.cache_stats()["entries"] > 0


def test_cached_prefix_goes_into_the_quantized_cache(llama, tokenizer):
    ids = tokenizer(words(90, seed=12))["input_ids"]
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    engine.warm(ids[:64])
    entries = engine.cache_stats()["entries"]
    caches = capture_caches(engine)
    out = engine.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=8, prefill_chunk_size=8)
    assert out.cached_tokens == 64
    assert isinstance(caches[0], LiveQuantizedCache) and caches[0].get_seq_length() == len(ids) + NEW - 1
    assert out.output_ids == reference_greedy(llama, ids)
    assert engine.cache_stats()["entries"] == entries


def test_batch_with_overrides(llama, tokenizer):
    prompts = [words(40, seed=13), words(25, seed=14)]
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    single = [engine.generate(p, max_new_tokens=NEW, ignore_eos=True).output_ids for p in prompts]
    engine.clear_cache()
    sliced = engine.generate_batch(prompts, max_new_tokens=NEW, ignore_eos=True, prefill_chunk_size=8)
    assert [r.output_ids for r in sliced] == single
    # Equal lengths (no pad tokens, whose KV would share quantization groups with real tokens): each row
    # of a quantized batch is quantized on its own, as it would be alone, and finished rows leave exactly.
    same_length = [words(40, seed=13), words(40, seed=14)]
    engine.clear_cache()
    alone = [
        engine.generate(p, max_new_tokens=n, ignore_eos=True, kv_cache_bits=8).output_ids
        for p, n in zip(same_length, (5, NEW))
    ]
    quantized = engine.generate_batch(
        same_length,
        sampling=[{"max_new_tokens": 5}, {"max_new_tokens": NEW}],
        ignore_eos=True,
        kv_cache_bits=8,
    )
    assert [r.output_ids for r in quantized] == alone
    assert engine.cache_stats()["entries"] == 0


@pytest.mark.parametrize("bad", [3, 32, "8", True, 8.0])
def test_invalid_bits_are_rejected(llama, tokenizer, bad):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    for call in (
        lambda: engine.generate("w1 w2", kv_cache_bits=bad),
        lambda: engine.stream("w1 w2", kv_cache_bits=bad),
        lambda: engine.generate_batch(["w1 w2"], kv_cache_bits=bad),
    ):
        with pytest.raises(InvalidRequestError, match="kv_cache_bits") as info:
            call()
        assert info.value.param == "kv_cache_bits"


def teacher_forced_logits(model, ids: list[int], continuation: list[int], cache) -> torch.Tensor:
    """``[len(continuation), V]`` logits over ``cache``: the prompt in one forward, then one token at a time
    (the decode steps read the quantized prompt; the prefill itself attends to its KV as computed)."""
    full = torch.tensor([ids + continuation])
    with torch.no_grad():
        rows = [model(full[:, : len(ids)], **cache_kwargs(model, cache), use_cache=True).logits[0, -1]]
        for t in range(len(ids), full.shape[1] - 1):
            rows.append(model(full[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("arch", PATH_ARCHITECTURES)
def test_architectures_run_quantized(arch, tokenizer):
    """Every structurally different architecture decodes over a live-quantized cache: the engine is exactly
    a greedy loop over it (a cached prefix quantized on the way in), and the error is a quantization error.

    Measured (tools/arch_matrix.py, 12 teacher-forced steps): 8-bit max logit deviation 0.0001-0.15 against
    a logit scale of 0.3-8, about a tenth of the 4-bit one, except where a MoE router picks another expert
    at one step; every 8-bit argmax agrees outside such flips.
    """
    from transformers import DynamicCache

    model = make_model(arch)
    layers = model.config.get_text_config().num_hidden_layers
    ids = tokenizer(words(50, seed=15))["input_ids"]
    expected = reference_greedy(model, ids)
    reference = teacher_forced_logits(model, ids, expected, DynamicCache())
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    engine.warm(ids[:32])  # the cached prefix enters the quantized cache through QuantizedLayer.update
    deviation = {}
    out = engine.generate(ids, max_new_tokens=NEW, ignore_eos=True, kv_cache_bits=8)
    assert out.cached_tokens == 32
    prefix = quantize_live(dense_prefix(model, ids[:32]), num_layers=layers, bits=8)
    assert out.output_ids == greedy_on(model, ids[32:], prefix)
    for bits in (8, 4):
        quantized = teacher_forced_logits(
            model, ids, expected, LiveQuantizedCache(num_layers=layers, bits=bits)
        )
        # The median step: one MoE routing flip (gpt-oss: a different expert at one step, 3.3 there) is a
        # discrete jump that says nothing about the codec.
        deviation[bits] = float((quantized - reference).abs().amax(-1)[1:].median())
        if bits == 8:
            agree = (quantized.argmax(-1) == torch.tensor(expected)).float().mean()
            assert agree >= 0.75, (arch, float(agree))
    scale = float(reference.abs().max())
    # Sane bounds, far from the measured figures: 8 bits is a small error on the logit scale and well below 4.
    assert 0 < deviation[8] < 0.1 * scale and deviation[8] < 0.5 * deviation[4], (arch, deviation, scale)


def dense_prefix(model, ids: list[int]):
    """The cache a plain forward over ``ids`` leaves, every layer full (as the engine assembles a prefix)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=True, **cache_kwargs(model, cache))
    return cache


def test_solo_requests_run_at_most_max_num_seqs_at_once(llama, tokenizer):
    """Live-quantized (and solo speculative) requests each hold their own cache and run their own forwards:
    a burst of them all ran at once, one forward each per step. Now at most ``max_num_seqs`` run, the rest
    start oldest first as one ends; each equals its run alone, and a waiting one aborts cleanly."""
    from kvb_cache import SamplingParams

    prompts = [tokenizer(words(20, seed=500 + i))["input_ids"] for i in range(5)]
    alone = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    want = [alone.generate(p, max_new_tokens=4, ignore_eos=True, kv_cache_bits=8).output_ids for p in prompts]
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_num_seqs=2))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    ids = [engine.add_request(p, params, kv_cache_bits=8) for p in prompts]
    assert len(engine.core.solo) == 2 and list(engine.core.solo_waiting) == ids[2:]
    stats = engine.paged_stats()  # the waiting ones are waiting requests (a server's queue bound reads it)
    assert (stats.running, stats.waiting) == (2, 3)
    assert engine.abort(ids[3]) and not engine.core.knows(ids[3])
    got, started = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            if out.result is not None:
                got[out.request_id] = out.result.output_ids
        assert len(engine.core.solo) <= 2
        started += [r for r in engine.core.solo if r not in started]
    assert started == [i for i in ids if i != ids[3]]
    assert got == {rid: want[i] for i, rid in enumerate(ids) if i != 3}


def test_an_interrupt_while_a_waiting_solo_request_starts_keeps_it(llama, tokenizer, monkeypatch):
    """A KeyboardInterrupt while a step started a waiting solo request (preparing its cache) lost it: no
    output, no error, its stream never ended. It waits again, first, and the next step starts it."""
    from kvb_cache import SamplingParams

    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_num_seqs=1))
    prompts = [tokenizer(words(12, seed=600 + i))["input_ids"] for i in range(2)]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    first, second = (engine.add_request(p, params, kv_cache_bits=8) for p in prompts)
    prepare = engine._prepare
    calls = {"n": 0}

    def interrupted_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return prepare(*args, **kwargs)

    monkeypatch.setattr(engine, "_prepare", interrupted_once)
    results, interrupted = {}, 0
    while engine.has_unfinished():
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            interrupted += 1
            assert engine.core.knows(second) and list(engine.core.solo_waiting) == [second]
            continue
        for out in outputs:
            assert out.error is None
            if out.result is not None:
                results[out.request_id] = out.result
    assert interrupted == 1 and sorted(results) == sorted([first, second])
