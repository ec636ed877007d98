"""Speculation inside the batched step (``kvb_cache.decoding.StepDrafter``, vLLM v1's way): a greedy request's
last token and its drafts are one slice of the packed forward, verified by argmax, beside every other
request. The drafters here are fakes (kvb-speculative's real ones are tested in kvboost's tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_model, words

from kvb_cache import EngineConfig, KVBoost, SamplingParams
from kvb_cache.decoding import StepDrafter


class _Session:
    def __init__(self, drafter: FakeDrafter, prompt: torch.Tensor) -> None:
        self.drafter, self.prompt_len = drafter, prompt.shape[0]
        self.rollbacks: list[int] = []

    def propose(self, history, max_tokens, processor):
        assert history.dtype == torch.long and max_tokens >= 1
        tokens = self.drafter.propose(history.tolist(), self.prompt_len, max_tokens)
        self.drafter.proposed.append(len(tokens))
        return SimpleNamespace(tokens=torch.tensor(tokens, dtype=torch.long), probs=None)

    def rollback(self, num_accepted):
        self.rollbacks.append(num_accepted)


class FakeDrafter:
    """Proposes ``mode``'s tokens: ``oracle`` the known greedy continuation of each prompt (all accepted),
    ``wrong`` a token that is never the continuation (all rejected), ``half`` the continuation with every
    third token wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], mode: str, gamma: int = 4) -> None:
        self.continuations, self.mode, self._gamma = continuations, mode, gamma
        self.proposed: list[int] = []
        self.rounds: list[tuple[int, int]] = []
        self.sessions: list[_Session] = []

    @property
    def gamma(self) -> int:
        return self._gamma

    def draft_session(self, prompt_ids):
        session = _Session(self, prompt_ids)
        self.sessions.append(session)
        return session

    def record_round(self, drafted, accepted):
        self.rounds.append((drafted, accepted))

    def propose(self, history: list[int], prompt_len: int, max_tokens: int) -> list[int]:
        want = self.continuations[tuple(history[:prompt_len])][len(history) - prompt_len :][:max_tokens]
        if self.mode == "oracle":
            return want
        if self.mode == "wrong":
            return [(t + 1) % 50 for t in want]
        return [t if (len(history) + i) % 3 else (t + 1) % 50 for i, t in enumerate(want)]

    # The solo path's protocol (kvb_cache.decoding.SpeculativeDecoder): never used by greedy requests here.
    def decode(self, model, cache, input_ids, next_logits, processor):
        raise AssertionError("a greedy request speculating in the step never takes the solo path")


def plain_outputs(model, tokenizer, prompts, new_tokens, **params):
    plain = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16))
    return [
        plain.generate(p, max_new_tokens=new_tokens, ignore_eos=True, **params).output_ids for p in prompts
    ]


def drain(engine: KVBoost) -> tuple[dict[str, list[int]], int]:
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            assert out.error is None, out.error
            if out.result is not None:
                done[out.request_id] = out.result.output_ids
    return done, steps


def test_the_kvb_speculative_decoder_is_a_step_drafter():
    kvb_speculative = pytest.importorskip("kvb_speculative")
    model = make_model("llama")
    assert isinstance(kvb_speculative.make_decoder(model), StepDrafter)
    assert not isinstance(FakeDrafter({}, "oracle"), type(None)) and isinstance(
        FakeDrafter({}, "oracle"), StepDrafter
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "gpt_oss"])
@pytest.mark.parametrize("mode", ["oracle", "wrong", "half"])
def test_concurrent_greedy_requests_speculate_together_and_match_plain_decoding(arch, mode, tokenizer):
    model = make_model(arch)
    prompts = [tokenizer(words(n, seed))["input_ids"] for n, seed in ((30, 1), (12, 2), (45, 3), (5, 4))]
    want = plain_outputs(model, tokenizer, prompts, 14)
    drafter = FakeDrafter({tuple(p): w for p, w in zip(prompts, want)}, mode)
    engine = KVBoost(model, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=14, ignore_eos=True)) for p in prompts]
    assert not engine.core.solo  # all four speculate in the batched step, none solo
    done, steps = drain(engine)
    assert [done[i] for i in ids] == want
    drafted = [r for r in drafter.rounds if r[0]]
    assert drafted and all(0 <= a <= d <= drafter.gamma for d, a in drafted)
    if mode == "oracle":
        assert all(a == d for d, a in drafted)
        assert steps <= 6  # 14 tokens in one prefill step and 1 + 4 per verification: far fewer than 14
    if mode == "wrong":
        assert all(a == 0 for _, a in drafted) and steps >= 14
    assert max(drafter.proposed) <= drafter.gamma
    # Every committed token was proposed with room: no request ran past max_new_tokens.
    assert all(len(done[i]) == 14 for i in ids)
    assert engine.paged_stats().blocks_used == 0


def test_rejected_drafts_never_reach_the_prefix_cache(llama, tokenizer):
    """A rejected draft's KV sits in the request's slots until overwritten: the blocks registered under a
    prefix hash must hold the committed tokens' KV only. A later prompt extending the conversation is an
    exact hit that equals no-cache."""
    prompt = tokenizer(words(29, seed=5))["input_ids"]
    want = plain_outputs(llama, tokenizer, [prompt], 40)[0]
    drafter = FakeDrafter({tuple(prompt): want}, "half", gamma=6)
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, block_size=8), drafter=drafter)
    assert engine.generate(prompt, max_new_tokens=40, ignore_eos=True).output_ids == want
    assert any(0 < a < d for d, a in drafter.rounds)  # rejections past accepted drafts happened
    follow = [*prompt, *want, 7, 8, 9]
    hit = engine.next_token_logits(follow)
    assert hit.cached_tokens >= 64
    with torch.no_grad():
        ref = llama(torch.tensor([follow])).logits[0, -1]
    torch.testing.assert_close(hit.logits, ref, atol=1e-5, rtol=0)


def test_a_stop_inside_accepted_drafts_ends_the_request_there(llama, tokenizer):
    prompt = tokenizer(words(20, seed=6))["input_ids"]
    want = plain_outputs(llama, tokenizer, [prompt], 12)[0]
    stop = want[5]
    expected = plain_outputs(llama, tokenizer, [prompt], 12, stop_token_ids=[stop])[0]
    drafter = FakeDrafter({tuple(prompt): want}, "oracle", gamma=8)
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    out = engine.generate(prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    assert out.output_ids == expected and out.finish_reason == "stop"
    text = engine.generate(
        prompt, max_new_tokens=12, ignore_eos=True, stop=[tokenizer.decode([want[3]]).strip()]
    )
    assert text.finish_reason == "stop" and len(text.output_ids) <= 4


def test_streamed_text_is_the_plain_text(llama, tokenizer):
    prompt = tokenizer(words(25, seed=8))["input_ids"]
    want = plain_outputs(llama, tokenizer, [prompt], 16)[0]
    drafter = FakeDrafter({tuple(prompt): want}, "half")
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    events = list(engine.stream(prompt, max_new_tokens=16, ignore_eos=True))
    plain = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    text = "".join(e.delta_text for e in plain.stream(prompt, max_new_tokens=16, ignore_eos=True))
    assert "".join(e.delta_text for e in events) == text
    assert [t for e in events for t in e.token_ids] == want
    assert len(events) < len(want)  # several tokens per step


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.3},
        {"logit_bias": {5: 2.0}},
        {"min_tokens": 3},
        {"logprobs": 2},
    ],
)
def test_requests_whose_distribution_depends_on_their_history_do_not_speculate_in_the_step(
    params, llama, tokenizer
):
    prompt = tokenizer(words(20, seed=9))["input_ids"]
    drafter = FakeDrafter({}, "oracle")
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    busy = engine.add_request(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert not engine.core.solo and len(drafter.sessions) == 1
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True, **params))
    assert len(drafter.sessions) == 1 and not engine.core.solo  # decodes in the batch, without drafts
    assert engine.core.scheduler.find(rid) is None or engine.core.scheduler.find(rid).spec is None
    drain(engine)
    assert busy


def test_a_failing_drafter_costs_its_request_the_drafts_only(llama, tokenizer, caplog):
    prompt = tokenizer(words(20, seed=10))["input_ids"]
    want = plain_outputs(llama, tokenizer, [prompt], 8)[0]
    drafter = FakeDrafter({}, "oracle")  # knows no prompt: propose raises KeyError
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    assert engine.generate(prompt, max_new_tokens=8, ignore_eos=True).output_ids == want
    assert "drafting failed" in caplog.text


def test_drafts_never_preempt_a_request(llama, tokenizer):
    """With the pool too small for every request's drafts, drafts are dropped, never paid for with another
    request's blocks: the same preemptions as without a drafter."""
    prompts = [tokenizer(words(30, seed))["input_ids"] for seed in range(4)]
    want = plain_outputs(llama, tokenizer, prompts, 20)
    config = EngineConfig(chunk_size=16, block_size=8, num_blocks=26)
    plain = KVBoost(llama, tokenizer, config=config)
    ids = [plain.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts]
    done, _ = drain(plain)
    assert [done[i] for i in ids] == want
    baseline = plain.paged_stats().preemptions
    drafter = FakeDrafter({tuple(p): w for p, w in zip(prompts, want)}, "oracle", gamma=8)
    engine = KVBoost(llama, tokenizer, config=config, drafter=drafter)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts]
    done, _ = drain(engine)
    assert [done[i] for i in ids] == want
    assert engine.paged_stats().preemptions <= baseline


def test_drafts_take_only_the_budget_left_once_every_request_has_its_token(llama, tokenizer):
    """A step's token budget goes first to one token per decoding request, then to drafts (oldest first):
    with drafts taken in order, the oldest requests' drafts used the budget up and the newest request got no
    token at all, step after step."""
    prompts = [tokenizer(words(2, seed))["input_ids"] for seed in range(4)]  # all four prefill in step 1
    want = plain_outputs(llama, tokenizer, prompts, 12)
    drafter = FakeDrafter({tuple(p): w for p, w in zip(prompts, want)}, "oracle", gamma=4)
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(chunk_size=16, max_num_batched_tokens=8), drafter=drafter
    )
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
    produced = dict.fromkeys(ids, 0)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        running = [i for i in ids if i not in done and produced[i]]  # decoding at the start of this step
        outputs = {o.request_id: o for o in engine.step()}
        for rid in running:
            assert rid in outputs and outputs[rid].token_ids, f"{rid} got no token this step"
        for rid, out in outputs.items():
            produced[rid] += len(out.token_ids)
            if out.result is not None:
                done[rid] = out.result.output_ids
    assert [done[i] for i in ids] == want
    assert any(d for d, _ in drafter.rounds)  # the budget left after the tokens still carried drafts


def test_a_draft_the_free_blocks_cannot_hold_is_cut_to_what_they_can(llama, tokenizer):
    """A draft longer than the free blocks allow was dropped whole; it is cut to the free room instead. A
    long request without drafts (its prompt unknown to the drafter) holds most of a small pool."""
    long_prompt, short = tokenizer(words(40, 1))["input_ids"], tokenizer(words(6, 2))["input_ids"]
    want = plain_outputs(llama, tokenizer, [short], 12)[0]
    drafter = FakeDrafter({tuple(short): want}, "oracle", gamma=8)
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(chunk_size=16, block_size=4, num_blocks=14), drafter=drafter
    )
    engine.add_request(long_prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    rid = engine.add_request(short, SamplingParams(max_new_tokens=12, ignore_eos=True))
    pairs, done = [], {}
    while engine.has_unfinished():
        proposed, rounds = len(drafter.proposed), len(drafter.rounds)
        done.update({o.request_id: o.result for o in engine.step() if o.result is not None})
        fed = [d for d, _ in drafter.rounds[rounds:] if d]
        if len(drafter.proposed) == proposed + 1 and fed:
            pairs.append((drafter.proposed[-1], fed[0]))
    assert done[rid].output_ids == want
    assert any(0 < fed < proposed for proposed, fed in pairs), pairs  # cut, not dropped


def test_rejected_drafts_give_their_blocks_back(llama, tokenizer):
    """Blocks taken for drafts that were rejected go back to the pool after the step: after every step each
    request holds the blocks of its computed tokens only (they stayed with it, and a tight pool preempted
    other requests for them). Tokens are plain greedy's."""
    short = [tokenizer(words(6, s))["input_ids"] for s in range(2)]
    prompts = [tokenizer(words(60, 9))["input_ids"], *short]
    want = plain_outputs(llama, tokenizer, prompts, 20)
    drafter = FakeDrafter({tuple(p): w for p, w in zip(prompts, want)}, "half", 8)
    engine = KVBoost(
        llama, tokenizer, config=EngineConfig(chunk_size=16, block_size=4, num_blocks=22), drafter=drafter
    )
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True), prefill_chunk_size=4)
        for p in prompts
    ]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                done[out.request_id] = out.result.output_ids
        for req in engine.core.scheduler.running:
            assert len(req.blocks) == max(-(-req.num_computed // 4), req.registered), req.request_id
    assert [done[i] for i in ids] == want
    assert engine.paged_stats().blocks_used == 0
    assert any(d > a for d, a in drafter.rounds)


def test_stats_count_the_drafts_committed(llama, tokenizer):
    """A stop part-way through accepted drafts: the round counts what was committed, not every draft."""
    prompt = tokenizer(words(20, seed=6))["input_ids"]
    want = plain_outputs(llama, tokenizer, [prompt], 12)[0]
    drafter = FakeDrafter({tuple(prompt): want}, "oracle", gamma=8)
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    out = engine.generate(prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=[want[4]])
    committed = sum(a + 1 for d, a in drafter.rounds)  # each round (or plain step): accepted drafts + one
    assert len(out.output_ids) == 5 and committed == len(out.output_ids)


def test_a_drafter_attached_after_construction_speculates_in_the_step(llama, tokenizer):
    """The kvboost meta-package sets ``engine.drafter`` once the engine is built: the step's drafter follows
    (it stayed None, so composed engines never speculated beside other requests)."""
    prompt = tokenizer(words(20, seed=6))["input_ids"]
    want = plain_outputs(llama, tokenizer, [prompt], 10)[0]
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16))
    drafter = FakeDrafter({tuple(prompt): want}, "oracle")
    engine.drafter = drafter
    assert engine.core.drafter is drafter
    assert engine.generate(prompt, max_new_tokens=10, ignore_eos=True).output_ids == want
    assert any(d for d, _ in drafter.rounds)
    engine.drafter = None
    assert engine.core.drafter is None
    with pytest.raises(TypeError, match="decode"):
        engine.drafter = object()


def test_step_limits_count_a_logits_row_per_draft(llama, tokenizer):
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16, max_num_seqs=4))
    assert engine.step_limits.sampled_rows == 4
    engine.drafter = FakeDrafter({}, "oracle", gamma=4)
    assert engine.step_limits.sampled_rows == 20


def test_speculative_sampling_commits_tokens_distributed_as_the_target():
    """sampled_verdict: the first committed token (the draft when kept, else the residual draw) follows ``p``
    exactly, whatever the draft; a rule that draws the correction from ``p`` itself (not the residual) is
    visibly off with the same number of draws, so the check has the power to see it."""
    from kvb_cache.core.speculation import sampled_verdict

    torch.manual_seed(0)
    p = torch.tensor([[0.05, 0.5, 0.2, 0.15, 0.1], [0.2] * 5])
    n = 20_000
    for draft in ([1], [4]):
        right = torch.zeros(5)
        wrong = torch.zeros(5)
        for _ in range(n):
            kept, draws = sampled_verdict(p, draft)
            right[draft[0] if kept[0] else int(draws[0])] += 1
            naive = int(torch.multinomial(p[0], 1))
            wrong[draft[0] if kept[0] else naive] += 1
        tv = 0.5 * (right / n - p[0]).abs().sum().item()
        assert tv < 0.015, (draft, right / n)
        if draft == [1]:
            assert 0.5 * (wrong / n - p[0]).abs().sum().item() > 0.1


def test_a_draft_models_distribution_is_used_in_the_verdict():
    """Drafts a draft model *sampled* from ``q`` are kept with ``min(1, p / q)`` and corrected from the
    residual ``max(p - q, 0)``: the committed token still follows ``p``, and a draft model equal to the
    target has every draft kept (read as point masses, kept with ``p(d)`` only: an audit, 2026-11-30)."""
    from kvb_cache.core.speculation import sampled_verdict

    torch.manual_seed(0)
    p = torch.tensor([[0.05, 0.5, 0.2, 0.15, 0.1], [0.2] * 5])
    q = torch.tensor([[0.3, 0.1, 0.3, 0.2, 0.1]])
    n, counts, kept_n = 20_000, torch.zeros(5), 0
    for _ in range(n):
        d = int(torch.multinomial(q[0], 1))
        kept, draws = sampled_verdict(p, [d], q)
        kept_n += int(kept[0])
        counts[d if kept[0] else int(draws[0])] += 1
    assert 0.5 * (counts / n - p[0]).abs().sum().item() < 0.015, counts / n
    assert abs(kept_n / n - torch.minimum(p[0], q[0]).sum().item()) < 0.015  # 0.55; point masses: 0.24
    for d in range(5):  # q == p: every draft kept
        assert bool(sampled_verdict(p, [d], p[:1].clone())[0][0])


@pytest.mark.parametrize("mode", ["oracle", "half"])
def test_sampled_requests_speculate_in_the_step(mode, llama, tokenizer):
    """Unseeded sampled requests (temperature, top-p) verify drafts in the step by speculative sampling; at a
    temperature so low that sampling is the argmax, the tokens are plain greedy's."""
    prompts = [tokenizer(words(n, seed))["input_ids"] for n, seed in ((30, 1), (12, 2), (45, 3))]
    want = plain_outputs(llama, tokenizer, prompts, 14)
    drafter = FakeDrafter({tuple(p): w for p, w in zip(prompts, want)}, mode)
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    cold = SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=1e-4, top_p=0.9)
    ids = [engine.add_request(p, cold) for p in prompts]
    assert not engine.core.solo and len(drafter.sessions) == 3
    done, _ = drain(engine)
    assert [done[i] for i in ids] == want
    assert any(d for d, _ in drafter.rounds)
    warm = SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.9, top_k=20)
    ids = [engine.add_request(p, warm) for p in prompts]
    done, _ = drain(engine)
    assert all(len(done[i]) == 14 for i in ids)
    assert engine.paged_stats().blocks_used == 0


def test_a_seeded_sampled_request_keeps_the_solo_path(llama, tokenizer):
    prompt = tokenizer(words(20, seed=9))["input_ids"]
    drafter = FakeDrafter({}, "oracle")
    engine = KVBoost(llama, tokenizer, config=EngineConfig(chunk_size=16), drafter=drafter)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=3, temperature=0.8, seed=1))
    assert rid in engine.core.solo and not drafter.sessions
    engine.abort(rid)
