import torch
from helpers import greedy

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


def test_full_acceptance_keeps_every_computed_position(target, other_model, prompt):
    session = DraftModelDrafter(target, other_model).start(prompt[0])
    session.propose(prompt[0], 3, greedy())
    session.rollback(3)
    # The last proposal never had KV computed, so at most gamma - 1 draft positions remain.
    assert session.cache.get_seq_length() == prompt.shape[1] + 2
