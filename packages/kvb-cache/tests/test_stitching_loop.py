"""Stitched requests in the engine loop (#16): row-sliced repair attention, true seams, private blocks,
the store rule, teacher-forced fidelity."""

from __future__ import annotations

import pytest
import torch
from conftest import ListedStore, rag_prompts, words
from torch.nn import functional as F

from kvb_cache import EngineConfig, HitKind, KVBoost, SamplingParams, StitchConfig
from kvb_cache.fidelity import compare_distributions, reference_continuation_logits, teacher_forced_logits
from kvb_cache.hashing import ChunkHash
from kvb_cache.repair import rows as repair_rows
from kvb_cache.repair.rows import RowAttention
from kvb_cache.stitch_lookup import StitchedPiece, chained_runs, find_pieces
from kvb_cache.store import ChunkEntry

CHUNK = 16


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def _engine(model, tokenizer, **stitch):
    return KVBoost(model, tokenizer, config=EngineConfig(chunk_size=CHUNK, stitching=StitchConfig(**stitch)))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("spread", ["scattered", "runs"])
def test_row_attention_equals_a_dense_position_mask(groups, spread):
    """Each recomputed row attends keys up to its position: the same numbers as one SDPA over every key with
    a dense mask, without paying for the keys after the row."""
    torch.manual_seed(0)
    kv_heads, n, d = 2, 300, 8
    if spread == "scattered":
        positions = torch.sort(torch.randperm(n)[:90]).values
    else:
        positions = torch.cat([torch.arange(0, 40), torch.arange(120, 130), torch.tensor([200, 250, 299])])
    q = torch.randn(1, kv_heads * groups, positions.numel(), d)
    k, v = torch.randn(1, kv_heads, n, d), torch.randn(1, kv_heads, n, d)
    got = RowAttention(positions)(q, k, v, scaling=None, softcap=None)  # [1, Q, H, D]
    allowed = torch.arange(n)[None, :] <= positions[:, None]
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=allowed[None, None]
    )
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-5, rtol=0)
    # Segments stop at their last row's position: no row pays for keys after its segment.
    ends = [length for _, _, length, _ in RowAttention(positions).segments]
    assert max(ends) == int(positions[-1]) + 1 and len(ends) > 1


def test_repair_uses_row_attention_and_stays_exact(llama, tokenizer, monkeypatch):
    """Full-attention models repair through the row-sliced path; recomputing every stitched token still
    equals no-cache (1e-5, fp32)."""
    calls = []
    original = repair_rows.RowAttention.__call__

    def counting(self, *args, **kwargs):
        calls.append(len(self.segments))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(repair_rows.RowAttention, "__call__", counting)
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=10_000)
    engine.next_token_logits(first)
    result = engine.next_token_logits(second)
    assert calls  # one call per layer of the repair forward
    assert result.recomputed_tokens == 80
    torch.testing.assert_close(result.logits, _reference(llama, second), atol=1e-5, rtol=0)


def _piece(start, end, key, parent):
    entry = ChunkEntry(key=key, parent=parent, content=b"c", token_ids=(0,) * (end - start), start=0)
    return StitchedPiece(start=start, end=end, entry=entry)


def test_chained_runs_merge_pieces_that_were_neighbours_where_computed():
    pieces = [
        _piece(10, 26, b"a", b"root"),
        _piece(26, 42, b"b", b"a"),  # computed right after "a": no seam
        _piece(42, 58, b"c", b"x"),  # computed after something else: a seam
        _piece(60, 76, b"d", b"c"),  # not adjacent here: a seam
    ]
    assert chained_runs(pieces) == [(10, 42), (42, 58), (60, 76)]


def test_lookup_keeps_a_document_on_one_stored_copy():
    """A document stored twice (after two different histories): the copy listed first for a later chunk is
    the other history's, yet the lookup follows the parent links of the copy it started with, so the
    document is one run (one seam), not a seam at every switch between copies."""
    root = ChunkHash(b"r" * 32)
    doc = [list(range(10 * c, 10 * c + 4)) for c in range(6)]  # six 4-token chunks
    store = ListedStore()
    for history in (b"x", b"y"):
        parent = history
        for c, tokens in enumerate(doc):
            key = history + bytes([c])
            parent = store.add(root, tokens, key, parent).key
    for copies in store.entries.values():
        if copies[0].token_ids != tuple(doc[0]):
            copies.reverse()  # chunks after the first list the y copy first, the first chunk the x copy
    ids = [99] * 3 + [t for tokens in doc for t in tokens] + [98]
    pieces = find_pieces(store, root, ids, start=3, stop=len(ids), lengths=[4])
    assert [p.entry.key[:1] for p in pieces] == [b"x"] * 6
    assert chained_runs(pieces) == [(3, 27)]


def test_lookup_starts_a_run_on_the_copy_whose_neighbours_follow():
    """Chunk A was stored after two histories, followed by B in one and by C in the other; in a prompt
    where B follows A, the copy of A computed before B is taken: A and B form one run."""
    root = ChunkHash(b"r" * 32)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    store = ListedStore()
    a_before_c = store.add(root, a, b"y-a", b"y")
    store.add(root, c, b"y-c", a_before_c.key)
    a_before_b = store.add(root, a, b"x-a", b"x")
    store.add(root, b, b"x-b", a_before_b.key)
    ids = [99, *a, *b, 98]
    pieces = find_pieces(store, root, ids, start=1, stop=len(ids), lengths=[4])
    assert [p.entry.key for p in pieces] == [b"x-a", b"x-b"]
    assert chained_runs(pieces) == [(1, 9)]


def test_stitched_request_decodes_in_the_batched_loop(llama, tokenizer):
    """The stitched KV goes into the request's private blocks; it then decodes in step() beside a plain
    request (no solo generator), with the same tokens as when it runs alone."""
    first, second = rag_prompts(tokenizer)
    alone = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    alone.next_token_logits(first)
    expected = alone.generate(second, max_new_tokens=6, ignore_eos=True)

    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    engine.next_token_logits(first)
    other = tokenizer(words(30, seed=11))["input_ids"]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    rid = engine.add_request(second, params)
    engine.add_request(other, params)
    assert not engine.core.solo
    results, batched_steps = {}, 0
    while engine.has_unfinished():
        batched_steps += len(engine.core.scheduler.running) == 2
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    assert batched_steps >= 5  # both rows decoded together
    got = results[rid]
    assert got.output_ids == expected.output_ids
    assert got.recomputed_tokens == expected.recomputed_tokens == 8  # two true seams x 4
    assert [c.kind for c in got.chunks].count(HitKind.STITCHED) == 5
    assert got.cached_tokens == expected.cached_tokens == 100


def test_a_stitched_request_counts_its_whole_prompt_as_a_prefix_lookup(llama, tokenizer):
    """Its admission looked up only the exact prefix, so vllm:prefix_cache_queries grew by that alone and
    the stitched server's hit rate read ~5x too high (41% where vLLM's definition gives 8.4%)."""
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    engine.generate(first, max_new_tokens=2, ignore_eos=True)
    before = engine.paged_stats()
    result = engine.generate(second, max_new_tokens=2, ignore_eos=True)
    after = engine.paged_stats()
    assert any(c.kind is HitKind.STITCHED for c in result.chunks)
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)
    exact = sum(c.cached_tokens for c in result.chunks if c.kind in (HitKind.EXACT, HitKind.PARTIAL))
    assert after.prefix_cache_hits - before.prefix_cache_hits == exact < len(second) - 1


def test_a_request_added_while_another_decodes_stitches_its_prompt(llama, tokenizer):
    """A running request's prompt chunks are kept once its prompt is computed: a RAG request arriving while
    it still decodes stitches them (it used to wait for the first request to finish), and the stitched one
    gets the same tokens as when the first had finished before it came."""
    first, second = rag_prompts(tokenizer)
    after = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    after.generate(first, max_new_tokens=2, ignore_eos=True)
    expected = after.generate(second, max_new_tokens=5, ignore_eos=True)

    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    running = engine.add_request(first, long)
    while not engine.core.scheduler.find(running).output_ids:
        engine.step()
    rid = engine.add_request(second, SamplingParams(max_new_tokens=5, ignore_eos=True))
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    got = results[rid]
    assert len(results[running].output_ids) == 30  # the first was still decoding when the second came
    assert (
        [c.kind for c in got.chunks].count(HitKind.STITCHED)
        == [c.kind for c in expected.chunks].count(HitKind.STITCHED)
        > 0
    )
    assert got.cached_tokens == expected.cached_tokens and got.output_ids == expected.output_ids


def test_prompts_added_together_stitch_from_each_other(llama, tokenizer):
    """A prompt whose documents an earlier, still-prefilling request brings waits for that request's prompt
    (core/deferred.py) and then stitches them, instead of computing them a second time beside it (before,
    requests added together never stitched from each other)."""
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    a = engine.add_request(first, SamplingParams(max_new_tokens=6, ignore_eos=True))
    b = engine.add_request(second, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert b in engine.core.deferred and engine.core.knows(b) and engine.has_unfinished()
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    stitched = [c for c in results[b].chunks if c.kind == HitKind.STITCHED]
    assert stitched and results[b].cached_tokens > 32  # more than the shared system prompt
    assert len(results[a].output_ids) == len(results[b].output_ids) == 6
    # Unrelated prompts are not held back.
    other = engine.add_request(tokenizer(words(30, seed=21))["input_ids"], SamplingParams(max_new_tokens=2))
    assert other not in engine.core.deferred
    engine.abort(other)


def test_a_held_request_can_be_aborted_and_outlives_an_aborted_source(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    a = engine.add_request(first, params)
    b = engine.add_request(second, params)
    assert engine.abort(b) and b not in engine.core.deferred and not engine.core.knows(b)
    c = engine.add_request(second, params)
    assert c in engine.core.deferred
    engine.abort(a)  # its source goes away before computing anything: c is planned without it
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    assert list(results) == [c] and len(results[c].output_ids) == 3
    assert engine.paged_stats().blocks_used == 0


def test_stitched_blocks_are_private_and_freed(llama, tokenizer):
    """Approximate KV is never registered: after the request, the pool indexes only its exact prefix, and
    every block it held is back."""
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="none")
    engine.next_token_logits(first)
    free_before = engine.kv.pool.num_free
    registrations = engine.kv.pool.registrations
    engine.generate(second, max_new_tokens=4, ignore_eos=True)
    assert engine.kv.pool.num_free == free_before
    # At most the exact prefix (before the first stitched piece at 32) got new full blocks.
    assert engine.kv.pool.registrations - registrations <= 32 // engine.kv.block_size
    assert engine.paged_stats().blocks_used == 0


def test_stitched_request_survives_preemption(llama, tokenizer):
    """A preempted stitched request resumes by exact recomputation and still finishes."""
    first, second = rag_prompts(tokenizer)
    config = EngineConfig(
        chunk_size=CHUNK, stitching=StitchConfig(recompute_strategy="none"), num_blocks=14, block_size=16
    )
    engine = KVBoost(llama, tokenizer, config=config)
    engine.next_token_logits(first)
    other_ids = tokenizer(words(50, seed=12))["input_ids"]
    engine.next_token_logits(other_ids)  # cached: admitted first, so the stitched request is the newest
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    other = engine.add_request(other_ids, params)
    rid = engine.add_request(second, params)
    stitched = engine.core.scheduler.find(rid)
    assert stitched.prepared_kv is not None and stitched.exact_until == 32
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    assert stitched.preemptions > 0
    assert len(results[rid].output_ids) == 40 and len(results[other].output_ids) == 40
    assert engine.paged_stats().blocks_used == 0


def test_teacher_forced_logits_equal_no_cache_for_exact_and_fully_repaired_reuse(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    continuation = tokenizer(words(7, seed=5))["input_ids"]
    reference = reference_continuation_logits(llama, second, continuation)
    exact = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=CHUNK))
    exact.next_token_logits(second)
    got = teacher_forced_logits(exact, second, continuation)
    assert got.logits.shape == (len(continuation), reference.shape[-1])
    torch.testing.assert_close(got.logits, reference, atol=1e-5, rtol=0)

    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=10_000)
    engine.next_token_logits(first)
    got = teacher_forced_logits(engine, second, continuation)
    assert got.recomputed_tokens == 80
    torch.testing.assert_close(got.logits, reference, atol=1e-5, rtol=0)
    agreement = compare_distributions(reference, got.logits)
    assert agreement.top1_agreement == 1.0 and agreement.mean_kl < 1e-9

    approx = _engine(llama, tokenizer, recompute_strategy="none")
    approx.next_token_logits(first)
    drift = compare_distributions(reference, teacher_forced_logits(approx, second, continuation).logits)
    assert drift.mean_kl > 1e-6 and len(drift.kl) == len(continuation)


def test_lookup_prefers_the_exact_copy_at_equal_reach():
    """Two copies of a chunk, one computed over stitched KV (approximate), one over a true history: with
    nothing to tell them apart by seams, the exact one serves."""
    root = ChunkHash(b"r" * 32)
    store = ListedStore()
    approximate = store.add(root, [1, 2, 3, 4], b"approx", b"y")
    approximate.exact = False
    store.add(root, [1, 2, 3, 4], b"exact", b"x")
    pieces = find_pieces(store, root, [9, 1, 2, 3, 4, 9], start=1, stop=6, lengths=[4])
    assert [p.entry.key for p in pieces] == [b"exact"]


def _docs(tokenizer):
    system = tokenizer(words(20, seed=9))["input_ids"]
    docs = [tokenizer(words(40, seed=s))["input_ids"] for s in (1, 2, 3)]
    question = [tokenizer(words(6, seed=s))["input_ids"] for s in (7, 8, 10)]
    return system, docs, question


def test_a_document_first_seen_after_a_stitched_one_is_stitched_later(llama, tokenizer):
    """C is new in the second prompt, which stitches B: C's KV there is computed over re-positioned KV, so
    it is kept as approximate chunks (content lookup only). The third prompt then stitches C instead of
    recomputing it, and recomputing every stitched token still equals no-cache."""
    system, (a, b, c), (q1, q2, q3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4, keep_approximate=True)
    engine.next_token_logits(system + a + b + q1)
    second = system + b + c + q2
    assert engine.next_token_logits(second).recomputed_tokens > 0  # B was stitched
    inexact = [e for e in engine.store._entries.values() if not e.exact]
    c_start = len(system) + len(b)
    assert any(e.start + e.num_tokens > c_start for e in inexact)  # C's chunks are kept (approximate)
    third = system + c + a + q3
    result = engine.generate(third, max_new_tokens=1)
    stitched = [h for h in result.chunks if h.kind is HitKind.STITCHED]
    c_range = range(len(system), len(system) + len(c))
    assert sum(1 for h in stitched for p in range(h.start, h.end) if p in c_range) >= len(c) - CHUNK

    exact_engine = _engine(
        llama, tokenizer, recompute_strategy="selective", overlap_k=10_000, keep_approximate=True
    )
    for prompt in (system + a + b + q1, second):
        exact_engine.next_token_logits(prompt)
    logits = exact_engine.next_token_logits(third)
    assert logits.cached_tokens > len(system) + CHUNK  # C served from the approximate chunks
    torch.testing.assert_close(logits.logits, _reference(llama, third), atol=1e-5, rtol=0)


def test_approximate_chunks_are_never_a_prefix_hit(llama, tokenizer):
    """Their keys live on the approximate chain: no prefix hash of any prompt names one, and asking the
    stitched prompt again reuses exactly the same exact prefix as the first time."""
    from kvb_cache.lookup import chunk_keys

    system, (a, b, c), (q1, q2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4, keep_approximate=True)
    first, second = system + a + b + q1, system + b + c + q2
    engine.next_token_logits(first)
    before = engine.generate(second, max_new_tokens=1)
    again = engine.generate(second, max_new_tokens=1)
    prefix_keys = set()
    for ids in (first, second):
        prefix_keys |= set(chunk_keys(engine.root, ids, engine.chunker.split(ids)).prefix)
    inexact = {k for k, e in engine.store._entries.items() if not e.exact}
    assert inexact and not inexact & prefix_keys
    # Asked again, its exact prefix reaches the first time's first stitched position, never past it.
    stitched_before = min(h.start for h in before.chunks if h.kind is HitKind.STITCHED)
    exact_again = max(h.end for h in again.chunks if h.kind in (HitKind.EXACT, HitKind.PARTIAL))
    assert exact_again == stitched_before < len(system) + len(b)
    # Asked again, it is served from its own kept chunks after that prefix (computed after its very tokens).
    assert again.kv_reuse_ratio >= before.kv_reuse_ratio


def test_approximate_chunks_are_kept_only_when_asked(llama, tokenizer):
    """``keep_approximate`` is off by default: a stitched request then stores nothing after its first
    stitched piece, and a document first seen there is computed again next time."""
    system, (a, b, c), (q1, q2, q3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, recompute_strategy="selective", overlap_k=4)
    engine.next_token_logits(system + a + b + q1)
    engine.next_token_logits(system + b + c + q2)
    assert all(e.exact for e in engine.store._entries.values())
    result = engine.generate(system + c + a + q3, max_new_tokens=1)
    c_range = range(len(system), len(system) + len(c))
    assert not any(
        p in c_range for h in result.chunks if h.kind is HitKind.STITCHED for p in range(h.start, h.end)
    )


@pytest.mark.parametrize("ends", ["abort", "finish"])
def test_a_held_prompt_waits_on_its_source_request_not_on_its_id(llama, tokenizer, ends):
    """A prompt held for the request computing its documents waited on that request's *id*: once the
    source ended and a new request took the id before the next step (held behind the first in turn), the two
    waited on each other and the engine never finished."""
    first, second = rag_prompts(tokenizer)
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, stitching=StitchConfig()))
    p = SamplingParams(max_new_tokens=3, ignore_eos=True)
    engine.add_request(first, p if ends == "abort" else SamplingParams(max_new_tokens=1), request_id="a")
    engine.add_request(second, p, request_id="b")
    assert "b" in engine.core.deferred
    if ends == "abort":
        engine.abort("a")
    else:
        while engine.core.scheduler.find("a") is not None:
            engine.step()
    engine.add_request(first, p, request_id="a")  # the id is free again
    finished = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finished += [o.request_id for o in engine.step() if o.finished]
    assert not engine.has_unfinished() and sorted(finished) == ["a", "b"]


def test_a_burst_of_stitched_prompts_is_planned_a_bounded_number_at_a_time(llama, tokenizer):
    """Planning assembles a prompt's whole KV beside the pool until it is admitted. A burst was planned as it
    arrived (60 prompts of 1,600 tokens held 1.5 GB on a small model); now at most ``max_num_seqs`` prompts
    (and half the pool's tokens) are planned and not admitted at once, the rest held and planned oldest
    first, each still stitched, and an abort of a held one leaves nothing behind."""
    docs = [words(40, seed=300 + i) for i in range(3)]
    engine = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=CHUNK, max_num_seqs=2, stitching=StitchConfig(idle_copies=1)),
    )
    engine.generate(" ".join(docs), max_new_tokens=1)
    # Each prompt: its own 16-token opening (one chunk), then the documents as they were computed.
    prompts = [words(16, seed=400 + i) + " " + " ".join(docs) for i in range(8)]
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for p in prompts]
    assert engine.core.deferred.awaiting_room == 6
    stats = engine.paged_stats()  # held for room: waiting requests (a server's queue bound reads it)
    assert stats.running <= 2 and stats.waiting == 6 + sum(1 for _ in engine.core.scheduler.waiting)
    engine.abort(ids[5])
    assert engine.core.deferred.awaiting_room == 5
    planned_order, results = [], {}
    while engine.has_unfinished():
        core = engine.core
        planned = [
            *core.preparing.requests(),
            *(r for r in core.scheduler.waiting if r.prepared_kv is not None),
        ]
        assert len(planned) <= 2
        planned_order += [r.request_id for r in planned if r.request_id not in planned_order]
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
    assert sorted(results) == sorted(i for i in ids if i != ids[5])
    assert [i for i in planned_order if i in ids] == [i for i in ids if i != ids[5] and i in planned_order]
    for rid in results:
        assert any(c.kind == HitKind.STITCHED for c in results[rid].chunks), rid
    assert engine.paged_stats().blocks_used == 0 and not engine.core.deferred


def test_held_stitched_prompts_are_planned_by_priority_under_the_priority_policy(llama, tokenizer):
    """Prompts held for planning room were planned in arrival order, so an urgent one added behind a burst
    finished last (a review); under ``scheduling_policy="priority"`` they are planned in (priority, arrival)
    order."""
    docs = [words(40, seed=300 + i) for i in range(3)]
    engine = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(
            chunk_size=CHUNK,
            max_num_seqs=1,
            scheduling_policy="priority",
            stitching=StitchConfig(idle_copies=1),
        ),
    )
    engine.generate(" ".join(docs), max_new_tokens=1)
    prompts = [words(16, seed=700 + i) + " " + " ".join(docs) for i in range(5)]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:4]]
    urgent = engine.add_request(prompts[4], params, priority=-10)
    assert urgent in engine.core.deferred
    done = []
    while engine.has_unfinished():
        done += [o.request_id for o in engine.step() if o.result is not None]
    assert done.index(urgent) <= 1 and sorted(done) == sorted([*ids, urgent])


def test_a_solo_stitched_prompt_counts_only_what_the_pool_served_as_hits(llama, tokenizer):
    """A stitched prompt on the solo path (``kv_cache_bits``) counted its ``exact_until`` as prefix-cache
    hits, which also covers a computed gap before its first stitched piece: 16 hits for a never-cached
    opening (a review). It counts what the batched path counts: the exact and partial chunks."""
    docs = [words(40, seed=300 + i) for i in range(3)]
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(chunk_size=CHUNK, stitching=StitchConfig(idle_copies=1))
    )
    engine.generate(" ".join(docs), max_new_tokens=1)
    prompt = words(16, seed=900) + " " + " ".join(reversed(docs))
    before = engine.paged_stats()
    result = engine.generate(prompt, max_new_tokens=2, ignore_eos=True, kv_cache_bits=8)
    after = engine.paged_stats()
    assert any(c.kind is HitKind.STITCHED for c in result.chunks)
    served = sum(c.cached_tokens for c in result.chunks if c.kind in (HitKind.EXACT, HitKind.PARTIAL))
    assert after.prefix_cache_hits - before.prefix_cache_hits == served
    assert after.prefix_cache_queries - before.prefix_cache_queries == result.prompt_tokens
