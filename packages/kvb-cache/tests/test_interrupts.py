"""An exception that escapes an engine step part-way (Ctrl-C, a signal handler's exception) while other
requests share the step: the interrupted call raises, and every other request goes on exactly.

Before: a request whose token was being emitted when the interrupt landed had its KV computed but no token
(``remaining == 0``), so no later step scheduled it and its stream waited forever while the engine spun; a
request whose token had been emitted earlier in that step lost it (the step's outputs were a local list);
outputs of a step taken but not yet filed into their streams' mailboxes were lost too.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import words

from kvb_cache import EngineConfig, KVBoost, RequestInterruptedError
from kvb_cache.cache_kwarg import cache_kwargs
from kvb_cache.core.emission import TokenEmission
from kvb_cache.core.outputs import RequestId

PROMPT_A, PROMPT_B = words(40, seed=3), words(40, seed=4)


def _engine(llama, tokenizer) -> KVBoost:
    return KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, num_blocks=64))


def _interrupt_emit(monkeypatch, *, victim, nth: int) -> None:
    """Raise KeyboardInterrupt once, at the ``nth`` emission for which ``victim(request)`` holds."""
    original = TokenEmission.emit
    seen = {"n": 0}

    def emit(self, req, token, logits, logprob=None):
        if victim(req):
            seen["n"] += 1
            if seen["n"] == nth:
                raise KeyboardInterrupt("Ctrl-C inside a step")
        return original(self, req, token, logits, logprob)

    monkeypatch.setattr(TokenEmission, "emit", emit)


def _read_rest(engine, stream, got: list[int], text: list[str]):
    # Without the fix the request left behind had remaining == 0 and reading it never returned.
    assert all(r.remaining >= 1 for r in engine.core.scheduler.running), "a request no step will schedule"
    final = None
    for event in stream:
        got.extend(event.token_ids)
        text.append(event.delta_text)
        final = event.result or final
    return final


@pytest.mark.parametrize(
    "where", ["emitting the open stream's token", "emitting the interrupted call's token"]
)
def test_an_interrupt_inside_a_step_leaves_another_open_stream_exact(llama, tokenizer, monkeypatch, where):
    want = _engine(llama, tokenizer).generate(PROMPT_A, max_new_tokens=20, ignore_eos=True)
    engine = _engine(llama, tokenizer)
    stream = engine.stream(PROMPT_A, max_new_tokens=20, ignore_eos=True)
    got, text = [], []
    for _ in range(3):
        event = next(stream)
        got.extend(event.token_ids)
        text.append(event.delta_text)
    if where.startswith("emitting the open"):
        _interrupt_emit(monkeypatch, victim=lambda r: r.request_id == stream.request_id, nth=1)
    else:  # the third token of B: in that step the open stream's token was emitted before B's
        _interrupt_emit(monkeypatch, victim=lambda r: r.request_id != stream.request_id, nth=3)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPT_B, max_new_tokens=12, ignore_eos=True)
    monkeypatch.undo()
    final = _read_rest(engine, stream, got, text)
    assert got == want.output_ids and final.output_ids == want.output_ids
    assert "".join(text) == want.output_text
    again = engine.generate(PROMPT_B, max_new_tokens=12, ignore_eos=True)
    assert (
        again.output_ids
        == _engine(llama, tokenizer).generate(PROMPT_B, max_new_tokens=12, ignore_eos=True).output_ids
    )
    assert not engine.has_unfinished() and engine.paged_stats().blocks_used == 0


def test_an_interrupt_while_a_steps_outputs_are_filed_delivers_them_later(llama, tokenizer):
    want = _engine(llama, tokenizer).generate(PROMPT_A, max_new_tokens=12, ignore_eos=True)
    engine = _engine(llama, tokenizer)
    stream = engine.stream(PROMPT_A, max_new_tokens=12, ignore_eos=True)
    got = list(next(stream).token_ids)

    class Followed(set):
        """The loop's set of followed requests, whose lookup while a step's outputs are filed raises once."""

        armed = True

        def __contains__(self, request_id):
            if self.armed and request_id == stream.request_id:
                Followed.armed = False
                raise KeyboardInterrupt("Ctrl-C while a step's outputs are filed")
            return super().__contains__(request_id)

    engine._followed = Followed(engine._followed)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPT_B, max_new_tokens=8, ignore_eos=True)
    assert not Followed.armed
    final = _read_rest(engine, stream, got, [])
    assert got == want.output_ids and final.output_ids == want.output_ids


class _InterruptingDecoder:
    """A plain SpeculativeDecoder (so its requests run solo): greedy, raising KeyboardInterrupt at its
    ``at``-th token."""

    def __init__(self, at: int) -> None:
        self.at, self.n = at, 0

    def decode(self, model, cache, input_ids, next_logits, processor):
        logits, position = next_logits, input_ids.shape[1]
        while True:
            self.n += 1
            if self.n == self.at:
                raise KeyboardInterrupt("Ctrl-C inside a solo decode")
            token = int(logits.argmax())
            yield token
            with torch.inference_mode():
                out = model(
                    input_ids=torch.tensor([[token]]),
                    position_ids=torch.tensor([[position]]),
                    use_cache=True,
                    **cache_kwargs(model, cache),
                )
            logits, position = out.logits[0, -1], position + 1


def test_an_interrupt_inside_a_solo_request_leaves_the_batched_stream_exact(llama, tokenizer):
    want = _engine(llama, tokenizer).generate(PROMPT_A, max_new_tokens=20, ignore_eos=True)
    engine = _engine(llama, tokenizer)
    stream = engine.stream(PROMPT_A, max_new_tokens=20, ignore_eos=True)
    got = [t for _ in range(3) for t in next(stream).token_ids]
    engine.drafter = _InterruptingDecoder(at=3)
    with pytest.raises(KeyboardInterrupt):  # seeded sampling keeps the solo path beside another request
        engine.generate(PROMPT_B, max_new_tokens=12, temperature=0.7, seed=1)
    engine.drafter = None
    final = _read_rest(engine, stream, got, [])
    assert got == want.output_ids and final.output_ids == want.output_ids
    assert not engine.has_unfinished() and engine.paged_stats().blocks_used == 0


def test_a_solo_request_whose_generator_died_ends_with_a_typed_error(llama, tokenizer):
    # Its generator cannot resume after an exception went through it; before, the request vanished with no
    # output at all (its loop then raised "ended without a final output").
    engine = _engine(llama, tokenizer)
    engine.core.solo[RequestId("dead")] = iter(())
    (output,) = engine.step()
    assert output.request_id == "dead" and isinstance(output.error, RequestInterruptedError)
    assert "send it again" in str(output.error)


def test_the_hf_bridge_waits_for_the_engine_lock(llama, tokenizer):
    # lookup_cache / store_cache mutate the block pool; without the lock, a generate in another thread
    # drove the pool's counters out of step (33 cached blocks of 28, -5 free).
    engine = _engine(llama, tokenizer)
    ids = tokenizer(words(40, seed=5))["input_ids"]
    held, done = threading.Event(), threading.Event()
    release = threading.Event()

    def hold():
        with engine._engine_lock:
            held.set()
            release.wait(10)

    def call():
        engine.lookup_cache(ids)
        done.set()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    caller = threading.Thread(target=call)
    caller.start()
    assert not done.wait(0.3), "lookup_cache ran while another thread held the engine lock"
    release.set()
    holder.join(10)
    assert done.wait(10)
    caller.join(10)


@pytest.mark.parametrize("where", ["detokenizing its token", "freeing it after its last token"])
def test_a_request_whose_token_was_part_way_through_emission_ends_with_a_typed_error(
    llama, tokenizer, monkeypatch, where
):
    # Appended but not detokenized, the stream went on without that word; finished but not freed, a later
    # step decoded past max_new_tokens (9 tokens of 8). Neither stream can go on whole: it ends, saying so.
    engine = _engine(llama, tokenizer)
    stream = engine.stream(PROMPT_A, max_new_tokens=8, ignore_eos=True)
    next(stream)
    victim = engine.core.scheduler.find(RequestId(stream.request_id))
    original = TokenEmission.emit
    armed = {"on": True}

    def interrupt(*args, **kwargs):
        armed["on"] = False
        raise KeyboardInterrupt("Ctrl-C inside an emission")

    def emit(self, req, token, logits, logprob=None):
        last = len(req.tokens) - req.prompt_len == 7
        if armed["on"] and req is victim and (where.startswith("detok") or last):
            if where.startswith("detok"):
                emitter_class = type(req.emitter)
                push = emitter_class.push

                def push_once(*args, **kwargs):  # the victim's push raises; every later one is the real one
                    monkeypatch.setattr(emitter_class, "push", push)
                    interrupt()

                monkeypatch.setattr(emitter_class, "push", push_once)
            else:
                monkeypatch.setattr(self, "before_free", interrupt)
        return original(self, req, token, logits, logprob)

    monkeypatch.setattr(TokenEmission, "emit", emit)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPT_B, max_new_tokens=12, ignore_eos=True)
    monkeypatch.undo()
    with pytest.raises(RequestInterruptedError):
        for _ in stream:
            pass
    assert len(victim.tokens) - victim.prompt_len <= 8
    assert not engine.has_unfinished() and engine.paged_stats().blocks_used == 0
    want = _engine(llama, tokenizer).generate(PROMPT_B, max_new_tokens=12, ignore_eos=True).output_ids
    assert engine.generate(PROMPT_B, max_new_tokens=12, ignore_eos=True).output_ids == want


def test_iterating_a_stream_again_after_an_interrupt_escaped_it_raises(llama, tokenizer, monkeypatch):
    """The interrupt aborts the stream's own request; reading the stream again (a notebook cell run twice)
    ended at once, as if the reply were whole (an audit, 2026-12-01). Now it says the reply is cut short."""
    engine = _engine(llama, tokenizer)
    want = engine.generate(PROMPT_A, max_new_tokens=10, ignore_eos=True).output_ids
    stream = engine.stream(PROMPT_A, max_new_tokens=10, ignore_eos=True)
    _interrupt_emit(monkeypatch, victim=lambda req: req.request_id == stream.request_id, nth=3)
    got: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for event in stream:
            got.extend(event.token_ids)
    assert 0 < len(got) < len(want)
    with pytest.raises(RequestInterruptedError, match="incomplete"):
        next(stream)
    with pytest.raises(RequestInterruptedError):
        list(stream)
    monkeypatch.undo()
    assert not engine.has_unfinished() and engine.paged_stats().blocks_used == 0
    assert engine.generate(PROMPT_A, max_new_tokens=10, ignore_eos=True).output_ids == want
    finished = engine.stream(PROMPT_B, max_new_tokens=4, ignore_eos=True)
    assert list(finished)[-1].result is not None and list(finished) == []  # a whole stream just ends
