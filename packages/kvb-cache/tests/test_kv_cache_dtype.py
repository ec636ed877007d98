"""``kv_cache_dtype``: the block pool held in bfloat16 / float16 / fp8 (vLLM's ``--kv-cache-dtype``)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, words
from transformers import DynamicCache

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.core.kv_dtype import KV_CACHE_DTYPES, gather, pool_dtype, put
from kvb_cache.errors import ConfigError
from kvb_cache.fidelity import compare_distributions
from kvb_cache.tiers import TierConfig

NARROW = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


def engine(model, tok, dtype: str, **config) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, kv_cache_dtype=dtype, **config))


def test_names_are_vllms_and_a_wrong_one_lists_them():
    assert pool_dtype("auto", torch.float32) is torch.float32
    assert pool_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert pool_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    assert pool_dtype("bfloat16", torch.float32) is torch.bfloat16
    for bad in ("int8", "fp8_inc", None, 8):
        with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, bfloat16"):
            EngineConfig(kv_cache_dtype=bad)


@pytest.mark.parametrize("name", NARROW)
def test_put_then_gather_rounds_within_the_format_and_saturates(name):
    """A write rounds to the format (relative error at most half its mantissa step); values beyond its range
    are held at the largest finite value, never inf / NaN (e5m2 and float16 overflow to inf otherwise)."""
    dtype = pool_dtype(name, torch.float32)
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    pool = torch.zeros((2, 32, 8), dtype=dtype)
    x = torch.randn((2, 5, 8), generator=torch.Generator().manual_seed(0)) * 4 + 0.5
    slots = torch.tensor([3, 9, 10, 20, 31])
    put(pool, slots, x)
    back = gather(pool, slots, torch.float32)
    assert back.dtype == torch.float32 and back.shape == x.shape
    rel = ((back - x).abs() / x.abs()).max().item()
    assert 0 < rel <= 2.0 ** -(mantissa + 1) + 1e-6
    assert torch.count_nonzero(gather(pool, torch.tensor([0, 1, 2]), torch.float32)) == 0  # untouched
    huge = torch.full((2, 1, 8), 1e30)  # beyond every format but bfloat16, which spans fp32's range
    huge[1] = -1e30
    put(pool, torch.tensor([0]), huge)
    edge = gather(pool, torch.tensor([0]), torch.float32)
    limit = min(torch.finfo(dtype).max, 1.0003e30)
    assert torch.isfinite(edge).all()
    torch.testing.assert_close(edge[0], torch.full_like(edge[0], limit), rtol=1e-3, atol=0)
    torch.testing.assert_close(edge[1], torch.full_like(edge[1], -limit), rtol=1e-3, atol=0)


def test_the_same_bytes_hold_two_or_four_times_the_blocks(llama, tokenizer):
    budget = 1 << 20
    blocks = {
        name: engine(llama, tokenizer, name, max_cache_bytes=budget).paged_stats().blocks_total
        for name in ("auto", "bfloat16", "fp8")
    }
    assert blocks["bfloat16"] == pytest.approx(2 * blocks["auto"], abs=1)
    assert blocks["fp8"] == pytest.approx(4 * blocks["auto"], abs=1)
    stats = engine(llama, tokenizer, "fp8", max_cache_bytes=budget).cache_stats()
    assert stats["kv_cache_dtype"] == "fp8" and stats["max_bytes"] <= budget


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2"])
@pytest.mark.parametrize("name", ["bfloat16", "fp8"])
def test_a_prefix_hit_equals_the_same_engine_without_reuse(arch, name, tokenizer):
    """Every request attends its KV in the pool's precision, its own prompt included, so a prefix read back
    from the pool is exactly what the request that computed it attended: exact reuse stays exact."""
    model = make_model(arch)
    prompt = tokenizer(words(70, seed=3))["input_ids"]
    cold = engine(model, tokenizer, name).next_token_logits(prompt)
    warm_engine = engine(model, tokenizer, name)
    warm_engine.warm(prompt[:48])
    warm = warm_engine.next_token_logits(prompt)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 48
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-5, rtol=0)
    a = engine(model, tokenizer, name).generate(prompt, max_new_tokens=12, ignore_eos=True)
    b = warm_engine.generate(prompt, max_new_tokens=12, ignore_eos=True)
    assert b.cached_tokens >= 48 and b.output_ids == a.output_ids


def test_narrower_formats_move_the_logits_further_from_kv_as_computed(llama, tokenizer):
    """auto is the model's own logits; each narrower format is measurably used (logits move) and the error
    grows as mantissa bits shrink: float16 (10) < bfloat16 (7) < fp8_e4m3 (3) < fp8_e5m2 (2)."""
    prompt = tokenizer(words(80, seed=5))["input_ids"]
    with torch.no_grad():
        ref = llama(torch.tensor([prompt])).logits[0, -1]
    err = {
        name: (engine(llama, tokenizer, name).next_token_logits(prompt).logits - ref).abs().max().item()
        for name in ("auto", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
    }
    assert err["auto"] < 1e-5, err
    assert 1e-5 < err["float16"] < err["bfloat16"] < err["fp8_e4m3"] < err["fp8_e5m2"], err


@pytest.mark.parametrize("name", ["float16", "fp8"])
def test_batched_requests_equal_their_solo_runs(llama, tokenizer, name):
    prompts = [words(40, seed=1), words(12, seed=2), words(40, seed=1) + " w7 w8", words(3, seed=4)]
    solo = engine(llama, tokenizer, name)
    expected = [solo.generate(p, max_new_tokens=10, ignore_eos=True).output_ids for p in prompts]
    batched = engine(llama, tokenizer, name, max_num_batched_tokens=32)
    got = batched.generate_batch(prompts, max_new_tokens=10, ignore_eos=True)
    assert [g.output_ids for g in got] == expected
    assert batched.paged_stats().blocks_used == 0


def test_disk_records_come_back_as_the_pool_held_them_and_stay_apart_from_auto(llama, tokenizer, tmp_path):
    """Records are written in the model's dtype from the narrow pool's values, and re-encode to the same
    bytes: a restarted engine's hit gives the first one's tokens. KV rounded to fp8 is not the model's, so
    an ``auto`` engine on the same folder never reads it (another fingerprint)."""
    prompt = list(range(3, 73))
    tiers = TierConfig(disk_cache_dir=tmp_path)
    first = engine(llama, tokenizer, "fp8", tiers=tiers)
    a = first.generate(prompt, max_new_tokens=10, ignore_eos=True)
    logits = first.next_token_logits(prompt).logits
    first.close()
    again = engine(llama, tokenizer, "fp8", tiers=tiers)
    b = again.generate(prompt, max_new_tokens=10, ignore_eos=True)
    assert b.cached_tokens == 64 and b.output_ids == a.output_ids
    torch.testing.assert_close(again.next_token_logits(prompt).logits, logits, atol=1e-5, rtol=0)
    again.close()
    auto = engine(llama, tokenizer, "auto", tiers=tiers)
    assert auto.fingerprint != again.fingerprint
    assert auto.generate(prompt, max_new_tokens=2, ignore_eos=True).cached_tokens == 0


def test_a_cache_computed_outside_is_stored_in_the_pools_precision(llama, tokenizer):
    """store_cache takes a DynamicCache in the model's dtype (not the pool's) and rounds it on the way in; a
    cache in another dtype is still refused."""
    prompt = list(range(5, 53))
    cache = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(torch.tensor([prompt]), **cache_kwargs(llama, cache), use_cache=True)
    eng = engine(llama, tokenizer, "fp8")
    assert eng.store_cache(prompt, cache) == 48
    hit = eng.next_token_logits([*prompt, 60, 61])
    assert hit.cached_tokens == 48
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.to(torch.float8_e4m3fn), layer.values.to(torch.float8_e4m3fn)
    from kvb_cache.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"differs from the model.s KV dtype torch\.float32"):
        engine(llama, tokenizer, "fp8").store_cache(prompt, cache)


def test_the_block_table_kernel_is_refused_for_a_narrow_pool(llama, tokenizer):
    with pytest.raises(ConfigError, match="attention_backend='sdpa'"):
        engine(llama, tokenizer, "fp8", attention_backend="kvb_kernels")


def test_every_name_builds_an_engine(llama, tokenizer):
    for name in KV_CACHE_DTYPES:
        out = engine(llama, tokenizer, name).generate(words(20, seed=1), max_new_tokens=3, ignore_eos=True)
        assert len(out.output_ids) == 3


def test_replayed_decode_steps_read_the_narrow_pool_as_eager_steps_do(tokenizer, monkeypatch):
    """Captured decode steps (core/decode_graphs.py; the capture is the identity on a CPU) convert the
    gathered fp8 context exactly as eager steps do."""
    import dataclasses

    from test_decode_graphs import CONFIG, EAGER, prompts, schedule

    from kvb_cache.core import build

    model = make_model("llama")
    reference = schedule(
        KVBoost(model, tokenizer, config=dataclasses.replace(EAGER, kv_cache_dtype="fp8")), prompts(), 6
    )
    monkeypatch.setattr(build, "graph_capture", lambda device: lambda fn: fn)
    replayed = KVBoost(model, tokenizer, config=dataclasses.replace(CONFIG, kv_cache_dtype="fp8"))
    got = schedule(replayed, prompts(), 6)
    for (_, g), (_, want) in zip(got, reference, strict=True):
        torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    assert replayed.core.runner.graphs.replays > 0
    assert replayed.kv.storage.keys[0].dtype == torch.float8_e4m3fn


def test_stitched_reuse_works_on_a_narrow_pool(llama, tokenizer):
    """Stitching reads stored chunks from the pool in the model's dtype, moves their keys and writes the
    request's KV back rounded: the documents are reused, and the answer stays close to the same engine's
    cold one."""
    from conftest import rag_prompts

    from kvb_cache import StitchConfig

    first, second = rag_prompts(tokenizer)
    stitched = engine(llama, tokenizer, "bfloat16", stitching=StitchConfig(recompute_strategy="selective"))
    stitched.next_token_logits(first)
    warm = stitched.next_token_logits(second)
    cold = engine(llama, tokenizer, "bfloat16").next_token_logits(second)
    assert warm.cached_tokens > len(second) // 2 and warm.recomputed_tokens > 0
    assert compare_distributions(cold.logits[None], warm.logits[None]).mean_kl < 1e-4  # measured 5.6e-6


@pytest.mark.parametrize("name", ["float16", "fp8"])
def test_the_repair_forward_attends_its_fresh_kv_in_pool_precision(llama, tokenizer, name):
    """A stitched prompt's new text before its first stitched piece is computed by the repair forward and
    registered under exact prefix hashes. Attended unrounded, a later hit on it was off the same engine
    without reuse (fp8: 0.13); rounded before it is attended, as the loop does, the hit equals it, and so does
    a stitch whose every token is recomputed."""
    from kvb_cache import StitchConfig

    def ids(seed: int, n: int) -> list[int]:
        return tokenizer(words(n, seed=seed))["input_ids"]

    first_doc, second_doc, lead = ids(1, 32), ids(2, 32), ids(5, 48)
    stored = ids(9, 16) + first_doc + second_doc + ids(7, 6)
    stitched = lead + second_doc + first_doc + ids(8, 6)
    follow = lead + ids(6, 10)  # shares only the stitched prompt's new lead
    cold = engine(llama, tokenizer, name).next_token_logits(follow)
    warm = engine(llama, tokenizer, name, stitching=StitchConfig())
    warm.generate(stored, max_new_tokens=1)
    result = warm.generate(stitched, max_new_tokens=1)
    assert any(c.kind.name == "STITCHED" for c in result.chunks)
    hit = warm.next_token_logits(follow)
    assert hit.cached_tokens >= 32
    torch.testing.assert_close(hit.logits, cold.logits, atol=1e-5, rtol=0)
    everything = engine(llama, tokenizer, name, stitching=StitchConfig(overlap_k=10_000))
    everything.generate(stored, max_new_tokens=1)
    full = everything.next_token_logits(stitched)
    assert full.recomputed_tokens > 0
    reference = engine(llama, tokenizer, name).next_token_logits(stitched)
    torch.testing.assert_close(full.logits, reference.logits, atol=1e-5, rtol=0)


class _SoloGreedy:
    """A solo-path decoder (the kvb_cache.decoding.SpeculativeDecoder protocol) decoding greedily on its
    private cache, in the model's dtype."""

    def decode(self, model, cache, input_ids, next_logits, processor):
        start = cache.get_seq_length()
        logits = next_logits
        while True:
            token = int(torch.argmax(logits))
            with torch.no_grad():
                out = model(
                    input_ids=torch.tensor([[token]]),
                    position_ids=torch.tensor([[start]]),
                    use_cache=True,
                    **cache_kwargs(model, cache),
                )
            start += 1
            logits = out.logits[0, -1]
            yield token


def test_no_request_decodes_solo_over_a_narrow_pool(llama, tokenizer):
    """The solo speculative path (a sampled or penalised request arriving alone) decodes over a private cache
    in the model's dtype: over an fp8 pool its tokens depended on whether a drafter was attached and on the
    load, and its KV written back made a later prefix hit 0.15 off the same engine without reuse. With a
    narrow pool such a request decodes in the loop (tokens as without a drafter); with an exact pool it still
    goes solo and its KV is kept."""
    prompt = tokenizer(words(70, seed=3))["input_ids"]
    follow = [*prompt, 7, 8, 9]
    penalised = SamplingParams(max_new_tokens=12, repetition_penalty=1.3, ignore_eos=True)
    for name in ("fp8", "auto"):
        plain = (
            engine(llama, tokenizer, name)
            .generate(prompt, max_new_tokens=12, repetition_penalty=1.3, ignore_eos=True)
            .output_ids
        )
        cold = engine(llama, tokenizer, name).next_token_logits(follow)
        solo = KVBoost(
            llama, tokenizer, config=EngineConfig(chunk_size=16, kv_cache_dtype=name), drafter=_SoloGreedy()
        )
        rid = solo.add_request(prompt, penalised)
        assert (rid in solo.core.solo) == (name == "auto")
        done = {}
        while solo.has_unfinished():
            done.update({o.request_id: o.result for o in solo.step() if o.result is not None})
        if name == "fp8":  # _SoloGreedy ignores the penalty: only the loop gives the plain tokens
            assert done[rid].output_ids == plain
        hit = solo.next_token_logits(follow)
        torch.testing.assert_close(hit.logits, cold.logits, atol=1e-5, rtol=0)
        assert hit.cached_tokens >= 64


def test_a_same_size_pool_dtype_is_refused_and_aliases_share_a_fingerprint(llama, tokenizer):
    half = make_model("llama").to(torch.float16)
    with pytest.raises(ConfigError, match="no smaller"):
        engine(half, tokenizer, "bfloat16")
    assert engine(half, tokenizer, "float16").fingerprint == engine(half, tokenizer, "auto").fingerprint
    assert engine(llama, tokenizer, "fp8").fingerprint == engine(llama, tokenizer, "fp8_e4m3").fingerprint
    assert engine(llama, tokenizer, "fp8").fingerprint != engine(llama, tokenizer, "fp8_e5m2").fingerprint
