"""How an engine may be used beyond one thread and one model object: from several threads (executor pools,
web frameworks: every result equals the same call made alone; before the engine lock, four threads'
``generate`` calls interleaved their steps on one scheduler: outputs that matched no prompt, an
``AssertionError`` from the block manager, ``IndexError``), and what is refused clearly (a model moved to
another dtype or device after the engine was built, its attention switched away from the pool or the model
put in training mode, a ``torch.compile`` wrapper)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from conftest import words

from kvb_cache import EngineConfig, KVBoost


def test_generate_from_several_threads_equals_each_call_alone(llama, tokenizer):
    prompts = [words(30 + 7 * i, seed=40 + i) for i in range(8)]
    shared = words(20, seed=99)
    prompts += [shared + " " + words(5, seed=60 + i) for i in range(4)]  # prefix hits between threads
    alone = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    want = [alone.generate(p, max_new_tokens=12, ignore_eos=True).output_ids for p in prompts]

    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_num_seqs=4))

    def one(i: int) -> list[int]:
        if i % 3 == 0:  # a stream, read to its end
            events = list(engine.stream(prompts[i], max_new_tokens=12, ignore_eos=True))
            return events[-1].result.output_ids
        if i % 3 == 1:
            return engine.generate_batch([prompts[i]], max_new_tokens=12, ignore_eos=True)[0].output_ids
        return engine.generate(prompts[i], max_new_tokens=12, ignore_eos=True).output_ids

    for _ in range(3):
        with ThreadPoolExecutor(max_workers=4) as pool:
            got = list(pool.map(one, range(len(prompts))))
        assert got == want
    assert not engine.has_unfinished() and engine.paged_stats().blocks_used == 0
    assert engine.take_unfollowed_outputs() == []


def test_a_model_moved_after_the_engine_was_built_is_refused(tokenizer):
    """model.to(torch.bfloat16) after construction failed in the next forward with a bare SDPA error."""
    import pytest
    import torch
    from conftest import make_model

    from kvb_cache import ConfigError, SamplingParams

    model = make_model("llama")
    engine = KVBoost(model, tokenizer)
    engine.generate(words(10, seed=1), max_new_tokens=2)
    model.to(torch.bfloat16)
    prompt = words(10, seed=1)
    ids = tokenizer(prompt)["input_ids"]
    # Every entry point, not only generate: warm / next_token_logits / the prompt scorer failed with a bare
    # SDPA dtype error, add_warm_request queued, lookup_cache handed fp32 KV to the bf16 model.
    for call in (
        lambda: engine.generate(prompt, max_new_tokens=2),
        lambda: engine.warm(prompt),
        lambda: engine.add_warm_request(prompt),
        lambda: engine.next_token_logits(prompt),
        lambda: engine.prompt_scorer(prompt),
        lambda: engine.lookup_cache(ids),
    ):
        with pytest.raises(ConfigError, match=r"moved to torch\.bfloat16 .* build a new KVBoost"):
            call()
        assert not engine.has_unfinished()
    # A request queued before the move: the step refuses too, and the engine serves again once moved back.
    model.to(torch.float32)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    model.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="moved to"):
        engine.step()
    model.to(torch.float32)
    while engine.has_unfinished():
        engine.step()
    assert engine.abort(rid) is False
    assert engine.generate(prompt, max_new_tokens=2).cached_tokens > 0


def test_a_compiled_model_is_refused_naming_the_fix(llama, tokenizer):
    """torch.compile(model) was refused as a model "that keeps its own recurrent state (RWKV's ...)"."""
    import pytest
    import torch

    from kvb_cache import UnsupportedModelError

    with pytest.raises(
        UnsupportedModelError, match=r"passed compiled \(torch.compile\(model\)\); pass the model"
    ):
        KVBoost(torch.compile(llama), tokenizer)


def test_attention_switched_or_training_mode_after_build_is_refused(tokenizer):
    """``model.set_attn_implementation("eager")`` after the engine was built sent its forwards past the pool:
    logits off by ~5, and blocks registered with KV never written, which a later prompt hit after switching
    back (audit). ``model.train()`` (a fine-tuning loop) ran dropout in every forward and cached that KV.
    Both are refused before anything runs; switched back, the engine is exact again."""
    import pytest
    import torch
    from conftest import make_model

    from kvb_cache import ConfigError

    model = make_model("gpt2")  # dropout 0.1 in its config: train mode changes every forward
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    ids = tokenizer(words(40, seed=4))["input_ids"]
    engine.generate(ids, max_new_tokens=2)
    paged = model.config._attn_implementation
    model.set_attn_implementation("eager")
    for call in (
        lambda: engine.generate([*ids, 7], max_new_tokens=2),
        lambda: engine.next_token_logits(ids),
        lambda: engine.lookup_cache(ids),
    ):
        with pytest.raises(ConfigError, match=r"set_attn_implementation\('kvb_paged'\)"):
            call()
    model.set_attn_implementation(paged)
    model.train()
    with pytest.raises(ConfigError, match=r"training mode .* model\.eval\(\)"):
        engine.generate([*ids, 8], max_new_tokens=2)
    model.eval()
    assert not engine.has_unfinished()
    warm = engine.next_token_logits([*ids, 9])
    assert warm.cached_tokens > 0
    with torch.no_grad():
        cold = model(torch.tensor([[*ids, 9]])).logits[0, -1]
    torch.testing.assert_close(warm.logits, cold, atol=1e-5, rtol=1e-5)
