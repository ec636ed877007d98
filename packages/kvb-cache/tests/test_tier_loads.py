"""Disk/Redis lookups of waiting requests run off the engine loop: a slow tier never stalls the streams."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.core import tier_loads
from kvb_cache.core.block_tiers import BlockTiers
from kvb_cache.hashing import prefix_hash
from kvb_cache.tiers import TierConfig

STORED = list(range(3, 73))  # 70 tokens: four full blocks of 16 go to the disk
OTHER = list(range(100, 140))
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def engine(model, tok, directory) -> KVBoost:
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16, tiers=TierConfig(disk_cache_dir=directory)))


def _stored_on_disk(model, tok, directory) -> list[int]:
    """Compute ``STORED`` in a first engine (its blocks written to ``directory``); its greedy tokens."""
    first = engine(model, tok, directory)
    out = first.generate(STORED, max_new_tokens=6, ignore_eos=True).output_ids
    first.close()
    return out


class GatedTier:
    """Wraps a tier's ``get_many``: a lookup holding ``key`` blocks until the gate opens (a stalled Redis)."""

    def __init__(self, tier, key) -> None:
        self.tier, self.key = tier, key
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.inner = tier.get_many
        tier.get_many = self

    def __call__(self, keys):
        if self.key in keys:
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.inner(keys)


def _until_token(eng: KVBoost, outputs: dict[str, list[int]], rid: str) -> None:
    """Step until ``rid`` has a token (its own lookup, a probe, may take more than a step on a busy machine)."""
    for _ in range(1000):
        if outputs.get(rid):
            return
        _run(eng, outputs, 1)
    raise AssertionError(f"{rid} got no token")


def _drain(eng: KVBoost, outputs: dict[str, list[int]]) -> dict[str, object]:
    """Step until nothing is unfinished, collecting tokens into ``outputs``; the results by request id."""
    results = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.result is not None:
                results[out.request_id] = out.result
    return results


def _run(eng: KVBoost, outputs: dict[str, list[int]], steps: int) -> None:
    for _ in range(steps):
        for out in eng.step():
            assert out.error is None, out.error
            outputs.setdefault(out.request_id, []).extend(out.token_ids)


def test_a_stalled_tier_lookup_holds_up_only_its_own_request(llama, tokenizer, tmp_path):
    reference = _stored_on_disk(llama, tokenizer, tmp_path)
    alone = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16)).generate(
        OTHER, max_new_tokens=12, ignore_eos=True
    )
    eng = engine(llama, tokenizer, tmp_path)
    outputs: dict[str, list[int]] = {}
    running = eng.add_request(OTHER, SamplingParams(max_new_tokens=12, ignore_eos=True))
    _until_token(eng, outputs, running)  # prefilled, decoding
    gated = GatedTier(eng.tiers.lower[0].tier, prefix_hash(eng.root, STORED[:16]))
    waiting = eng.add_request(STORED, GREEDY)
    before = len(outputs[running])
    _run(eng, outputs, 5)
    # Before, the lookup ran inside the step: these five steps were one step blocked on the tier.
    assert gated.entered.is_set()
    assert len(outputs[running]) == before + 5
    assert waiting not in outputs
    assert eng.paged_stats().loading == 1
    gated.gate.set()
    while eng.has_unfinished():
        _run(eng, outputs, 1)
    assert outputs[running] == alone.output_ids
    assert outputs[waiting] == reference
    stats = eng.paged_stats()
    assert stats.loading == 0 and stats.tier_loads >= 1
    assert stats.prefix_cache_hits >= 64  # the four disk blocks were promoted, not recomputed


def test_aborting_a_request_whose_lookup_is_in_flight_leaves_nothing_behind(llama, tokenizer, tmp_path):
    _stored_on_disk(llama, tokenizer, tmp_path)
    eng = engine(llama, tokenizer, tmp_path)
    gated = GatedTier(eng.tiers.lower[0].tier, prefix_hash(eng.root, STORED[:16]))
    waiting = eng.add_request(STORED, GREEDY)
    outputs: dict[str, list[int]] = {}
    _run(eng, outputs, 2)
    assert gated.entered.wait(10) and eng.paged_stats().loading == 1
    assert eng.abort(waiting)
    gated.gate.set()
    assert not eng.has_unfinished()
    _run(eng, outputs, 2)
    stats = eng.paged_stats()
    assert waiting not in outputs
    assert stats.loading == 0 and stats.waiting == 0 and stats.blocks_used == 0
    # The engine still serves, and the disk blocks are still there to promote.
    again = eng.generate(STORED, max_new_tokens=2, ignore_eos=True)
    assert again.cached_tokens == 64


def test_a_lookup_that_answers_at_once_is_admitted_in_the_same_step(llama, tokenizer, tmp_path, monkeypatch):
    """An idle engine adds no step of latency: the step waits for the lookups it started (a grace made long
    here, so that a loaded machine cannot make the test flaky) and admits the request with its blocks."""
    monkeypatch.setattr(tier_loads, "LOAD_GRACE_S", 30.0)
    _stored_on_disk(llama, tokenizer, tmp_path)
    eng = engine(llama, tokenizer, tmp_path)
    rid = eng.add_request(STORED, GREEDY)
    first = eng.step()
    assert [o.request_id for o in first] == [rid] and len(first[0].token_ids) == 1
    assert eng.paged_stats().prefix_cache_hits == 64


def test_a_lookup_that_fails_recomputes_the_prompt(llama, tokenizer, tmp_path, caplog):
    reference = _stored_on_disk(llama, tokenizer, tmp_path)
    eng = engine(llama, tokenizer, tmp_path)

    def broken(keys):
        raise OSError("the tier went away")

    eng.tiers.lower[0].tier.get_many = broken
    with caplog.at_level(logging.WARNING, logger="kvb_cache.core.block_tiers"):
        a = eng.generate(STORED, max_new_tokens=6, ignore_eos=True)
        eng.clear_cache()
        b = eng.generate(STORED, max_new_tokens=6, ignore_eos=True)
    assert a.output_ids == reference and b.output_ids == reference
    assert a.cached_tokens == 0 and b.cached_tokens == 0
    assert sum("tier lookup failed" in r.getMessage() for r in caplog.records) == 1  # said once


def _inline_fetch(self: BlockTiers, keys) -> Future:
    future: Future = Future()
    future.set_result(self.fetch(keys))
    return future


def _first_token_steps(eng: KVBoost, prompts: list[list[int]]) -> tuple[list[int], list]:
    """Run ``prompts`` through the step loop together: the step of each one's first token, its results."""
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
    first: dict[str, int] = {}
    results = {}
    step = 0
    while eng.has_unfinished():
        step += 1
        for out in eng.step():
            assert out.error is None
            first.setdefault(out.request_id, step)
            if out.result is not None:
                results[out.request_id] = out.result
    return [first[i] for i in ids], [results[i] for i in ids]


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_seqs": 4}, {"num_blocks": 20}],
    ids=["default", "max-num-seqs", "small-pool"],
)
def test_a_burst_of_disk_hits_is_admitted_as_fast_as_ram_hits(
    llama, tokenizer, tmp_path, monkeypatch, options
):
    """Ten waiting requests that all hit the disk: each is admitted with its blocks and answers as computed,
    in the same steps as when RAM holds the blocks (the lookups run ahead of admission, bounded by
    ``max_num_seqs`` and half the pool, never one request at a time); with a 20-block pool, which cannot
    hold the ten prompts' blocks, only the answers and the hits are compared."""
    # The lookups answer at once (run inline): what is compared is how many the bounds let run ahead, not
    # how fast a loader thread is scheduled on a loaded machine.
    monkeypatch.setattr(BlockTiers, "fetch_async", _inline_fetch)
    prompts = [list(range(s, s + 50)) for s in range(3, 73, 7)]

    def make(tiers: bool) -> KVBoost:
        extra = {"tiers": TierConfig(disk_cache_dir=tmp_path)} if tiers else {}
        return KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, **extra, **options))

    first = make(tiers=True)
    reference = [r.output_ids for r in first.generate_batch(prompts, max_new_tokens=4, ignore_eos=True)]
    first.close()
    steps, results = _first_token_steps(make(tiers=True), prompts)
    assert [r.output_ids for r in results] == reference
    assert all(r.cached_tokens == 48 for r in results)
    if "num_blocks" not in options:
        ram = make(tiers=False)
        ram.generate_batch(prompts, max_new_tokens=1)  # the same blocks, held in RAM
        ram_steps, ram_results = _first_token_steps(ram, prompts)
        assert all(r.cached_tokens >= 48 for r in ram_results)  # RAM also matches the partial tail
        assert steps == ram_steps


def test_a_queued_request_loads_its_records_while_the_batch_is_full(llama, tokenizer, tmp_path):
    """With every place taken (``max_num_seqs``), the next waiting request's records are read meanwhile, so it
    is admitted with them in the step a place frees up (before, its lookup started only then)."""
    reference = _stored_on_disk(llama, tokenizer, tmp_path)
    eng = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=16, max_num_seqs=1, tiers=TierConfig(disk_cache_dir=tmp_path)),
    )
    gated = GatedTier(eng.tiers.lower[0].tier, prefix_hash(eng.root, STORED[:16]))
    outputs: dict[str, list[int]] = {}
    running = eng.add_request(OTHER, SamplingParams(max_new_tokens=6, ignore_eos=True))
    _until_token(eng, outputs, running)
    waiting = eng.add_request(STORED, GREEDY)
    _run(eng, outputs, 1)
    assert gated.entered.wait(10), "the lookup did not start while the batch was full"
    assert eng.paged_stats().loading == 1
    gated.gate.set()
    while eng.has_unfinished():
        _run(eng, outputs, 1)
    assert len(outputs[running]) == 6 and outputs[waiting] == reference
    assert eng.paged_stats().prefix_cache_hits >= 64


def test_a_stitched_prompt_is_planned_once_its_prefix_records_are_read(
    llama, tokenizer, tmp_path, monkeypatch
):
    """Planning a stitched prompt reads its exact prefix: where that continues on the disk, the records are
    read off the loop and the request is held meanwhile (the running stream keeps going); once read, it is
    planned and served exactly as when the prefix was read inline."""
    from conftest import words

    from kvb_cache import StitchConfig

    docs = [tokenizer(words(40, seed=s))["input_ids"] for s in (1, 2, 3)]
    system = tokenizer(words(20, seed=9))["input_ids"]
    other = tokenizer(words(20, seed=10))["input_ids"]
    question = tokenizer(words(6, seed=7))["input_ids"]
    on_disk = system + docs[0] + docs[1] + docs[2] + question  # its blocks go to the disk
    seen = other + docs[2] + docs[0] + docs[1] + question  # the documents, in this engine's stitching store
    asked = system + docs[0] + docs[2] + docs[1] + tokenizer(words(6, seed=8))["input_ids"]

    def make(directory) -> KVBoost:
        tiers = TierConfig(disk_cache_dir=directory)
        return KVBoost(
            llama, tokenizer, config=EngineConfig(chunk_size=16, stitching=StitchConfig(), tiers=tiers)
        )

    def serve(eng: KVBoost, gate: bool) -> tuple[list[int], object, int]:
        eng.generate(seen, max_new_tokens=1)
        gated = GatedTier(eng.tiers.lower[0].tier, prefix_hash(eng.root, asked[:16])) if gate else None
        outputs: dict[str, list[int]] = {}
        running = eng.add_request(OTHER, SamplingParams(max_new_tokens=12, ignore_eos=True))
        _until_token(eng, outputs, running)
        rid = eng.add_request(asked, GREEDY)
        held_steps = 0
        if gated is not None:
            assert gated.entered.wait(10)
            assert rid in eng.core.deferred  # held while its prefix is read
            before = len(outputs.get(running, []))
            _run(eng, outputs, 3)
            held_steps = len(outputs[running]) - before
            gated.gate.set()
        result = _drain(eng, outputs)[rid]
        return outputs[rid], result, held_steps

    for directory in (tmp_path / "a", tmp_path / "b"):
        first = make(directory)
        first.generate(on_disk, max_new_tokens=1)
        first.close()
    monkeypatch.setattr(BlockTiers, "fetch_async", _inline_fetch)
    inline_ids, inline, _ = serve(make(tmp_path / "a"), gate=False)  # the prefix read inline (as before)
    monkeypatch.undo()
    ids, result, held_steps = serve(make(tmp_path / "b"), gate=True)
    assert held_steps == 3  # the running stream's tokens: it stepped on while the prefix was read
    assert result.cached_tokens == inline.cached_tokens and result.cached_tokens >= 48
    assert [c.kind for c in result.chunks] == [c.kind for c in inline.chunks]
    assert any(c.kind == "stitched" for c in result.chunks)
    assert ids == inline_ids


def test_a_prefix_evicted_between_lookup_and_admission_is_read_again(llama, tokenizer, tmp_path):
    """The pool's run of a waiting request's prefix shrank after its lookup began (a larger request evicted
    it): the records read no longer join that run, so the request gets a fresh lookup before admission
    instead of recomputing blocks the disk holds (found by an audit: 0 of 64 tokens reused)."""
    reference = _stored_on_disk(llama, tokenizer, tmp_path)
    big = [(7 * i) % 280 + 10 for i in range(170)]  # 11 blocks of the 12-block pool
    eng = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(
            chunk_size=16,
            num_blocks=12,
            max_num_seqs=2,
            max_num_batched_tokens=170,
            scheduling_policy="priority",
            tiers=TierConfig(disk_cache_dir=tmp_path),
        ),
    )
    eng.generate(STORED[:33], max_new_tokens=1)  # STORED's first two blocks now cached in RAM
    eng.add_request(big, SamplingParams(max_new_tokens=8, ignore_eos=True), priority=0)
    rid = eng.add_request(STORED, GREEDY, priority=1)  # its lookup starts after those two blocks
    outputs: dict[str, list[int]] = {}
    result = _drain(eng, outputs)[rid]
    assert outputs[rid] == reference
    assert result.cached_tokens == 64
    assert eng.paged_stats().tier_loads >= 2  # read again once its RAM prefix was gone


def test_a_large_request_is_not_starved_by_a_stream_of_small_lookups(llama, tokenizer, tmp_path):
    """The half-the-pool bound refused a 7-block request's lookup while later 1-block arrivals, one per step,
    kept taking it; it was bypassed 247 times (past MAX_BYPASS) and ran only once they stopped (a review's
    repro). The oldest request needing a lookup now always gets it."""
    large = list(range(3, 3 + 7 * 16 + 1))  # 7 full blocks: more than half of a 12-block pool
    small = [[10 + i // 20, 100 + i % 20, *range(200, 215)] for i in range(90)]  # one block each
    first = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=16, num_blocks=40, tiers=TierConfig(disk_cache_dir=tmp_path)),
    )
    first.generate_batch([large, *small], max_new_tokens=1)
    first.close()
    eng = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=16, num_blocks=12, tiers=TierConfig(disk_cache_dir=tmp_path)),
    )
    tier = eng.tiers.lower[0].tier
    inner = tier.get_many

    def remote(keys):  # a remote tier's round trip: lookups stay in flight across steps
        time.sleep(0.02)
        return inner(keys)

    tier.get_many = remote
    rid, first_token = None, None
    for step in range(1, 121):
        if step <= len(small):
            eng.add_request(small[step - 1], SamplingParams(max_new_tokens=1, ignore_eos=True))
        if step == 3:
            rid = eng.add_request(large, SamplingParams(max_new_tokens=2, ignore_eos=True))
        if any(out.request_id == rid for out in eng.step()):
            first_token = step
            break
    assert first_token is not None and first_token < len(small)  # before the arrivals stopped


def test_a_stitched_prompts_lookup_is_counted_and_an_interrupt_while_planning_loses_nothing(
    llama, tokenizer, tmp_path
):
    """Stitched prompts held for their prefix's records count in ``tier_loads`` / ``loading`` (they were in
    neither); and a ``KeyboardInterrupt`` while a step plans the released ones puts the others back (before,
    ``Deferred.release`` had removed them all: in no queue, their streams never ended)."""
    from conftest import words

    from kvb_cache import StitchConfig

    def make() -> KVBoost:
        tiers = TierConfig(disk_cache_dir=tmp_path)
        return KVBoost(
            llama, tokenizer, config=EngineConfig(chunk_size=16, stitching=StitchConfig(), tiers=tiers)
        )

    prompts = [tokenizer(words(40, seed=100 + i))["input_ids"] for i in range(3)]
    first = make()
    reference = [r.output_ids for r in first.generate_batch(prompts, max_new_tokens=2, ignore_eos=True)]
    first.close()
    eng = make()
    tier = eng.tiers.lower[0].tier
    gate, inner = threading.Event(), tier.get_many
    tier.get_many = lambda keys: (gate.wait(30), inner(keys))[1]
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for p in prompts]
    assert all(rid in eng.core.deferred for rid in ids)
    stats = eng.paged_stats()
    assert stats.tier_loads == 3 and stats.loading == 3
    gate.set()
    while eng.paged_stats().loading:
        time.sleep(0.01)
    plan, calls = eng._plan_stitch, []

    def interrupted(req):
        calls.append(req.request_id)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return plan(req)

    eng._plan_stitch = interrupted
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    eng._plan_stitch = plan
    assert all(eng.core.knows(rid) for rid in ids) and eng.has_unfinished()
    results = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None
            if out.result is not None:
                results[out.request_id] = out.result.output_ids
    assert [results[rid] for rid in ids] == reference


def test_a_stitched_prompt_whose_planning_fails_ends_with_that_error(llama, tokenizer, tmp_path):
    """A deferred request whose planning raises ends with the error as its output; the others go on."""
    from conftest import rag_prompts

    from kvb_cache import StitchConfig

    eng = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, stitching=StitchConfig()))
    first, second = rag_prompts(tokenizer)
    a = eng.add_request(first, SamplingParams(max_new_tokens=2, ignore_eos=True))
    b = eng.add_request(second, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert b in eng.core.deferred  # held until the first prompt's documents are computed

    def broken(req):
        raise RuntimeError("planning failed")

    eng._plan_stitch = broken
    outputs = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs[a].error is None and isinstance(outputs[b].error, RuntimeError)


def test_lookups_stay_within_their_bounds_while_a_tier_stalls(llama, tokenizer, tmp_path):
    """Forty waiting requests, every lookup stalled: at most ``max_num_seqs`` requests hold a lookup, with
    records for at most half the pool (a review found the oldest-first exemption granted again every step:
    40 lookups in flight and 120 blocks held), and all are served with their blocks once the tier answers."""
    prompts = [[5 + i, *range(10, 10 + 3 * 16)] for i in range(40)]  # own chains, 3 full blocks each
    first = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(chunk_size=16, num_blocks=400, tiers=TierConfig(disk_cache_dir=tmp_path)),
    )
    first.generate_batch(prompts, max_new_tokens=1)
    first.close()
    eng = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(
            chunk_size=16, num_blocks=16, max_num_seqs=2, tiers=TierConfig(disk_cache_dir=tmp_path)
        ),
    )
    tier = eng.tiers.lower[0].tier
    gate, inner = threading.Event(), tier.get_many
    tier.get_many = lambda keys: (gate.wait(30), inner(keys))[1]
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in prompts]
    sched = eng.core.scheduler
    for _ in range(20):
        eng.step()
        held = [r.tier_load for r in sched.waiting if r.tier_load is not None]
        assert len(held) <= 2 and sum(load.blocks for load in held) <= 16 // 2
    gate.set()
    results = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.error is None
            if out.result is not None:
                results[out.request_id] = out.result
    assert all(results[i].cached_tokens == 48 for i in ids)


def test_a_deferred_prompt_failing_after_it_was_queued_ends_with_its_error(llama, tokenizer):
    """Planning queued the request, then raised: it is taken out of its queue and ends with the error (the
    abort used before waited for the step's end and then dropped the error output with the request's)."""
    from conftest import rag_prompts

    from kvb_cache import StitchConfig

    eng = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, stitching=StitchConfig()))
    first, second = rag_prompts(tokenizer)
    real = eng.core.plan_deferred

    def queue_then_fail(req):
        real(req)
        raise RuntimeError("failed after queueing")

    eng.core.plan_deferred = queue_then_fail
    with pytest.raises(
        RuntimeError, match="failed after queueing"
    ):  # generate_batch raises a request's error
        eng.generate_batch([first, second], max_new_tokens=2, ignore_eos=True)
    assert not eng.has_unfinished() and eng.paged_stats().blocks_used == 0


@pytest.mark.parametrize("on_disk", [True, False], ids=["hit", "miss"])
def test_priority_order_holds_with_a_tier(llama, tokenizer, tmp_path, monkeypatch, on_disk):
    """Under ``scheduling_policy="priority"`` a lower-ranked request whose records were read first took the
    only lookup place and was admitted ahead of a higher-ranked arrival (an audit; with any tier, since every
    new request needs a lookup, hit or miss). The lower-ranked lookups now yield; lookups run inline here
    (the order is the scheduler's, not the loader threads')."""
    monkeypatch.setattr(BlockTiers, "fetch_async", _inline_fetch)
    high_prompt = STORED if on_disk else list(range(230, 280))
    _stored_on_disk(llama, tokenizer, tmp_path)

    def first_tokens(tiers: bool) -> list[str]:
        extra = {"tiers": TierConfig(disk_cache_dir=tmp_path)} if tiers else {}
        eng = KVBoost(
            llama,
            tokenizer,
            config=EngineConfig(chunk_size=16, max_num_seqs=1, scheduling_policy="priority", **extra),
        )
        outputs: dict[str, list[int]] = {}
        running = eng.add_request(list(range(200, 220)), SamplingParams(max_new_tokens=10, ignore_eos=True))
        _until_token(eng, outputs, running)
        eng.add_request(
            OTHER, SamplingParams(max_new_tokens=3, ignore_eos=True), request_id="LOW", priority=5
        )
        _run(eng, outputs, 1)
        eng.add_request(high_prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), request_id="HIGH")
        order = []
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id in ("LOW", "HIGH") and out.request_id not in order:
                    order.append(out.request_id)
        return order

    assert first_tokens(tiers=False) == ["HIGH", "LOW"]
    assert first_tokens(tiers=True) == ["HIGH", "LOW"]


def test_loading_counts_the_callers_requests_only(llama, tokenizer, tmp_path):
    """The engine's own idle prompt waiting on a lookup is not a caller's request: ``loading`` (like
    ``waiting``) leaves it out (an audit: ``loading 1`` with nothing unfinished)."""
    from conftest import rag_prompts

    from kvb_cache import StitchConfig

    first, second = rag_prompts(tokenizer)
    config = EngineConfig(chunk_size=16, stitching=StitchConfig(), tiers=TierConfig(disk_cache_dir=tmp_path))
    eng = KVBoost(llama, tokenizer, config=config)
    eng.generate(first, max_new_tokens=1)
    eng.generate(second, max_new_tokens=1)  # stitched: queued for idle time
    assert eng.core.has_idle_work()
    tier = eng.tiers.lower[0].tier
    gate, inner = threading.Event(), tier.get_many
    tier.get_many = lambda keys: (gate.wait(30), inner(keys))[1]
    try:
        for _ in range(3):
            eng.step()  # the idle prompt comes up and waits on its lookup
        stats = eng.paged_stats()
        assert not eng.has_unfinished() and stats.waiting == 0 and stats.loading == 0
    finally:
        gate.set()


def test_a_burst_of_stitched_prompts_reads_a_bounded_number_of_prefixes_at_once(llama, tokenizer, tmp_path):
    """Each stitched prompt whose prefix continues on the disk started its lookup when added: a burst read
    (and held in memory) every prefix at once. Lookups are now part of the planning bound: at most
    ``max_num_seqs`` prompts planned or reading; the rest are held, and every one is served in the end."""
    from conftest import words

    from kvb_cache import StitchConfig

    docs = [tokenizer(words(40, seed=s))["input_ids"] for s in (1, 2, 3)]
    system = tokenizer(words(32, seed=9))["input_ids"]

    def make() -> KVBoost:
        tiers = TierConfig(disk_cache_dir=tmp_path)
        return KVBoost(
            llama,
            tokenizer,
            config=EngineConfig(
                chunk_size=16, max_num_seqs=2, stitching=StitchConfig(idle_copies=1), tiers=tiers
            ),
        )

    first = make()
    first.generate(system + docs[0] + docs[1] + docs[2], max_new_tokens=1)
    first.close()
    eng = make()
    eng.generate(tokenizer(words(16, seed=10))["input_ids"] + docs[2] + docs[0] + docs[1], max_new_tokens=1)
    gated = GatedTier(eng.tiers.lower[0].tier, prefix_hash(eng.root, system[:16]))
    asked = [
        system + docs[0] + docs[2] + docs[1] + tokenizer(words(4, seed=20 + i))["input_ids"] for i in range(6)
    ]
    started = eng.paged_stats().tier_loads
    ids = [eng.add_request(p, GREEDY) for p in asked]
    assert gated.entered.wait(10)
    assert eng.paged_stats().tier_loads - started <= 2
    assert eng.core.deferred.awaiting_room >= 4 and eng.paged_stats().waiting >= 4
    gated.gate.set()
    results = _drain(eng, {})
    assert sorted(results) == sorted(ids)
    assert all(any(c.kind == "stitched" for c in results[i].chunks) for i in ids)
    assert eng.paged_stats().blocks_used == 0
    eng.close()
