import pytest
from helpers import tiny_llama

from kvb_speculative import (
    DraftModelDrafter,
    PromptLookupDrafter,
    SpeculativeConfigError,
    SpeculativeDecoder,
    VocabularyMismatchError,
    make_decoder,
)


def test_prompt_lookup_is_the_default_without_a_draft_model(target):
    decoder = make_decoder(target, gamma=4, max_ngram=4, min_ngram=1)
    assert isinstance(decoder, SpeculativeDecoder)
    assert isinstance(decoder.drafter, PromptLookupDrafter)
    assert decoder.config.gamma == 4
    assert (decoder.drafter.config.max_ngram, decoder.drafter.config.min_ngram) == (4, 1)
    assert decoder.speculative_stats().accepted_histogram == (0,) * 5


def test_draft_model_mode(target, other_model):
    assert isinstance(make_decoder(target, draft_model=other_model).drafter, DraftModelDrafter)
    decoder = make_decoder(target, speculative="draft_model", draft_model=other_model, gamma=3)
    assert decoder.drafter.draft_model is other_model


def test_inconsistent_arguments_are_refused(target, other_model):
    with pytest.raises(SpeculativeConfigError, match="needs draft_model"):
        make_decoder(target, speculative="draft_model")
    with pytest.raises(SpeculativeConfigError, match="uses no draft model"):
        make_decoder(target, speculative="prompt_lookup", draft_model=other_model)
    with pytest.raises(SpeculativeConfigError, match="unknown"):
        make_decoder(target, speculative="medusa")
    with pytest.raises(SpeculativeConfigError, match="gamma"):
        make_decoder(target, gamma=0)


def test_vocabulary_mismatch_is_refused_at_construction(target):
    with pytest.raises(VocabularyMismatchError):
        make_decoder(target, draft_model=tiny_llama(4, vocab_size=64))


def test_a_draft_model_that_is_not_a_model_is_a_config_error(target):
    """A path string failed with AttributeError: 'str' object has no attribute 'get_output_embeddings'."""
    with pytest.raises(SpeculativeConfigError, match="must be a loaded model"):
        make_decoder(target, speculative="draft_model", draft_model="/some/path")
