"""generate_batch rows equal single requests; stream deltas equal generate; cancellation is safe."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from conftest import make_model, words

from kvb_cache import (
    ContextLengthError,
    EngineConfig,
    InvalidRequestError,
    KVBoost,
    PromptTypeError,
    SamplingParams,
)


def test_batch_rows_equal_single_greedy(tokenizer):
    for arch in ("llama", "gpt2", "mistral"):
        model = make_model(arch)
        prompts = [words(50, seed=1), words(21, seed=2), words(50, seed=1) + " " + words(9, seed=3), words(3)]
        single = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
        expected = [single.generate(p, max_new_tokens=12, ignore_eos=True).output_ids for p in prompts]
        batched = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
        batched.warm(words(50, seed=1))  # rows 0 and 2 start with cached chunks, rows 1 and 3 do not
        results = batched.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        assert [r.output_ids for r in results] == expected, arch
        cached = [r.cached_tokens for r in results]
        # Paged attention masks each row by its own positions, so sliding-window rows keep their whole prefix.
        assert cached == [49, 0, 50, 0], arch


def test_batch_per_row_sampling_and_lengths(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    prompts = [words(20, seed=4), words(33, seed=5)]
    results = engine.generate_batch(
        prompts,
        sampling=[{"max_new_tokens": 3}, {"max_new_tokens": 9, "temperature": 0.8, "seed": 1}],
        ignore_eos=True,
    )
    assert [len(r.output_ids) for r in results] == [3, 9]
    alone = engine.generate(prompts[1], max_new_tokens=9, temperature=0.8, seed=1, ignore_eos=True)
    assert results[1].output_ids == alone.output_ids


def test_batch_stores_chunks_for_next_request(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    prompts = [words(40, seed=6), words(25, seed=7)]
    first = engine.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    follow = tokenizer(prompts[0])["input_ids"] + first[0].output_ids
    assert engine.generate(follow, max_new_tokens=2).cached_tokens == len(follow) - 1


def test_batch_refused_midway_queues_nothing(llama, tokenizer):
    # add_request checks what generate_batch's own pre-checks do not (the pool's size, stop_token_ids against
    # the vocabulary); a later prompt failing them left the earlier ones queued with no loop following
    # them: they ran on later steps, their outputs piling up unread.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=8))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        engine.generate_batch(["w1 w2", "w3"], sampling=[{}, {"stop_token_ids": [10**6]}], max_new_tokens=4)
    assert not engine.has_unfinished()
    with pytest.raises(ContextLengthError, match="pool"):
        engine.generate_batch(["w1 w2", words(200)], max_new_tokens=4)
    assert not engine.has_unfinished()
    engine.generate("w5 w6", max_new_tokens=3)
    assert not engine.has_unfinished() and engine.take_unfollowed_outputs() == []


def test_a_batch_error_names_the_prompt_it_is_about(llama, tokenizer):
    # The message said what was wrong, not with which of the prompts.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=8))
    with pytest.raises(InvalidRequestError, match=r"^prompts\[2\]: .*top_p") as err:
        engine.generate_batch(["w1", "w2", "w3"], sampling=[{}, {}, {"top_p": 7.0}], max_new_tokens=2)
    assert err.value.param == "top_p"  # the type and attributes are kept
    with pytest.raises(ContextLengthError, match=r"^prompts\[1\]: prompt"):
        engine.generate_batch(["w1 w2", words(200)], max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match=r"^prompts\[1\]: .*stop_token_ids"):
        engine.generate_batch(["w1 w2", "w3"], sampling=[{}, {"stop_token_ids": [10**6]}], max_new_tokens=4)
    assert not engine.has_unfinished()


def test_context_length_is_capped_by_the_pool(llama, tokenizer):
    # The server reports context_length as max_model_len and sizes default max_tokens by it: a pool smaller
    # than the model's window must be that limit, for every path (prompt scoring too).
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=8))
    assert engine.context_length == 8 * 16 < llama.config.max_position_embeddings
    assert len(engine.generate(words(40), max_new_tokens=128 - 41, ignore_eos=True).output_ids) == 128 - 41
    with pytest.raises(ContextLengthError, match="8 x 16 = 128 tokens") as err:
        engine.generate(words(40), max_new_tokens=128)
    assert err.value.context_length == 128
    with pytest.raises(ContextLengthError, match="pool"):
        engine.next_token_logits(words(140))
    big = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=4096))
    assert big.context_length == llama.config.max_position_embeddings


def test_the_pool_warning_names_what_to_raise(llama, tokenizer, caplog):
    with caplog.at_level("WARNING", logger="kvb_cache.engine"):
        KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=8))
        # Reuse off: raising max_cache_bytes would turn it back on, so only num_blocks is named.
        KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=8, max_cache_bytes=0))
    caching, off = (r.getMessage() for r in caplog.records if "to serve the full context" in r.getMessage())
    assert "--max-cache-bytes" in caching and "--num-blocks" in caching
    assert "raise num_blocks (--num-blocks; max_cache_bytes=0 keeps reuse off)" in off


def test_batch_sampling_must_be_a_list_of_dicts(llama, tokenizer):
    # One dict for the whole batch raised KeyError: 0.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    for sampling in ({"seed": 1}, [3], [{}, {}]):
        with pytest.raises(InvalidRequestError, match="one dict per prompt"):
            engine.generate_batch(["w1 w2"], sampling=sampling, max_new_tokens=2)
    assert not engine.has_unfinished()


def test_batch_unknown_sampling_option_is_named(llama, tokenizer):
    # OpenAI's max_tokens (for max_new_tokens) raised the dataclass's bare TypeError from inside the batch.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    with pytest.raises(InvalidRequestError, match=r"max_tokens.*max_new_tokens") as err:
        engine.generate_batch(["w1 w2"], sampling=[{"max_tokens": 2}])
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match=r"unknown sampling option.*tempreature"):
        engine.generate_batch(["w1 w2"], tempreature=0.5)
    # transformers' and vLLM's names are refused naming the equivalent here (never silently ignored).
    for name, value, said in (
        ("min_new_tokens", 2, "use min_tokens"),
        ("stop_strings", ["x"], "use stop"),
        ("prompt_logprobs", 1, "engine.prompt_logprobs"),
        ("streamer", object(), "engine.stream"),
        ("num_return_sequences", 2, "generate_batch"),
    ):
        with pytest.raises(InvalidRequestError, match=said) as err:
            engine.generate("w1 w2", max_new_tokens=2, **{name: value})
        assert err.value.param == name
    assert not engine.has_unfinished()


def test_stream_concatenates_to_generate(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    prompt = words(37)
    events = list(engine.stream(prompt, max_new_tokens=15, ignore_eos=True))
    final = events[-1].result
    assert final is not None and all(e.result is None for e in events[:-1])
    assert "".join(e.delta_text for e in events) == final.output_text
    assert final.output_ids == engine.generate(prompt, max_new_tokens=15, ignore_eos=True).output_ids
    assert 0 < final.ttft_ms <= final.total_ms


def test_closing_a_stream_early_keeps_the_cache_consistent(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    prompt = words(45)
    stream = engine.stream(prompt, max_new_tokens=50, ignore_eos=True)
    for _ in range(5):
        next(stream)
    stream.close()
    reference = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16)).generate(
        prompt, max_new_tokens=10, ignore_eos=True
    )
    after = engine.generate(prompt, max_new_tokens=10, ignore_eos=True)
    assert after.cached_tokens == len(tokenizer(prompt)["input_ids"]) - 1
    assert after.output_ids == reference.output_ids


@pytest.mark.parametrize("how", ["close", "with", "drop"])
def test_a_stream_closed_before_its_first_event_aborts_its_request(llama, tokenizer, how):
    # A generator's finally never runs when it has not started: the request kept its blocks, was decoded to
    # the end by the next library call, and reset_cache() refused meanwhile (CacheBusyError).
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    if how == "close":
        engine.stream(words(30), max_new_tokens=40, ignore_eos=True).close()
    elif how == "with":
        with engine.stream(words(30), max_new_tokens=40, ignore_eos=True):
            pass
    else:
        stream = engine.stream(words(30), max_new_tokens=40, ignore_eos=True)
        del stream
    assert not engine.has_unfinished()
    assert engine.paged_stats().running == 0
    engine.reset_cache()
    after = engine.generate(words(20, seed=3), max_new_tokens=3, ignore_eos=True)
    assert engine.paged_stats().steps <= 4  # nothing else was decoded beside it
    assert len(after.output_ids) == 3


def test_aborting_a_followed_request_ends_its_loop_at_once(llama, tokenizer):
    """engine.abort on a request a stream / generate call follows (another thread, a server's cancel): the
    follower found no final output only once every other request had finished, stepping them all first,
    then raised a bare RuntimeError."""
    import threading

    from kvb_cache import RequestAbortedError

    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    other = engine.add_request(words(12, seed=5), SamplingParams(max_new_tokens=200, ignore_eos=True))
    stream = engine.stream(words(30), max_new_tokens=40, ignore_eos=True)
    next(stream)
    steps = engine.paged_stats().steps
    assert engine.abort(stream.request_id)
    with pytest.raises(RequestAbortedError, match=stream.request_id):
        next(stream)
    assert engine.paged_stats().steps == steps and engine.core.knows(other)  # nothing else was stepped
    assert list(stream) == [] and not engine.abort(stream.request_id)

    seen: dict[str, BaseException] = {}
    started = threading.Event()

    mine = engine.stream(words(9, seed=2), max_new_tokens=400, ignore_eos=True)

    def follow() -> None:
        try:
            for _ in mine:
                started.set()
        except BaseException as exc:  # recorded for the assertion
            seen["error"] = exc

    thread = threading.Thread(target=follow)
    thread.start()
    assert started.wait(30)
    assert engine.abort(mine.request_id)
    thread.join(30)
    assert isinstance(seen.get("error"), RequestAbortedError) and not thread.is_alive()
    # The follower's steps ran ``other`` too; on a fast machine it may have finished (its output parked
    # for a driver's step), so abort may answer False, but either way nothing is left unfinished.
    engine.abort(other)
    assert not engine.has_unfinished()
    with pytest.raises(PromptTypeError, match="one id per call"):
        engine.abort([mine.request_id])


def test_a_closed_stream_is_exhausted_and_a_finished_one_closes_quietly(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    stream = engine.stream(words(30), max_new_tokens=6, ignore_eos=True)
    first = next(stream)
    stream.close()
    assert list(stream) == [] and not engine.has_unfinished()
    with engine.stream(words(30), max_new_tokens=6, ignore_eos=True) as whole:
        events = list(whole)
    assert events[0].token_ids == first.token_ids and events[-1].result is not None
    assert events[-1].result.cached_tokens > 0  # the aborted request's prompt stayed cached


def test_auto_request_ids_skip_one_a_caller_chose(llama, tokenizer):
    # The engine's own ids are req-0, req-1, ...: a caller's "req-1" made a later generate() fail with
    # "request_id 'req-1' is already in use", although it passed no id.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    engine.add_request(words(10), SamplingParams(max_new_tokens=30, ignore_eos=True), request_id="req-1")
    for _ in range(3):
        assert len(engine.generate(words(8, seed=2), max_new_tokens=2, ignore_eos=True).output_ids) == 2
    assert engine.has_unfinished() and engine.abort("req-1")
    with pytest.raises(PromptTypeError, match="request_id must be a str"):
        engine.add_request("hi", SamplingParams(max_new_tokens=2), request_id=5)


def test_generate_names_an_unknown_option(llama, tokenizer):
    # generate() raised Python's bare TypeError where stream() and generate_batch() name the valid options.
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    with pytest.raises(InvalidRequestError, match=r"max_tokens.*max_new_tokens") as err:
        engine.generate("w1 w2", max_tokens=5)
    assert err.value.param == "max_tokens"
    assert not engine.has_unfinished()


def test_logits_and_warm_take_a_prompt_of_exactly_the_context(llama, tokenizer):
    # They generate nothing, so the prompt alone must fit; they refused it, blaming "max_new_tokens (1)".
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=8))
    ids = tokenizer(words(200))["input_ids"][: engine.context_length]
    assert len(ids) == 128
    cold = llama(torch.tensor([ids])).logits[0, -1]
    assert (engine.next_token_logits(ids).logits - cold).abs().max() <= 1e-5
    engine.clear_cache()
    warmed = engine.warm(ids)
    assert warmed.tokens == 128 and warmed.new_chunks == 8 and warmed.cached_tokens == 128
    short = engine.warm(ids[:40])  # its two full blocks were cached by the call above
    assert short.cached_tokens == short.already_cached_tokens == 32
    hit = engine.next_token_logits(ids)
    assert hit.cached_tokens > 0 and (hit.logits - cold).abs().max() <= 1e-5
    for call in (engine.next_token_logits, engine.warm):
        with pytest.raises(ContextLengthError) as err:
            call([*ids, 5])
        assert "max_new_tokens" not in str(err.value) and "129 tokens" in str(err.value)
    # Generation still counts its new tokens: the prompt and max_new_tokens share the context.
    with pytest.raises(ContextLengthError, match=r"max_new_tokens \(1\)"):
        engine.generate(ids, max_new_tokens=1)


def test_two_interleaved_streams(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    a, b = words(30, seed=1), words(30, seed=2)
    expected = [engine.generate(p, max_new_tokens=8, ignore_eos=True).output_ids for p in (a, b)]
    engine.clear_cache()
    sa, sb = (engine.stream(p, max_new_tokens=8, ignore_eos=True) for p in (a, b))
    got: dict[str, list[int]] = {"a": [], "b": []}
    for ea, eb in zip(sa, sb):
        got["a"] += ea.token_ids
        got["b"] += eb.token_ids
    assert [got["a"], got["b"]] == expected


def test_a_library_call_between_a_drivers_steps_keeps_the_drivers_outputs(llama, tokenizer):
    """A server drives its own requests with step() and runs warm() between steps: the outputs warm's loop
    stepped past (the driver's request may even finish there) must come back through take_unfollowed_outputs."""
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    prompt = words(24)
    alone = engine.generate(prompt, max_new_tokens=8, ignore_eos=True).output_ids
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # the driver's first step
    engine.warm(words(200, seed=5))  # runs the loop until its own request is done: ours finishes in there
    outputs = engine.take_unfollowed_outputs()
    assert outputs and all(o.request_id == rid for o in outputs)
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    finals = [o for o in outputs if o.finished]
    assert len(finals) == 1
    assert finals[0].result.output_ids == alone
    assert engine.take_unfollowed_outputs() == []


def test_a_drivers_step_leaves_a_library_loops_outputs_to_it(llama, tokenizer):
    """The other direction (an audit, 2026-12-01): a driver's own step() beside an open stream took the stream's
    next token (the stream ended a token short, silently), beside another thread's generate() made it raise a
    bare RuntimeError; and a driver whose request a generate() finished never got its result from the
    README's ``while has_unfinished(): step()`` loop."""
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    p, q = words(20, seed=1), words(20, seed=2)
    want = engine.generate(p, max_new_tokens=10, ignore_eos=True).output_ids
    want_q = engine.generate(q, max_new_tokens=6, ignore_eos=True).output_ids

    stream = engine.stream(p, max_new_tokens=10, ignore_eos=True)
    events = [next(stream)]
    assert engine.step() == []  # the stream's token is filed for the stream, not returned here
    events += list(stream)
    assert [t for e in events for t in e.token_ids] == want == events[-1].result.output_ids

    rid = engine.add_request(q, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert engine.generate(p, max_new_tokens=10, ignore_eos=True).output_ids == want  # finishes ours too
    driven = []
    while engine.has_unfinished():
        driven += engine.step()
    assert {o.request_id for o in driven} == {rid}
    assert next(o for o in driven if o.finished).result.output_ids == want_q

    results: dict[str, object] = {}

    def library() -> None:
        results["generate"] = engine.generate(p, max_new_tokens=10, ignore_eos=True).output_ids

    def driver() -> None:
        mine = engine.add_request(q, SamplingParams(max_new_tokens=30, ignore_eos=True))
        seen = []
        while engine.has_unfinished():
            seen += engine.step()
        results["driver"] = {o.request_id for o in seen} == {mine}

    threads = [threading.Thread(target=driver), threading.Thread(target=library)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == {"generate": want, "driver": True}
    assert engine.take_unfollowed_outputs() == [] and engine.paged_stats().blocks_used == 0


def test_engine_wide_prefill_chunk_size_slices_every_prompt(llama, tokenizer):
    prompt = words(120)
    plain = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    sliced = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, prefill_chunk_size=16))
    a = plain.generate(prompt, max_new_tokens=4, ignore_eos=True)
    b = sliced.generate(prompt, max_new_tokens=4, ignore_eos=True)
    assert a.output_ids == b.output_ids
    # One step prefills the whole prompt without the option; 16-token slices need one step per slice.
    assert sliced.paged_stats().steps >= plain.paged_stats().steps + a.prompt_tokens // 16 - 1


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_stream_collected_during_a_step_is_aborted_after_it(llama, tokenizer, block_size):
    """A stream reachable only through a reference cycle is closed by the garbage collector whenever it
    runs: inside another caller's step (the engine lock is re-entrant), its abort freed a scheduled
    request's blocks part-way, and the step failed (IndexError committing its KV) for every request, or
    sampled the aborted request after its abort returned."""
    engine = KVBoost(llama, tokenizer, config=EngineConfig(block_size=block_size, num_blocks=256))
    kept = engine.stream(words(40, seed=1), max_new_tokens=12, ignore_eos=True)
    dropped = engine.stream(words(40, seed=2), max_new_tokens=12, ignore_eos=True)
    holder = {"stream": dropped}
    holder["self"] = holder  # only a reference cycle keeps the stream alive
    dropped_id = dropped.request_id
    del dropped, holder
    forward = engine.core.runner.forward
    seen: list[bool] = []

    def collecting_forward(seqs):
        logits = forward(seqs)
        if not seen:  # what an allocation-triggered collection does at this point of a step
            seen.append(engine.core.scheduler.find(dropped_id) is not None)
            gc.collect()
        return logits

    engine.core.runner.forward = collecting_forward
    gc.disable()
    try:
        events = list(kept)
    finally:
        gc.enable()
        engine.core.runner.forward = forward
    assert seen == [True]  # the dropped request was scheduled in the step the collector ran in
    assert (
        events[-1].result.output_ids
        == engine.generate(words(40, seed=1), max_new_tokens=12, ignore_eos=True).output_ids
    )
    assert not engine.has_unfinished() and engine.core.scheduler.find(dropped_id) is None
    assert engine.take_unfollowed_outputs() == []  # nothing emitted for it after its abort
    assert engine.paged_stats().blocks_used == 0


def test_sampling_params_built_directly_name_foreign_options_too(llama, tokenizer):
    """``SamplingParams(do_sample=True)`` (add_request's path) raised the dataclass's bare TypeError with no
    hint, and transformers' usual names (generation_config, num_beams, ...) got the generic message; the
    canonical ``engine.generate(**tokenizer(text, return_tensors="pt"))`` ended in Python's own TypeError."""
    from kvb_cache import SamplingParams, UnknownOptionError

    with pytest.raises(UnknownOptionError, match="do_sample: sampling is on when temperature > 0") as err:
        SamplingParams(do_sample=True, temperature=0.7)
    assert isinstance(err.value, TypeError) and isinstance(err.value, InvalidRequestError)
    assert err.value.param == "do_sample"
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    for name, value, said in (
        ("num_beams", 2, "beam search is not supported"),
        ("generation_config", object(), "pass its fields as options"),
        ("output_scores", True, "logprobs=k"),
        ("no_repeat_ngram_size", 2, "repetition_penalty"),
    ):
        with pytest.raises(UnknownOptionError, match=said):
            engine.generate("w1 w2", max_new_tokens=2, **{name: value})
    with pytest.raises(TypeError):  # no prompt given: Python's own error (the signature's)
        engine.generate(**tokenizer("w1 w2", return_tensors="pt"), max_new_tokens=2)
    with pytest.raises(UnknownOptionError, match="first argument"):
        engine.generate("w1", input_ids=[1], max_new_tokens=2)
    assert not engine.has_unfinished()


def test_numpy_scalars_are_sampling_numbers(llama, tokenizer):
    """numpy scalars (np.float32 temperatures, np.int64 lengths and seeds) were refused ("must be a finite
    number", "must be an int") while the prompt took numpy ints; they now equal the Python numbers."""
    np = pytest.importorskip("numpy")
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    plain = engine.generate(
        "w1 w2 w3",
        max_new_tokens=4,
        temperature=0.75,
        top_p=0.5,
        seed=7,
        stop_token_ids=[5],
        logit_bias={3: 2.0},
    )
    numpy = engine.generate(
        "w1 w2 w3",
        max_new_tokens=np.int64(4),
        temperature=np.float32(0.75),
        top_p=np.float64(0.5),
        seed=np.int32(7),
        stop_token_ids=[np.int64(5)],
        logit_bias={np.int64(3): np.float32(2.0)},
    )
    assert numpy.output_ids == plain.output_ids
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.generate("w1", max_new_tokens=2, temperature=np.float32("nan"))


def test_generate_called_as_transformers_model_generate_names_the_fix(llama, tokenizer):
    """``engine.generate(**tokenizer(text, return_tensors="pt"))``, transformers' habit, was Python's
    "missing 1 required positional argument: 'prompt'"."""
    engine = KVBoost(llama, tokenizer)
    inputs = tokenizer("hello there", return_tensors="pt")
    with pytest.raises(PromptTypeError, match=r"inputs\['input_ids'\]\[0\]\.tolist\(\)"):
        engine.generate(**inputs, max_new_tokens=2)
    with pytest.raises(PromptTypeError, match="prompt must be"):
        engine.generate(max_new_tokens=2)
    ids = inputs["input_ids"][0].tolist()
    assert engine.generate(ids, max_new_tokens=2).output_ids
    # The other entry points alike (each was Python's TypeError naming the missing argument).
    with pytest.raises(PromptTypeError, match=r"KVBoost\.stream takes the prompt"):
        engine.stream(**inputs, max_new_tokens=2)
    with pytest.raises(PromptTypeError, match=r"KVBoost\.warm takes the prompt"):
        engine.warm(**inputs)
    with pytest.raises(PromptTypeError, match=r"generate_batch\(\[row for row in"):
        engine.generate_batch(**inputs, max_new_tokens=2)
    with pytest.raises(PromptTypeError, match="prompt must be"):
        engine.stream(max_new_tokens=2)
    with pytest.raises(TypeError, match="unexpected keyword arguments: bogus"):
        engine.warm("hello", bogus=1)
    assert not engine.has_unfinished()
