import pytest
import torch
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


def _word_tokenizer(size: int):
    """A word-level fast tokenizer of ``size`` ids (the tests' models read ids only)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))


def _padded(model, rows: int, pad_logit: float):
    """``model`` with its embedding tables padded to ``rows``, the padding rows of the head all
    ``pad_logit / hidden`` (a large value: the padded model prefers padding ids)."""
    import copy

    out = copy.deepcopy(model)
    out.resize_token_embeddings(rows)
    with torch.no_grad():
        head = out.get_output_embeddings().weight
        head[model.config.vocab_size :] = pad_logit / head.shape[1]
    return out


def test_tables_padded_past_one_tokenizer_are_allowed_with_both_tokenizers(target):
    """Qwen2.5-0.5B (151,936 rows) drafting for 7B (152,064), one 151,665-token tokenizer: refused before."""
    tok = _word_tokenizer(120)
    draft = _padded(tiny_llama(3), 136, 0.0)
    with pytest.raises(VocabularyMismatchError, match="136"):
        DraftModelDrafter(target, draft)  # without tokenizers nothing says the ids mean the same
    DraftModelDrafter(target, draft, target_tokenizer=tok, draft_tokenizer=_word_tokenizer(120))
    with pytest.raises(VocabularyMismatchError):  # a tokenizer id past the target's 128 rows
        DraftModelDrafter(
            target, draft, target_tokenizer=_word_tokenizer(130), draft_tokenizer=_word_tokenizer(130)
        )


@pytest.mark.parametrize("padded", ["draft", "target"])
def test_a_padded_copy_of_the_target_drafts_exactly(target, prompt, padded):
    """The draft's logits are fitted to the target's width: padding ids past it are never proposed (the
    padded draft prefers them), ids the draft lacks get -inf. A padded copy of the target accepts all."""
    from helpers import greedy, plain_decode

    from kvb_speculative import SpeculativeConfig, SpeculativeDecoder, prefill

    tok = _word_tokenizer(120)
    if padded == "draft":
        model, draft = target, _padded(target, 136, 50.0)
    else:
        # Zero padding rows: logit 0, below the best of 128 real (zero-mean) logits, so never chosen.
        model, draft = _padded(target, 136, 0.0), target
    drafter = DraftModelDrafter(model, draft, target_tokenizer=tok, draft_tokenizer=tok)
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(gamma=4))
    cache, logits = prefill(model, prompt)
    stream = decoder.decode(model, cache, prompt, logits, greedy())
    out = [next(stream) for _ in range(16)]
    stream.close()
    assert out == plain_decode(model, prompt, greedy(), 16)
    assert decoder.speculative_stats().acceptance_rate == 1.0


def test_a_committed_id_past_the_draft_table_ends_its_proposals(target):
    """The target may commit one of its padding ids (plain decoding could too): the draft model has no
    embedding for it, so it proposes nothing from then on instead of raising IndexError."""
    tok = _word_tokenizer(120)
    drafter = DraftModelDrafter(_padded(target, 136, 0.0), target, target_tokenizer=tok, draft_tokenizer=tok)
    session = drafter.start(torch.tensor([5, 6, 7]))
    from helpers import greedy

    assert len(session.propose(torch.tensor([5, 6, 7]), 3, greedy()).tokens) == 3
    session.rollback(0)
    assert len(session.propose(torch.tensor([5, 6, 7, 8, 130]), 3, greedy()).tokens) == 0
    assert len(session.propose(torch.tensor([5, 6, 7, 8, 130, 9]), 3, greedy()).tokens) == 0
