"""Tenant isolation: ``cache_salt`` roots the hash chain, so different salts never share cached KV."""

from __future__ import annotations

import pytest
from conftest import make_model, rag_prompts
from test_stitching import _engine as stitching_engine

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost
from kvb_cache.hashing import prefix_hash, root_hash, salted_root
from kvb_cache.tiers import TierConfig

PROMPT = list(range(5, 75))  # 70 tokens: 4 full blocks of 16 and a 6-token tail


def engine(model, tok, **config) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, **config))


def run(eng: KVBoost, salt: str | None, prompt=PROMPT):
    return eng.generate(prompt, max_new_tokens=4, ignore_eos=True, cache_salt=salt)


def test_unsalted_chain_is_unchanged_and_salts_change_the_root():
    root = root_hash("fp")
    assert salted_root(root, None) == root  # records written before salts existed keep hitting
    a, b = salted_root(root, "tenant-a"), salted_root(root, "tenant-b")
    assert len({root, a, b}) == 3 and a == salted_root(root, "tenant-a")
    # Pinned: disk/Redis records of salted chains are keyed by it across processes and versions.
    assert a.hex()[:16] == "c57b2ef1cdf9414e"
    assert salted_root(root, "\ud800") != root  # lone surrogates (from JSON) hash instead of raising


def test_two_engines_on_one_model_share_a_fingerprint(tokenizer):
    """The first engine switches the model to paged attention; the second must still read its records."""
    model = make_model("llama")
    assert engine(model, tokenizer).fingerprint == engine(model, tokenizer).fingerprint


def test_unsalted_requests_index_the_fingerprint_chain(llama, tokenizer):
    eng = engine(llama, tokenizer)
    run(eng, None)
    assert eng.kv.pool.lookup(prefix_hash(eng.root, PROMPT[:16])) is not None


@pytest.mark.parametrize(("first", "second"), [("a", "b"), (None, "a"), ("a", None)])
def test_different_salts_share_no_cached_block(llama, tokenizer, first, second):
    eng = engine(llama, tokenizer)
    a = run(eng, first)
    hits = eng.paged_stats().prefix_cache_hits
    b = run(eng, second)
    assert a.cached_tokens == 0 and b.cached_tokens == 0
    assert eng.paged_stats().prefix_cache_hits == hits  # not even the token-granular tail matched
    assert b.output_ids == a.output_ids
    again = run(eng, first)
    assert again.cached_tokens == len(PROMPT) - 1  # the same salt hits in full


def test_same_salt_hits_like_unsalted(llama, tokenizer):
    eng = engine(llama, tokenizer)
    plain = [run(eng, None).cached_tokens for _ in range(2)]
    salted = [run(eng, "a").cached_tokens for _ in range(2)]
    assert plain == salted == [0, len(PROMPT) - 1]


def test_salt_applies_to_every_loop(llama, tokenizer):
    eng = engine(llama, tokenizer)
    warmed = eng.warm(PROMPT, cache_salt="a")
    assert warmed.already_cached_tokens == 0
    assert eng.warm(PROMPT, cache_salt="b").already_cached_tokens == 0
    assert eng.warm(PROMPT, cache_salt="a").already_cached_tokens == 64
    batch = eng.generate_batch([PROMPT, PROMPT[:40]], max_new_tokens=2, cache_salt="c")
    assert [r.cached_tokens for r in batch] == [0, 0]
    events = list(eng.stream(PROMPT, max_new_tokens=2, cache_salt="c"))
    assert events[-1].result.cached_tokens == len(PROMPT) - 1
    assert eng.next_token_logits(PROMPT, cache_salt="d").cached_tokens == 0
    assert eng.next_token_logits(PROMPT, cache_salt="d").cached_tokens == len(PROMPT) - 1


def test_solo_requests_are_isolated_too(llama, tokenizer):
    """Per-request quantized KV runs solo on a private cache assembled from the pool's prefix."""
    eng = engine(llama, tokenizer)
    run(eng, "a")
    quantized = eng.generate(PROMPT, max_new_tokens=2, kv_cache_bits=8, cache_salt="b")
    assert quantized.cached_tokens == 0
    assert eng.generate(PROMPT, max_new_tokens=2, kv_cache_bits=8, cache_salt="a").cached_tokens > 0


def test_salts_are_isolated_through_the_disk_tier(llama, tokenizer, tmp_path):
    tiers = TierConfig(disk_cache_dir=tmp_path)
    with engine(llama, tokenizer, tiers=tiers) as first:
        a = run(first, "a")
    second = engine(llama, tokenizer, tiers=tiers)  # a restart: empty RAM, the same folder
    assert run(second, "b").cached_tokens == 0
    assert run(second, None).cached_tokens == 0
    second.clear_cache()  # RAM forgets: what follows is served from disk only
    b = run(second, "a")
    assert b.cached_tokens == 64 and b.output_ids == a.output_ids


def test_stitching_finds_only_chunks_of_the_same_salt(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    eng = stitching_engine(llama, tokenizer, recompute_strategy="selective")
    eng.next_token_logits(first, cache_salt="a")
    other = eng.next_token_logits(second, cache_salt="b")
    assert other.cached_tokens == 0 and other.recomputed_tokens == 0
    # The loop's path (a solo stitched request) as well, and unsalted requests.
    assert eng.generate(second, max_new_tokens=2, cache_salt="c").cached_tokens == 0
    assert eng.generate(second, max_new_tokens=2, cache_salt=None).cached_tokens == 0
    same = eng.next_token_logits(second, cache_salt="a")
    assert same.cached_tokens == 20 + 80  # exact system prompt + five stitched chunks


@pytest.mark.parametrize("salt", ["", 5, b"tenant", ["a"]])
def test_bad_salts_are_refused_naming_the_argument(llama, tokenizer, salt):
    eng = engine(llama, tokenizer)
    calls = [
        lambda: eng.add_request(PROMPT, cache_salt=salt),
        lambda: eng.generate(PROMPT, cache_salt=salt),
        lambda: eng.stream(PROMPT, cache_salt=salt),
        lambda: eng.generate_batch([PROMPT], cache_salt=salt),
        lambda: eng.warm(PROMPT, cache_salt=salt),
        lambda: eng.next_token_logits(PROMPT, cache_salt=salt),
    ]
    for call in calls:
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert err.value.param == "cache_salt" and "cache_salt" in str(err.value)
    assert not eng.has_unfinished()
