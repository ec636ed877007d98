import pytest
import torch

from kvb_speculative import PromptLookupConfig, PromptLookupDrafter, SpeculativeConfigError


def _propose(history: list[int], max_tokens: int, **config) -> list[int]:
    session = PromptLookupDrafter(PromptLookupConfig(**config)).start(torch.tensor(history))
    return session.propose(torch.tensor(history), max_tokens, None).tokens.tolist()


def test_continuation_of_the_latest_match_is_proposed():
    # suffix (7, 8) occurs at 0 (followed by 1 2) and at 4 (followed by 3 4): the latest wins.
    assert _propose([7, 8, 1, 2, 7, 8, 3, 4, 9, 7, 8], 2) == [3, 4]


def test_longer_ngram_beats_more_recent_shorter_one():
    # (6, 7, 8) -> 1 2 at 0; the 2-gram (7, 8) also occurs later, followed by 5.
    history = [6, 7, 8, 1, 2, 0, 7, 8, 5, 0, 6, 7, 8]
    assert _propose(history, 2, max_ngram=3) == [1, 2]
    assert _propose(history, 2, max_ngram=2) == [5, 0]


def test_draft_is_cut_at_max_tokens_and_at_the_end_of_history():
    history = [1, 2, 3, 4, 5, 1, 2]
    assert _propose(history, 2) == [3, 4]
    assert _propose(history, 10) == [3, 4, 5, 1, 2]


def test_no_match_gives_an_empty_draft():
    assert _propose([1, 2, 3, 4, 5, 6], 4) == []
    # A single repeated token matches only with min_ngram=1.
    assert _propose([1, 9, 2, 3, 9], 2) == []
    assert _propose([1, 9, 2, 3, 9], 2, min_ngram=1) == [2, 3]


def test_index_grows_with_committed_tokens():
    session = PromptLookupDrafter().start(torch.tensor([1, 2, 3]))
    assert session.propose(torch.tensor([1, 2, 3]), 3, None).tokens.tolist() == []
    # Generated text repeating itself is found too, not only the prompt.
    history = torch.tensor([1, 2, 3, 4, 5, 6, 4, 5])
    assert session.propose(history, 3, None).tokens.tolist() == [6, 4, 5]
    assert session.propose(history, 3, None).probs is None


@pytest.mark.parametrize(
    ("max_ngram", "min_ngram"),
    # "3" was a bare TypeError; 1.5 was accepted and failed every request later, inside the engine
    [(0, 0), (1, 2), ("3", 2), (3, 1.5), (True, 1)],
)
def test_bad_config_is_refused(max_ngram, min_ngram):
    with pytest.raises(SpeculativeConfigError):
        PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram)
