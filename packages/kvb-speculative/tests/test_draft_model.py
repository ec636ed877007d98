import pytest
import torch
from helpers import greedy, plain_decode, tiny_llama

from kvb_speculative import DraftModelDrafter, LogitsTokenProcessor, SamplingParams


def test_proposals_are_the_draft_models_greedy_tokens(target, other_model, prompt):
    session = DraftModelDrafter(target, other_model).start(prompt[0])
    draft = session.propose(prompt[0], 4, greedy())
    expected = other_model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert draft.tokens.tolist() == expected[0, prompt.shape[1] :].tolist()
    assert draft.probs is None


def test_sampling_proposals_carry_their_distributions(target, other_model, prompt):
    processor = LogitsTokenProcessor(
        SamplingParams(temperature=1.0, top_k=5), torch.Generator().manual_seed(0)
    )
    draft = DraftModelDrafter(target, other_model).start(prompt[0]).propose(prompt[0], 3, processor)
    assert draft.probs.shape == (3, 128)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3))
    assert ((draft.probs > 0).sum(-1) == 5).all()  # top-k applied to q as well
    assert all(draft.probs[j, t] > 0 for j, t in enumerate(draft.tokens.tolist()))


def test_rollback_keeps_the_accepted_prefix_and_resyncs(target, other_model, prompt):
    session = DraftModelDrafter(target, other_model).start(prompt[0])
    history = prompt[0]
    draft = session.propose(history, 5, greedy())
    assert session.cache.get_seq_length() == history.shape[0] + 4
    session.rollback(2)
    assert session.cache.get_seq_length() == history.shape[0] + 2
    # The target committed two drafts and a correction (token 7); the next proposal starts from there
    # and equals a fresh draft model's greedy continuation of that history.
    history = torch.cat([history, draft.tokens[:2], torch.tensor([7])])
    again = session.propose(history, 3, greedy())
    fresh = DraftModelDrafter(target, other_model).start(history).propose(history, 3, greedy())
    assert again.tokens.tolist() == fresh.tokens.tolist()
    assert session.cache.get_seq_length() == history.shape[0] + 2


def test_a_proposal_never_verified_can_be_made_again_from_the_same_history(target, other_model, prompt):
    # An engine step that failed (or was interrupted) after drafting and before verifying proposes again
    # from the same committed history: the session asserted "the committed history never shrinks" and the
    # request decoded without drafts from then on.
    session = DraftModelDrafter(target, other_model).start(prompt[0])
    first = session.propose(prompt[0], 4, greedy())
    again = session.propose(prompt[0], 4, greedy())
    assert again.tokens.tolist() == first.tokens.tolist()
    assert session.cache.get_seq_length() == prompt.shape[1] + 3


def test_full_acceptance_keeps_every_computed_position(target, other_model, prompt):
    session = DraftModelDrafter(target, other_model).start(prompt[0])
    session.propose(prompt[0], 3, greedy())
    session.rollback(3)
    # The last proposal never had KV computed, so at most gamma - 1 draft positions remain.
    assert session.cache.get_seq_length() == prompt.shape[1] + 2


def test_a_draft_model_with_a_shorter_context_stops_proposing_at_its_end(target, prompt):
    """A GPT-2 draft (learned positions, 28 of them) behind a longer-context target: proposals are cut where
    its positions end and stop past them (it raised IndexError there), and the output is still the
    target's own greedy continuation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from kvb_speculative import speculative_generate

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=128,
        n_positions=28,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    draft_model = GPT2LMHeadModel(config).eval()
    drafter = DraftModelDrafter(target, draft_model)
    session = drafter.start(prompt[0])
    assert session.propose(prompt[0], 8, greedy()).tokens.shape[0] == 5  # positions 24..27 hold 4 + 1
    longer = torch.cat([prompt[0], torch.arange(3, 8)])  # 29 tokens: past the draft's context
    assert drafter.start(longer).propose(longer, 4, greedy()).tokens.shape[0] == 0
    out = speculative_generate(target, prompt, drafter, gamma=4, max_new_tokens=12)
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out.tokens.tolist() == expected[0, prompt.shape[1] :].tolist()
    assert out.stats.plain_steps > 0  # past position 28 the target decoded alone


def test_a_yarn_draft_drafts_past_its_declared_window(target, prompt):
    """A draft with a YaRN block (factor 4 over 16 positions) serves 64 positions, as the engine serves its
    target; it stopped proposing at 16."""
    from kvb_speculative.draft_model import _context_length

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    draft = tiny_llama(5, max_position_embeddings=16, rope_scaling=yarn)
    assert _context_length(draft) == 64
    assert _context_length(tiny_llama(5, max_position_embeddings=16)) == 16
    drafter = DraftModelDrafter(target, draft)
    assert prompt.shape[1] > 16
    assert drafter.start(prompt[0]).propose(prompt[0], 4, greedy()).tokens.shape[0] == 4


def _nan_head(seed: int):
    """A tiny Llama whose logits are all NaN (what an overflowing float16 model produces)."""
    model = tiny_llama(seed)
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    return model


@pytest.mark.parametrize("sampling", [False, True])
def test_a_draft_model_with_nan_logits_proposes_nothing_and_the_output_is_the_targets(
    target, prompt, sampling
):
    """A NaN proposal distribution would poison the verifier's p / q; the target decides alone instead."""
    import itertools

    from kvb_speculative import SpeculativeConfig, SpeculativeDecoder, prefill

    drafter = DraftModelDrafter(target, _nan_head(1))
    assert drafter.start(prompt[0]).propose(prompt[0], 4, greedy()).tokens.shape[0] == 0

    def processor():
        if not sampling:
            return greedy()
        return LogitsTokenProcessor(SamplingParams(temperature=1.0), torch.Generator().manual_seed(5))

    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=4))
    cache, logits = prefill(target, prompt)
    stream = decoder.decode(target, cache, prompt, logits, processor())
    out = list(itertools.islice(stream, 10))
    stream.close()
    assert out == plain_decode(target, prompt, processor(), 10)
    assert decoder.speculative_stats().plain_steps == 10
