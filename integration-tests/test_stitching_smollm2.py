"""On SmolLM2: stitched reuse of reordered documents, and its measured fidelity through verify_correctness."""

from __future__ import annotations

import torch

from kvb_cache import EngineConfig, HitKind, KVBoost, StitchConfig


def test_exact_engine_shows_zero_drift_on_default_prompts(smollm2):
    model, tokenizer = smollm2
    report = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32)).verify_correctness(new_tokens=8)
    assert report.identical_rate == 1.0
    assert report.max_abs_logit_diff < 1e-4 and report.max_kl < 1e-8


def test_default_stitching_reuses_reordered_documents(smollm2):
    model, tokenizer = smollm2
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=32, stitching=StitchConfig()))
    report = engine.verify_correctness(new_tokens=8)
    later = report.prompts[1:]
    assert all(p.reuse_ratio > 0.5 for p in later), [p.reuse_ratio for p in later]
    assert all(p.recomputed_tokens > 0 for p in later)
    # Stitched KV is approximate; on these prompts the default repair (seam tokens) keeps the first token.
    assert all(p.top1_agrees for p in later), [p.kl for p in later]
    stats = engine.cache_stats()["stitching"]
    assert stats["enabled"] and stats["stitched_chunks"] > 0
    ids = engine.tokenizer("unrelated text " * 3)["input_ids"]
    assert all(c.kind is not HitKind.STITCHED for c in engine.generate(ids, max_new_tokens=2).chunks)
    assert torch.isfinite(engine.next_token_logits(ids).logits).all()
