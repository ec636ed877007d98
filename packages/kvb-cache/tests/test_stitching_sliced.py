"""A stitched request's repair runs in slices across steps (#16): sliced equals unsliced, running requests
keep decoding while it prepares, abort and stats."""

from __future__ import annotations

import time

import pytest
import torch
import transformers as T
from conftest import _COMMON, rag_prompts, words
from conftest import make_model as make_shallow_model

from kvb_cache import EngineConfig, InvalidRequestError, KVBoost, SamplingParams, StitchConfig
from kvb_cache.core.outputs import RequestId
from kvb_cache.repair import recompute as repair_recompute

CHUNK = 16
STRATEGIES = {
    "none": {"recompute_strategy": "none"},
    "selective": {"recompute_strategy": "selective", "overlap_k": 4},
    "selective-all": {"recompute_strategy": "selective", "overlap_k": 10_000},
    # check_layer 1, not 0: layer-0 KV depends only on the token and its position, so re-positioned keys
    # deviate by float noise there and the selection would be a coin toss (sliced or not).
    "cacheblend": {
        "recompute_strategy": "cacheblend",
        "recompute_ratio": 0.25,
        "check_layer": 1,
        "overlap_k": 2,
    },
}
CONFIGS = {
    "llama": T.LlamaConfig,
    "gemma3": lambda **kw: T.Gemma3TextConfig(**kw, head_dim=16, sliding_window=24),
}


def make_model(arch: str):
    """A 4-layer random model (conftest's have 2: CacheBlend needs a check layer before the last)."""
    torch.manual_seed(0)
    config = CONFIGS[arch](**{**_COMMON, "num_hidden_layers": 4})
    config.eos_token_id, config.pad_token_id = 1, 0
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def _engine(model, tokenizer, stitch, **config):
    config = EngineConfig(chunk_size=CHUNK, stitching=StitchConfig(**stitch), **config)
    return KVBoost(model, tokenizer, config=config)


def _plan(engine, ids):
    prepared = engine._prepare(ids, max_reuse=len(ids) - 1)
    job = engine.stitcher.plan(prepared, max_reuse=len(ids) - 1)
    assert job is not None
    return prepared, job


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("budget", [1, 7, 32])
def test_sliced_repair_equals_unsliced(arch, strategy, budget, tokenizer):
    """Ascending slices of the recompute positions give the KV of one pass (every layer, fp32: 1e-5 on 2 layers,
    5e-5 on 4), and the same telemetry; each slice runs at most ``budget`` positions."""
    model = make_model(arch) if strategy == "cacheblend" else make_shallow_model(arch)
    first, second = rag_prompts(tokenizer)
    engine = _engine(model, tokenizer, STRATEGIES[strategy])
    engine.next_token_logits(first)
    whole, whole_job = _plan(engine, second)
    whole_job.run()
    sliced, job = _plan(engine, second)
    ran = []
    while not job.done:
        ran.append(job.run(budget))
        assert len(ran) < 1000
    assert all(0 <= n <= budget for n in ran) and sum(ran) > 0
    if budget < sum(ran):
        assert len(ran) > 1
    # Only the float summation order differs (a slice's matmuls have fewer rows): under 1e-5 on the
    # 2-layer models, up to ~2e-5 through the 4-layer one (keys of magnitude ~7).
    atol = 5e-5 if strategy == "cacheblend" else 1e-5
    for a, b in zip(whole.cache.layers, sliced.cache.layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys, atol=atol, rtol=0)
        torch.testing.assert_close(b.values, a.values, atol=atol, rtol=0)
    if strategy == "cacheblend":  # the check pass's deviations, concatenated over slices
        torch.testing.assert_close(
            job.work.check.deviation(), whole_job.work.check.deviation(), atol=1e-4, rtol=1e-5
        )
    assert sliced.chunks == whole.chunks
    assert sliced.recomputed_tokens == whole.recomputed_tokens
    assert (sliced.cached_tokens, sliced.exact_until) == (whole.cached_tokens, whole.exact_until)


def _collect(engine, outputs, results):
    for out in outputs:
        if out.result is not None:
            results[out.request_id] = out.result


def test_plain_request_decodes_while_a_stitched_one_prepares(llama, tokenizer):
    """With slices of 8 positions, the stitched request needs several steps to be queued; the plain request
    already decoding gets a token on every one of them."""
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, STRATEGIES["selective"])
    engine.next_token_logits(first)
    plain = engine.add_request(
        tokenizer(words(30, seed=11))["input_ids"], SamplingParams(max_new_tokens=30, ignore_eos=True)
    )
    results = {}
    while not engine.core.scheduler.find(plain).output_ids:
        _collect(engine, engine.step(), results)
    rid = engine.add_request(second, SamplingParams(max_new_tokens=4, ignore_eos=True), prefill_chunk_size=8)
    assert rid in engine.core.preparing and engine.core.scheduler.find(rid) is None
    assert engine.has_unfinished() and engine.paged_stats().running == 2
    preparing_steps = 0
    while rid in engine.core.preparing:
        before = len(engine.core.scheduler.find(plain).output_ids)
        _collect(engine, engine.step(), results)
        assert len(engine.core.scheduler.find(plain).output_ids) == before + 1
        preparing_steps += 1
    assert preparing_steps > 1  # 44 positions in slices of 8: one in add_request, five steps
    while engine.has_unfinished():
        _collect(engine, engine.step(), results)
    assert len(results[rid].output_ids) == 4 and len(results[plain].output_ids) == 30


def test_a_stitched_requests_repair_is_prefill_not_queue_time(llama, tokenizer):
    """A stitched prompt's repair is its prefill compute (preparing requests count as running), so its
    ``queued_ms`` ends when the first repair slice runs (in ``add_request``) and the repair steps after it
    fall in ``ttft_ms - queued_ms``, vLLM's PREFILL phase."""
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, STRATEGIES["selective"])
    engine.next_token_logits(first)
    before = time.perf_counter()
    rid = engine.add_request(second, SamplingParams(max_new_tokens=2, ignore_eos=True), prefill_chunk_size=8)
    added = time.perf_counter()
    assert rid in engine.core.preparing
    assert engine.core.preparing.find(rid).scheduled_at is not None  # its first slice ran in add_request
    steps = 0
    results: dict = {}
    while rid in engine.core.preparing:
        steps += 1
        _collect(engine, engine.step(), results)
    repaired = time.perf_counter()
    while engine.has_unfinished():
        _collect(engine, engine.step(), results)
    result = results[rid]
    assert steps > 1
    assert 0 < result.queued_ms <= (added - before) * 1e3
    assert result.ttft_ms - result.queued_ms >= (repaired - added) * 1e3
    assert result.queued_ms <= result.ttft_ms <= result.total_ms


@pytest.mark.parametrize("strategy", ["selective", "cacheblend"])
def test_sliced_stitched_request_equals_one_go(strategy, tokenizer, llama):
    """Greedy output, telemetry and stitching counters of a request prepared over many steps equal those
    of the same request prepared at once; TTFT still counts from add_request."""
    first, second = rag_prompts(tokenizer)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = _engine(llama, tokenizer, STRATEGIES[strategy])
    alone.next_token_logits(first)
    before = alone.cache_stats()["stitching"]
    rid = alone.add_request(second, params)
    assert rid not in alone.core.preparing  # its whole repair fits one slice: queued at once
    expected = alone._run_to_end([rid])[0]

    engine = _engine(llama, tokenizer, STRATEGIES[strategy], max_num_batched_tokens=8)
    engine.next_token_logits(first)
    assert engine.cache_stats()["stitching"] == before
    rid = engine.add_request(second, params)
    assert rid in engine.core.preparing
    steps, results = 0, {}
    while engine.has_unfinished():
        _collect(engine, engine.step(), results)
        steps += 1
    got = results[rid]
    assert got.output_ids == expected.output_ids
    assert got.chunks == expected.chunks
    assert (got.cached_tokens, got.recomputed_tokens) == (expected.cached_tokens, expected.recomputed_tokens)
    assert engine.cache_stats()["stitching"] == alone.cache_stats()["stitching"]
    stats = engine.cache_stats()["stitching"]
    assert stats["requests"] - before["requests"] == 1
    assert stats["stitched_chunks"] - before["stitched_chunks"] == 5
    assert stats["stitched_tokens"] - before["stitched_tokens"] == 80
    assert stats["recomputed_tokens"] - before["recomputed_tokens"] == got.recomputed_tokens
    assert got.ttft_ms > 0 and got.total_ms >= got.ttft_ms


@pytest.fixture
def recomputed(monkeypatch) -> list[int]:
    """Sizes of the recompute forwards run while the test holds this list (one entry per slice)."""
    sizes: list[int] = []
    original = repair_recompute.recompute_tokens

    def counting(model, layers, ids, positions, *args, **kwargs):
        sizes.append(positions.numel())
        return original(model, layers, ids, positions, *args, **kwargs)

    monkeypatch.setattr(repair_recompute, "recompute_tokens", counting)
    return sizes


def test_repair_per_step_is_bounded_by_the_token_budget(llama, tokenizer, recomputed):
    """Three stitched requests arriving together share one budget of repaired positions per step (what
    add_request ran counts against the next step), oldest first; all of them finish."""
    sizes = recomputed
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, STRATEGIES["selective"], max_num_batched_tokens=16)
    engine.next_token_logits(first)
    sizes.clear()
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    rids = [engine.add_request(second, params) for _ in range(3)]
    windows = [sum(sizes)]
    results = {}
    while engine.has_unfinished():
        sizes.clear()
        _collect(engine, engine.step(), results)
        windows.append(sum(sizes))
    assert max(windows) <= 16 and windows[0] == 16
    assert sum(windows) == 3 * 44
    assert all(len(results[r].output_ids) == 3 for r in rids)
    assert engine.cache_stats()["stitching"]["requests"] == 3  # the warm-up stitched nothing


def test_abort_while_preparing_frees_everything(llama, tokenizer):
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, STRATEGIES["selective"], max_num_batched_tokens=16)
    engine.next_token_logits(first)
    free = engine.kv.pool.num_free
    stats = engine.cache_stats()["stitching"]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    rid = engine.add_request(second, params, request_id="s")
    with pytest.raises(InvalidRequestError):
        engine.add_request(second, params, request_id="s")
    engine.step()
    assert rid in engine.core.preparing
    assert engine.abort(rid) and not engine.abort(rid)
    assert not engine.has_unfinished() and engine.paged_stats().running == 0
    assert engine.kv.pool.num_free == free and engine.paged_stats().blocks_used == 0
    assert engine.cache_stats()["stitching"] == stats  # an unfinished stitch is not counted
    # The engine goes on, and the id is free again.
    engine.add_request(second, params, request_id="s")
    out = engine._run_to_end([RequestId("s")])[0]
    assert len(out.output_ids) == 4 and out.recomputed_tokens == 8
    assert engine.paged_stats().blocks_used == 0


def test_a_prompt_with_no_stitched_piece_is_queued_as_a_plain_request(llama, tokenizer):
    engine = _engine(llama, tokenizer, STRATEGIES["selective"], max_num_batched_tokens=16)
    rid = engine.add_request(tokenizer(words(60, seed=3))["input_ids"], SamplingParams(max_new_tokens=2))
    assert rid not in engine.core.preparing
    req = engine.core.scheduler.find(rid)
    assert req is not None and req.prepared_kv is None and req.exact_until is None


def test_repair_and_prefill_share_one_step_budget(llama, tokenizer, monkeypatch, recomputed):
    """A step's repair positions come out of its prefill budget (decodes are never held back): repaired +
    prefilled tokens stay within max_num_batched_tokens while a long plain prompt prefills beside a stitched
    one that prepares."""
    budget = 16
    repaired = recomputed
    first, second = rag_prompts(tokenizer)
    engine = _engine(llama, tokenizer, STRATEGIES["selective"], max_num_batched_tokens=budget)
    engine.next_token_logits(first)
    fed = []
    forward = engine.core.runner.forward

    def recording(seqs):
        fed.append([len(s.token_ids) for s in seqs])
        return forward(seqs)

    monkeypatch.setattr(engine.core.runner, "forward", recording)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    plain = engine.add_request(tokenizer(words(60, seed=12))["input_ids"], params)
    stitched = engine.add_request(second, params)
    assert stitched in engine.core.preparing
    results, shared = {}, 0
    while engine.has_unfinished():
        repaired.clear()
        fed.clear()
        _collect(engine, engine.step(), results)
        rows = fed[0] if fed else []
        prefill = sum(n for n in rows if n > 1)
        decodes = sum(1 for n in rows if n == 1)
        assert sum(repaired) + prefill + decodes <= budget + decodes
        shared += bool(repaired) and prefill > 0
    assert shared  # some step did both: the split was exercised
    assert {len(results[r].output_ids) for r in (plain, stitched)} == {3}
