"""vLLM's priority scheduling (``scheduling_policy="priority"``): waiting order, preemption, refusals."""

from __future__ import annotations

import pytest
from conftest import words

from kvb_cache import ConfigError, EngineConfig, InvalidRequestError, KVBoost, SamplingParams

GREEDY = SamplingParams(max_new_tokens=3, ignore_eos=True)


def _first_tokens(engine: KVBoost) -> list[str]:
    """Request ids in the order their first output came."""
    order: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    return order


def test_waiting_requests_run_lowest_priority_value_first_then_by_arrival(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(max_num_seqs=1, scheduling_policy="priority"))
    engine.add_request(words(12, seed=0), GREEDY, request_id="first")
    engine.step()  # running: the one batch slot is taken
    for rid, priority in (("b5", 5), ("c-1", -1), ("d5", 5), ("e0", 0)):
        engine.add_request(words(12, seed=len(rid)), GREEDY, request_id=rid, priority=priority)
    assert _first_tokens(engine) == ["first", "c-1", "e0", "b5", "d5"]


def test_fcfs_serves_in_arrival_order_and_refuses_a_priority(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(max_num_seqs=1))
    engine.add_request(words(12, seed=0), GREEDY, request_id="first")
    engine.step()
    for rid in ("b", "c"):
        engine.add_request(words(12, seed=len(rid)), GREEDY, request_id=rid, priority=0)
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'") as info:
        engine.add_request(words(12), GREEDY, priority=1)
    assert info.value.param == "priority"
    assert _first_tokens(engine) == ["first", "b", "c"]
    for bad in (1.5, True, "1", 2**63):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(words(12), GREEDY, priority=bad)
        assert info.value.param == "priority"
    with pytest.raises(ConfigError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


@pytest.mark.parametrize(("policy", "preempted"), [("priority", "low"), ("fcfs", "high")])
def test_the_pool_running_short_preempts_the_lowest_priority(llama, tokenizer, policy, preempted):
    """Two requests outgrow a small pool: FCFS preempts the newer (here the urgent one), priority the one of
    the lowest priority (here the older); outputs stay those of each request alone."""
    prompts = {"low": words(30, seed=1), "high": words(30, seed=2)}
    solo = KVBoost(llama, tokenizer)
    expected = {
        k: solo.generate(p, max_new_tokens=24, ignore_eos=True).output_ids for k, p in prompts.items()
    }
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(block_size=4, num_blocks=24, scheduling_policy=policy)
    )
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine.add_request(prompts["low"], params, request_id="low", priority=10 if policy == "priority" else 0)
    engine.add_request(prompts["high"], params, request_id="high")
    requests = {rid: engine.core.scheduler.find(rid) for rid in prompts}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                outputs[out.request_id] = out.result.output_ids
    assert outputs == expected
    assert requests[preempted].preemptions > 0
    assert requests["low" if preempted == "high" else "high"].preemptions == 0


def test_library_calls_take_a_priority(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(scheduling_policy="priority"))
    alone = engine.generate(words(12), max_new_tokens=3, ignore_eos=True)
    assert (
        engine.generate(words(12), max_new_tokens=3, ignore_eos=True, priority=-2).output_ids
        == alone.output_ids
    )
    streamed = list(engine.stream(words(12), max_new_tokens=3, ignore_eos=True, priority=4))
    assert streamed[-1].result.output_ids == alone.output_ids
    rows = engine.generate_batch(
        [words(12), words(12)], sampling=[{"priority": 3}, {}], max_new_tokens=3, ignore_eos=True, priority=1
    )
    assert [r.output_ids for r in rows] == [alone.output_ids] * 2


def test_a_prefilling_urgent_request_preempts_a_low_priority_one_that_decoded_first(llama, tokenizer):
    """Decodes are scheduled first; the victim search skipped requests already scheduled in the step, so an
    urgent request running short while prefilling preempted itself and waited for the low-priority one to
    finish (vLLM takes the lowest-priority request back out of the step)."""
    engine = KVBoost(
        llama,
        tokenizer,
        config=EngineConfig(
            block_size=4, num_blocks=20, max_num_batched_tokens=8, scheduling_policy="priority"
        ),
    )
    low_ids = tokenizer(words(40, seed=1))["input_ids"][:36]
    high_ids = tokenizer(words(80, seed=2))["input_ids"][:40]
    engine.add_request(
        low_ids, SamplingParams(max_new_tokens=36, ignore_eos=True), request_id="low", priority=10
    )
    for _ in range(6):
        engine.step()
    engine.add_request(high_ids, SamplingParams(max_new_tokens=4, ignore_eos=True), request_id="high")
    requests = {rid: engine.core.scheduler.find(rid) for rid in ("low", "high")}
    finished, results = [], {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                finished.append(out.request_id)
                results[out.request_id] = out.result.output_ids
    assert requests["high"].preemptions == 0 and requests["low"].preemptions > 0
    assert finished == ["high", "low"]
    solo = KVBoost(llama, tokenizer)
    assert results["high"] == solo.generate(high_ids, max_new_tokens=4, ignore_eos=True).output_ids
    assert results["low"] == solo.generate(low_ids, max_new_tokens=36, ignore_eos=True).output_ids
