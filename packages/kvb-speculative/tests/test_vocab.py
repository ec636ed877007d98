import pytest
from helpers import tiny_llama

from kvb_speculative import DraftModelDrafter, VocabularyMismatchError, check_vocab_parity


def test_same_vocabulary_passes(target, other_model):
    check_vocab_parity(target, other_model)
    DraftModelDrafter(target, other_model)


def test_vocab_size_mismatch_is_refused(target):
    with pytest.raises(VocabularyMismatchError) as info:
        DraftModelDrafter(target, tiny_llama(2, vocab_size=130))
    assert "config.vocab_size: target 128 != draft 130" in info.value.mismatches
    assert "input embedding rows: target 128 != draft 130" in info.value.mismatches
    assert "prompt_lookup" in str(info.value)


@pytest.mark.parametrize("field", ["eos_token_id", "bos_token_id", "pad_token_id"])
def test_any_special_token_mismatch_is_refused(target, field):
    draft = tiny_llama(3)
    setattr(draft.config, field, 7)
    setattr(draft.generation_config, field, 7)
    with pytest.raises(VocabularyMismatchError) as info:
        check_vocab_parity(target, draft)
    assert any(line.startswith(f"config.{field}:") for line in info.value.mismatches)
    assert any(line.startswith(f"generation_config.{field}:") for line in info.value.mismatches)


def test_eos_list_order_does_not_matter_but_content_does(target):
    draft = tiny_llama(3)
    target_copy = tiny_llama(0)
    target_copy.generation_config.eos_token_id = [2, 5]
    draft.generation_config.eos_token_id = [5, 2]
    check_vocab_parity(target_copy, draft)
    draft.generation_config.eos_token_id = [2]
    with pytest.raises(VocabularyMismatchError):
        check_vocab_parity(target_copy, draft)


def test_only_one_tokenizer_is_refused(target, other_model):
    with pytest.raises(VocabularyMismatchError, match="pass both"):
        check_vocab_parity(target, other_model, target_tokenizer=object())
