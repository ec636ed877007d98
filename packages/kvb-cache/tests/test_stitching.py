"""Non-prefix reuse: stitched chunks, seam repair, hit kinds, the store rule and declined models."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, rag_prompts, words

from kvb_cache import ConfigError, EngineConfig, HitKind, KVBoost, StitchConfig
from kvb_cache.repair import selective_positions

CHUNK = 16


def _probe(ids):
    from kvb_cache.pool_io import probe_request

    return probe_request(ids)


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def _engine(model, tokenizer, **stitch):
    return KVBoost(model, tokenizer, config=EngineConfig(chunk_size=CHUNK, stitching=StitchConfig(**stitch)))


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "qwen2",
        "mistral",
        "gemma2",
        "gemma3",
        "gemma4",
        "gemma4_kv_shared",
        "gemma3n",
        "stablelm",
        "gpt_oss",
        "gpt_neox",
    ],
)
@pytest.mark.parametrize(
    "stitch",
    [
        {"recompute_strategy": "selective", "overlap_k": 10_000},
        {"recompute_strategy": "cacheblend", "recompute_ratio": 1.0, "check_layer": 0},
    ],
    ids=["selective-all", "cacheblend-all"],
)
def test_recomputing_every_stitched_token_equals_no_cache(arch, stitch, tokenizer):
    """The repair forward is exact: with every stitched token recomputed, logits equal a plain forward."""
    model = make_model(arch)
    first, second = rag_prompts(tokenizer)
    engine = _engine(model, tokenizer, **stitch)
    engine.next_token_logits(first)
    result = engine.next_token_logits(second)
    assert result.recomputed_tokens == 80  # five stitched chunks of 16
    assert result.cached_tokens == 20 + 80  # exact prefix (system prompt, token-granular) + stitched
    torch.testing.assert_close(result.logits, _reference(model, second), atol=1e-5, rtol=0)


def test_strategy_none_reuses_without_recompute_and_differs(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none")
    engine.next_token_logits(first)
    out = engine.generate(second, max_new_tokens=4, ignore_eos=True)
    kinds = [(c.start, c.end, c.kind) for c in out.chunks]
    assert kinds == [
        (0, 16, HitKind.EXACT),
        (16, 20, HitKind.PARTIAL),
        (20, 32, HitKind.MISS),
        (32, 48, HitKind.STITCHED),
        (48, 72, HitKind.MISS),
        (72, 88, HitKind.STITCHED),
        (88, 104, HitKind.STITCHED),
        (104, 120, HitKind.STITCHED),
        (120, 136, HitKind.STITCHED),
        (136, 146, HitKind.MISS),
    ]
    assert out.recomputed_tokens == 0 and all(c.recomputed_tokens == 0 for c in out.chunks)
    assert out.cached_tokens == 100
    # Approximate: the stitched KV never saw its new history, so the logits really move.
    stitched = _engine(llama, tokenizer, recompute_strategy="none")
    stitched.next_token_logits(first)
    assert (stitched.next_token_logits(second).logits - _reference(llama, second)).abs().max() > 1e-2


def test_selective_recomputes_first_tokens_after_each_seam(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=5)
    engine.next_token_logits(first)
    out = engine.generate(second, max_new_tokens=2, ignore_eos=True)
    stitched = [c for c in out.chunks if c.kind is HitKind.STITCHED]
    # Two true seams: docs[2] (32..48) and docs[0] + docs[1] (72..136), four chunks that were neighbours in
    # `first` too (each one's parent is the previous one), so they form one run with one seam.
    assert [(c.start, c.recomputed_tokens) for c in stitched] == [
        (32, 5),
        (72, 5),
        (88, 0),
        (104, 0),
        (120, 0),
    ]
    assert out.recomputed_tokens == 10


def test_selective_positions_are_after_the_seam_and_include_sinks():
    assert selective_positions([(0, 16), (40, 56)], overlap_k=3, sink_tokens=5) == [0, 1, 2, 3, 4, 40, 41, 42]
    assert selective_positions([(20, 30)], overlap_k=0, sink_tokens=4) == []


def test_cacheblend_recomputes_the_ratio(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    ref = _reference(llama, second)
    errors = {}
    for strategy in ("none", "cacheblend"):
        engine = _engine(
            llama, tokenizer, recompute_strategy=strategy, check_layer=0, overlap_k=0, recompute_ratio=0.25
        )
        engine.next_token_logits(first)
        result = engine.next_token_logits(second)
        errors[strategy] = (result.logits - ref).abs().max().item()
        if strategy == "cacheblend":
            assert result.recomputed_tokens == round(0.25 * 80)
    # The repair changed the result (its fidelity on a real model is measured by tools/eval_fidelity.py:
    # random 2-layer models are too chaotic for "better than none" to be a stable claim).
    assert errors["cacheblend"] != errors["none"]


def test_exact_hits_after_a_stitched_request_stay_exact(llama, tokenizer):
    """Stitched (approximate) KV is never stored under prefix hashes: a later exact hit equals no-cache."""
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none")
    engine.next_token_logits(first)
    engine.generate(second, max_new_tokens=8, ignore_eos=True)
    follow_up = [*second, *tokenizer(words(9, seed=4))["input_ids"]]
    # The pool (exact prefix blocks) holds the follow-up only up to the first stitched chunk, nothing after it.
    assert engine.kv.cached_prefix_len(_probe(follow_up), len(follow_up)) == 32
    # And what it holds is exact: the first prompt again, served from those blocks, equals no-cache.
    again = engine.next_token_logits(first)
    torch.testing.assert_close(again.logits, _reference(llama, first), atol=1e-5, rtol=0)


def test_exact_prefix_is_never_repaired(llama, tokenizer):
    first, _ = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="cacheblend", check_layer=0)
    engine.next_token_logits(first)
    again = engine.next_token_logits(first)
    assert again.recomputed_tokens == 0 and again.cached_tokens == len(first) - 1
    torch.testing.assert_close(again.logits, _reference(llama, first), atol=1e-5, rtol=0)


def test_absolute_position_models_decline_with_reason(tokenizer):
    model = make_model("gpt2")
    first, second = rag_prompts(tokenizer)
    engine = _engine(model, tokenizer)
    engine.next_token_logits(first)
    result = engine.next_token_logits(second)
    stats = engine.cache_stats()["stitching"]
    assert stats["enabled"] is False and "absolute position" in stats["declined_reason"]
    assert result.recomputed_tokens == 0
    torch.testing.assert_close(result.logits, _reference(model, second), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("recompute_strategy", "full"), ("recompute_ratio", 1.5), ("overlap_k", -1), ("check_layer", 1.0)],
)
def test_stitch_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=field):
        StitchConfig(**{field: value})


def test_overlap_defaults_to_each_strategys_measured_setting() -> None:
    """docs/fidelity.md: seam tokens alone need 64; CacheBlend's selection adds to 32 (its measured row)."""
    assert StitchConfig().overlap_k == 64 and StitchConfig().recompute_strategy == "selective"
    assert StitchConfig(recompute_strategy="cacheblend").overlap_k == 32
    assert StitchConfig(recompute_strategy="none").overlap_k == 0
    assert StitchConfig(recompute_strategy="cacheblend", overlap_k=8).overlap_k == 8


def test_default_chunk_size_with_stitching_stitches_short_documents(llama, tokenizer):
    """Documents of 100 tokens hold no whole 128-token chunk, so with the exact-reuse default nothing of them
    is stitched; stitching's own default (32) stitches each of them."""
    docs = [tokenizer(words(100, seed=s))["input_ids"] for s in (11, 12, 13)]
    system = tokenizer(words(20, seed=9))["input_ids"]
    first = system + docs[0] + docs[1] + docs[2] + tokenizer(words(6, seed=7))["input_ids"]
    second = system + docs[2] + docs[0] + docs[1] + tokenizer(words(6, seed=8))["input_ids"]
    stitched = {}
    for chunk_size in (None, 128):
        config = EngineConfig(chunk_size=chunk_size, stitching=StitchConfig(recompute_strategy="none"))
        engine = KVBoost(llama, tokenizer, config=config)
        engine.next_token_logits(first)
        result = engine.next_token_logits(second)
        stitched[chunk_size] = result.cached_tokens - len(system)
    assert stitched[128] <= 0
    assert stitched[None] >= 3 * 64  # every document holds at least two whole 32-token chunks
