"""Averaging the stored copies of stitched tokens (StitchConfig.average_copies) and collecting them
(StitchConfig.collect_copies)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import ListedStore, words

from kvb_cache import EngineConfig, HitKind, KVBoost, SamplingParams, StitchConfig
from kvb_cache.cache_kwarg import output_cache
from kvb_cache.errors import ConfigError
from kvb_cache.hashing import ChunkHash
from kvb_cache.stitch_lookup import ContentLookup, StitchedPiece, copy_pieces

CHUNK = 16


def _docs(tokenizer):
    system = tokenizer(words(20, seed=9))["input_ids"]
    d0, d1, d2 = (tokenizer(words(40, seed=s))["input_ids"] for s in (1, 2, 3))
    question = [tokenizer(words(6, seed=s))["input_ids"] for s in (7, 8, 10)]
    p1 = system + d0 + d1 + d2 + question[0]
    p2 = system + d2 + d0 + d1 + question[1]
    p3 = system + d1 + d2 + d0 + question[2]
    return system, (d0, d1, d2), (p1, p2, p3)


def _values(model, ids):
    """Per layer ``[kv_heads, len(ids), head_dim]`` values of one plain forward."""
    with torch.no_grad():
        cache = output_cache(model(torch.tensor([ids]), use_cache=True))
    return [layer.values[0] for layer in cache.layers]


def _engine(model, tokenizer, **stitch):
    return KVBoost(model, tokenizer, config=EngineConfig(chunk_size=CHUNK, stitching=StitchConfig(**stitch)))


def test_stitched_kv_is_the_mean_of_the_independent_copies(llama, tokenizer):
    """A document computed in two prompts is stored twice; a third prompt's stitched KV for it is the mean of
    the two copies (values carry no rotation: compared directly with plain forwards). A document whose
    chosen copy was computed after the same neighbour as here keeps that copy alone: the other copy, after
    another history, starts its agreement with the prompt later."""
    system, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none", average_copies=2, collect_copies=2)
    engine.next_token_logits(p1)
    engine.next_token_logits(p2)  # each document held once: computed again, kept as a second copy
    assert engine.cache_stats()["stitching"]["collected_tokens"] > 0
    engine.stitcher.config = replace(engine.stitcher.config, collect_copies=1)
    prepared = engine._prepare(p3, max_reuse=len(p3) - 1, stitch=True)
    assert prepared.exact_until is not None
    v1, v2 = _values(llama, p1), _values(llama, p2)
    n = len(system)
    # d1: P1 holds it at n + 40, P2 at n + 80, P3 at n; offset 20 is covered by a full chunk of each copy.
    at3, at1, at2 = n + 20, n + 40 + 20, n + 80 + 20
    # d0 follows d2 in P3 as in P2 (P2's copy chains through d2 into d0); P1 computed d0 after the system
    # prompt, so its copy is not averaged there.
    d0_at3, d0_at2 = n + 80 + 20, n + 40 + 20
    for layer, cache_layer in enumerate(prepared.cache.layers):
        got = cache_layer.values[0]
        mean = (v1[layer][:, at1] + v2[layer][:, at2]) / 2
        torch.testing.assert_close(got[:, at3], mean, atol=1e-5, rtol=0)
        torch.testing.assert_close(got[:, d0_at3], v2[layer][:, d0_at2], atol=1e-5, rtol=0)
    # Layer 0's values see no context; the last layer's copies differ, so the mean is a real one.
    assert not torch.allclose(v1[-1][:, at1], v2[-1][:, at2], atol=1e-3)


def test_one_copy_or_average_copies_1_keeps_the_chosen_copy(llama, tokenizer):
    """With one stored copy nothing is averaged; with several, ``average_copies=1`` keeps the chosen one
    (the KV before averaging existed, bit for bit)."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none", collect_copies=2)
    engine.next_token_logits(p1)
    engine.stitcher.config = replace(engine.stitcher.config, collect_copies=1)
    engine.next_token_logits(p3)
    assert engine.cache_stats()["stitching"]["averaged_tokens"] == 0

    engine = _engine(llama, tokenizer, recompute_strategy="none", collect_copies=2)
    engine.next_token_logits(p1)
    engine.next_token_logits(p2)
    engine.stitcher.config = StitchConfig(recompute_strategy="none", average_copies=1)
    single = engine._prepare(p3, max_reuse=len(p3) - 1, stitch=True)
    engine.stitcher.config = StitchConfig(recompute_strategy="none", average_copies=2)
    averaged = engine._prepare(p3, max_reuse=len(p3) - 1, stitch=True)
    assert engine.cache_stats()["stitching"]["averaged_tokens"] > 0
    changed = (single.cache.layers[-1].values != averaged.cache.layers[-1].values).any(dim=-1).any(dim=1)
    assert changed[0].sum() > 0 and changed[0].sum() < len(p3) - 1


def test_averaging_leaves_recompute_everything_exact(llama, tokenizer):
    """Recomputing every stitched token still equals no-cache (1e-5, fp32) with averaged copies."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=10_000, collect_copies=2)
    engine.next_token_logits(p1)
    engine.next_token_logits(p2)
    engine.stitcher.config = replace(engine.stitcher.config, collect_copies=1)
    result = engine.next_token_logits(p3)
    assert result.recomputed_tokens > 0
    with torch.no_grad():
        want = llama(torch.tensor([p3])).logits[0, -1]
    torch.testing.assert_close(result.logits, want, atol=1e-5, rtol=0)


def test_collect_copies_computes_a_document_held_once(llama, tokenizer):
    """``collect_copies=2``: a prompt whose documents are stored once computes them (nothing stitched, the
    tokens counted as collected); the next prompt stitches them from two copies and averages."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, collect_copies=2)
    engine.next_token_logits(p1)
    second = engine.generate(p2, max_new_tokens=1)
    stats = engine.cache_stats()["stitching"]
    assert second.recomputed_tokens == 0 and stats["requests"] == 0 and stats["collected_tokens"] >= 80
    engine.stitcher.config = StitchConfig()  # collect_copies=1: stitch what is held
    third = engine.generate(p3, max_new_tokens=1)
    stats = engine.cache_stats()["stitching"]
    assert third.kv_reuse_ratio > second.kv_reuse_ratio
    assert stats["requests"] == 1 and stats["averaged_tokens"] > 0


def test_stitched_copies_kept_as_approximate_entries_are_not_averaged(llama, tokenizer):
    """``keep_approximate`` keeps a stitched request's chunks; those holding copied KV are ``derived`` (the
    copy they came from is stored already), so a later prompt does not average them with their source."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none", keep_approximate=True)
    engine.next_token_logits(p1)
    engine.next_token_logits(p2)  # stitched from P1; its chunks kept as approximate entries
    entries = [e for e in engine.store._entries.values() if not e.exact]
    assert entries and any(e.derived for e in entries)
    engine.next_token_logits(p3)
    assert engine.cache_stats()["stitching"]["averaged_tokens"] == 0


def test_copy_pieces_keeps_copies_that_agree_as_far_back():
    """Per run, the other copies whose chain starts within ``slack`` of the run (an alignment shift) are
    kept; a copy that starts later (it followed another neighbour) and derived copies are not; at most
    ``max_copies - 1`` chains, the earliest first."""
    root = ChunkHash(b"r" * 32)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]
    store = ListedStore()
    # The chosen copy: A then B, computed as neighbours (history x): one run over both.
    xa = store.add(root, a[:4], b"xa0", b"x")
    xa1 = store.add(root, a[4:], b"xa1", xa.key)
    xb = store.add(root, b[:4], b"xb0", xa1.key)
    xb1 = store.add(root, b[4:], b"xb1", xb.key)
    # A after history y, shifted by 2 (other chunk alignment): kept.
    ya = store.add(root, a[2:6], b"ya0", b"y")
    # B after history z: starts 8 tokens after the run, beyond slack 4: not kept.
    store.add(root, b[:4], b"zb0", b"z")
    # A derived from another copy: never kept.
    store.add(root, a[:4], b"da0", b"d", derived=True)
    # A after history w, unshifted: kept, and first (it starts earlier than y's).
    wa = store.add(root, a[:4], b"wa0", b"w")
    ids = [99, *a, *b, 98]
    lookup = ContentLookup(store, root, ids, len(ids), [4])
    pieces = [
        StitchedPiece(start=1 + 4 * i, end=5 + 4 * i, entry=e) for i, e in enumerate([xa, xa1, xb, xb1])
    ]
    (chains,) = copy_pieces(lookup, pieces, max_copies=4, slack=4)
    assert [[p.entry.key for p in chain] for chain in chains] == [[wa.key], [ya.key]]
    assert [(p.start, p.end) for p in chains[1]] == [(3, 7)]
    (chains,) = copy_pieces(lookup, pieces, max_copies=2, slack=4)
    assert [[p.entry.key for p in chain] for chain in chains] == [[wa.key]]


@pytest.mark.parametrize("field", ["average_copies", "collect_copies"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_copy_options_are_validated(field, value):
    with pytest.raises(ConfigError, match=field):
        StitchConfig(**{field: value})


def test_a_copy_computed_after_the_prompts_own_history_is_not_averaged_or_collected(llama, tokenizer):
    """The same stitched prompt asked again finds its own kept chunks (computed after its very tokens): they
    serve it alone, neither averaged with copies after other histories nor computed again to collect one."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none", keep_approximate=True, collect_copies=2)
    engine.next_token_logits(p1)
    engine.next_token_logits(p2)
    engine.stitcher.config = replace(engine.stitcher.config, collect_copies=1)
    first = engine.next_token_logits(p3)  # averages P1's and P2's copies; keeps its own chunks (derived)
    before = engine.cache_stats()["stitching"]
    assert before["averaged_tokens"] > 0
    engine.stitcher.config = replace(engine.stitcher.config, collect_copies=2)
    again = engine.next_token_logits(p3)
    after = engine.cache_stats()["stitching"]
    assert after["requests"] == before["requests"] + 1  # stitched again, from its own chunks
    assert after["averaged_tokens"] == before["averaged_tokens"]
    assert after["collected_tokens"] == before["collected_tokens"]
    assert again.cached_tokens >= first.cached_tokens


def test_with_collect_copies_a_prompt_waits_only_for_sources_that_bring_enough_copies(llama, tokenizer):
    """``collect_copies=2``, three prompts added together: the second is not held (the first alone brings one
    copy, so it would compute the documents anyway); the third waits for both and stitches from two
    copies, averaged."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none", collect_copies=2)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    a = engine.add_request(p1, params)
    b = engine.add_request(p2, params)
    c = engine.add_request(p3, params)
    assert b not in engine.core.deferred and c in engine.core.deferred
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    assert set(results) == {a, b, c}
    assert not any(h.kind == HitKind.STITCHED for h in results[b].chunks)
    assert any(h.kind == HitKind.STITCHED for h in results[c].chunks)
    assert engine.cache_stats()["stitching"]["averaged_tokens"] > 0
