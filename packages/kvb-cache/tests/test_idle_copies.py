"""Stitched prompts computed exactly while the engine is idle (StitchConfig.idle_copies, core/idle.py)."""

from __future__ import annotations

import pytest
import torch
from test_stitch_copies import _docs

from kvb_cache import EngineConfig, KVBoost, SamplingParams, StitchConfig
from kvb_cache.core.idle import IdleQueue
from kvb_cache.errors import ConfigError

CHUNK = 16


def _engine(model, tokenizer, *, prefill_chunk_size=None, **stitch):
    config = EngineConfig(
        chunk_size=CHUNK, stitching=StitchConfig(**stitch), prefill_chunk_size=prefill_chunk_size
    )
    return KVBoost(model, tokenizer, config=config)


def _idle(engine):
    return engine.cache_stats()["stitching"]["idle"]


def _plain_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_a_stitched_prompt_is_computed_when_idle_then_served_exactly(llama, tokenizer):
    """The second prompt stitches documents held once: it is queued, computed by ``run_idle`` (not counted
    as a request), then asked again it is an exact prefix hit whose logits equal no-cache, and a third
    order of the documents averages the two copies."""
    _, _, (p1, p2, p3) = _docs(tokenizer)
    engine = _engine(llama, tokenizer)
    engine.generate(p1, max_new_tokens=1)
    assert _idle(engine)["queued"] == 0  # nothing stitched
    stitched = engine.generate(p2, max_new_tokens=1)
    assert stitched.recomputed_tokens > 0
    assert _idle(engine)["queued"] == 1
    assert not engine.has_unfinished() and engine.has_idle_work()
    before = engine.cache_stats()
    assert engine.run_idle() > 0
    after = engine.cache_stats()
    idle = _idle(engine)
    assert (idle["queued"], idle["computed_prompts"], idle["yields"]) == (0, 1, 0)
    assert idle["computed_tokens"] > 0
    assert not engine.has_idle_work()
    for key in ("requests", "prompt_tokens", "cached_tokens", "lookups"):
        assert after[key] == before[key], key
    assert after["paged"]["prefix_cache_queries"] == before["paged"]["prefix_cache_queries"]

    again = engine.next_token_logits(p2)
    assert again.cached_tokens == len(p2) - 1 and again.recomputed_tokens == 0
    torch.testing.assert_close(again.logits, _plain_logits(llama, p2), atol=1e-5, rtol=0)

    engine.generate(p3, max_new_tokens=1)
    assert engine.cache_stats()["stitching"]["averaged_tokens"] > 0


def test_without_idle_copies_nothing_is_queued(llama, tokenizer):
    _, _, (p1, p2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, idle_copies=1)
    engine.generate(p1, max_new_tokens=1)
    engine.generate(p2, max_new_tokens=1)
    assert _idle(engine)["queued"] == 0 and not engine.has_idle_work()
    assert engine.run_idle() == 0


def test_the_idle_prompt_yields_to_a_request_and_resumes_from_its_cached_blocks(llama, tokenizer):
    """A request added while an idle prompt is part-way is served alone (same greedy tokens as on an engine
    with no idle work); the idle prompt goes back to the queue and, resumed, finds the blocks it had
    computed, so it computes fewer tokens than its prompt past the exact prefix."""
    _, _, (p1, p2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, prefill_chunk_size=32)
    engine.generate(p1, max_new_tokens=1)
    engine.generate(p2, max_new_tokens=1)
    assert engine.run_idle(max_steps=2) == 2  # two 32-token slices of p2's uncached part
    assert engine.has_idle_work() and not engine.has_unfinished()

    rid = engine.add_request(p1, SamplingParams(max_new_tokens=4))
    assert engine.has_unfinished()
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert {o.request_id for o in outputs} == {rid}
    assert _idle(engine)["yields"] == 1 and _idle(engine)["queued"] == 1
    reference = _engine(llama, tokenizer, idle_copies=1).generate(p1, max_new_tokens=4)
    assert outputs[-1].result.output_ids == reference.output_ids

    engine.run_idle()
    idle = _idle(engine)
    assert idle["computed_prompts"] == 1 and idle["queued"] == 0
    # The two slices before the yield (64 tokens, whole blocks) were found cached on resuming: the idle
    # work computed no more tokens than on an engine where nothing interrupted it.
    twin = _engine(llama, tokenizer, prefill_chunk_size=32)
    twin.generate(p1, max_new_tokens=1)
    twin.generate(p2, max_new_tokens=1)
    twin.run_idle()
    assert idle["computed_tokens"] == _idle(twin)["computed_tokens"] > 64
    assert engine.next_token_logits(p2).cached_tokens == len(p2) - 1


def test_run_idle_does_nothing_while_a_request_is_unfinished(llama, tokenizer):
    _, _, (p1, p2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer)
    engine.generate(p1, max_new_tokens=1)
    engine.generate(p2, max_new_tokens=1)
    engine.add_request(p1, SamplingParams(max_new_tokens=2))
    assert engine.run_idle() == 0 and _idle(engine)["queued"] == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.run_idle() > 0 and _idle(engine)["computed_prompts"] == 1


@pytest.mark.parametrize("reset", ["clear_cache", "reset_cache"])
def test_a_cache_reset_forgets_the_idle_work_even_part_way(llama, tokenizer, reset):
    """An idle prompt part-way holds pool blocks: a reset (an admin call on an idle server) takes it out
    instead of refusing or clearing blocks under it; the engine then serves as before."""
    _, _, (p1, p2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer, prefill_chunk_size=32)
    engine.generate(p1, max_new_tokens=1)
    engine.generate(p2, max_new_tokens=1)
    engine.run_idle(max_steps=1)
    getattr(engine, reset)()
    assert not engine.has_idle_work()
    assert engine.paged_stats().blocks_used == 0
    assert engine.generate(p1, max_new_tokens=2).cached_tokens == 0


def test_idle_queue_is_bounded_and_deduplicated():
    queue = IdleQueue(max_prompts=2)
    assert queue.add([1, 2], None) and not queue.add([1, 2], None)
    assert queue.add([3], None) and queue.add([4], None)
    assert len(queue) == 2 and queue.dropped == 1
    first = queue.pop()
    assert first == (None, (3,))
    queue.push_front(first)
    assert queue.pop() == first


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_idle_copies_is_validated(value):
    with pytest.raises(ConfigError, match="idle_copies"):
        StitchConfig(idle_copies=value)


def test_next_token_logits_queues_its_stitched_prompt_too(llama, tokenizer):
    _, _, (p1, p2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer)
    engine.next_token_logits(p1)
    assert engine.next_token_logits(p2).recomputed_tokens > 0
    assert _idle(engine)["queued"] == 1
    engine.run_idle()
    assert engine.next_token_logits(p2).cached_tokens == len(p2) - 1


def test_an_idle_prompt_stays_in_its_tenant(llama, tokenizer):
    """A salted request's prompt is computed under its salt: afterwards it is an exact hit for that salt only
    (the unsalted chain and another salt share nothing of it)."""
    _, _, (p1, p2, _) = _docs(tokenizer)
    engine = _engine(llama, tokenizer)
    engine.generate(p1, max_new_tokens=1, cache_salt="a")
    engine.generate(p2, max_new_tokens=1, cache_salt="a")
    assert engine.run_idle() > 0
    assert engine.next_token_logits(p2, cache_salt="a").cached_tokens == len(p2) - 1
    assert engine.next_token_logits(p2, cache_salt="b").cached_tokens == 0
    assert engine.next_token_logits(p2).cached_tokens == 0
