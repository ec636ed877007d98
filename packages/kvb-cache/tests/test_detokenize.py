"""Generated tokens to text with a SentencePiece-style tokenizer (Llama 2 / Mistral's decoder: ``▁`` to a
space, byte fallback, the first space stripped), and stop strings with ``min_tokens``."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from conftest import words
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvb_cache import EngineConfig, KVBoost
from kvb_cache.detokenize import IncrementalDetokenizer, token_text
from kvb_cache.emitter import Emitter
from kvb_cache.sampling import SamplingParams

PIECES = ["▁hello", "▁world", "▁x", "x", "▁", "h", "e", "l", "o", "w", "r", "d", "▁▁", "▁▁▁▁"]


def sentencepiece_tokenizer() -> T.PreTrainedTokenizerFast:
    """Byte fallback (``<0x00>`` .. ``<0xFF>``), Metaspace words, and Llama 2's decoder sequence."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)] + PIECES)}
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=[("▁", "x")], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return T.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def sp_engine() -> KVBoost:
    tok = sentencepiece_tokenizer()
    torch.manual_seed(0)
    config = T.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=len(tok),
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=2,
    )
    model = T.AutoModelForCausalLM.from_config(config).eval()
    return KVBoost(model, tok, config=EngineConfig(chunk_size=16))


def test_the_first_generated_word_keeps_its_space(sp_engine):
    """Decoded alone, the reply's first ``▁x`` lost its space ("hello" + "x x x": the words glued)."""
    tok = sp_engine.tokenizer
    x = tok.convert_tokens_to_ids("▁x")
    forced = {"logit_bias": {x: 100}, "max_new_tokens": 3, "ignore_eos": True}
    result = sp_engine.generate("hello", **forced)
    assert result.output_ids == [x] * 3 and result.output_text == " x x x"
    prompt = tok("hello")["input_ids"]
    assert tok.decode(prompt + result.output_ids)[len(tok.decode(prompt)) :] == result.output_text
    assert "".join(e.delta_text for e in sp_engine.stream("hello", **forced)) == " x x x"
    # A stop string with a leading space matches the first word (it could not: its text was "x").
    stopped = sp_engine.generate("hello", stop=[" x"], include_stop_str_in_output=True, **forced)
    assert stopped.output_ids == [x] and stopped.output_text == " x"


def test_logprob_tokens_keep_the_space_and_spell_the_reply(sp_engine):
    tok = sp_engine.tokenizer
    x, space = tok.convert_tokens_to_ids("▁x"), tok.convert_tokens_to_ids("<0x20>")
    result = sp_engine.generate("hello", logit_bias={x: 100}, max_new_tokens=3, ignore_eos=True, logprobs=1)
    assert [lp.token for lp in result.logprobs] == [" x"] * 3
    assert "".join(lp.token for lp in result.logprobs) == result.output_text
    assert token_text(tok, space) == " "  # decoded alone: "" (the Strip decoder's first space)
    assert token_text(tok, tok.convert_tokens_to_ids("<0xE6>")) == "\ufffd"  # part of a character
    assert token_text(tok, tok.convert_tokens_to_ids("x")) == "x"
    assert token_text(tok, 2) == "</s>"


def test_a_run_of_space_marks_reads_as_that_many_spaces(sp_engine):
    """``▁▁`` / ``▁▁▁▁`` (indentation in code, in Llama 2 / Mistral vocabularies) decode alone with a space
    fewer (the Strip decoder): their logprob tokens read one space each, so the tokens no longer spelt the
    reply and completions' text offsets drifted (an audit, 2026-11-30)."""
    tok = sp_engine.tokenizer
    two, four = tok.convert_tokens_to_ids("▁▁"), tok.convert_tokens_to_ids("▁▁▁▁")
    assert (token_text(tok, two), token_text(tok, four)) == ("  ", "    ")
    result = sp_engine.generate("hello", logit_bias={two: 100}, max_new_tokens=2, ignore_eos=True, logprobs=0)
    assert result.output_text == "    " and [lp.token for lp in result.logprobs] == ["  ", "  "]
    metaspace = sentencepiece_tokenizer()
    metaspace.backend_tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    assert token_text(metaspace, four) == "    " and token_text(metaspace, two) == "  "


def byte_level_tokenizer() -> T.PreTrainedTokenizerFast:
    """Byte-level BPE whose one token holds "о" and the first byte of the next Cyrillic letter (SmolLM2
    has such tokens: it decodes alone to "о\ufffd")."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(["<eos>", *sorted(alphabet), "Ð¾", "Ð¾Ð"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ð", "¾"), ("Ð¾", "Ð")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return T.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def test_a_stop_string_in_text_held_back_until_end_of_sequence_ends_the_text():
    """A token ending inside a character is held back with the whole characters before it; end of
    sequence then flushed it without looking for stop strings, so the stop string stayed in the text with
    no stop reason (max_new_tokens, at the same point, found it)."""
    tok = byte_level_tokenizer()
    held, eos = tok.convert_tokens_to_ids("Ð¾Ð"), tok.eos_token_id
    assert tok.decode([held]) == "о\ufffd"
    for stop_ids in ((), (eos,)):
        emitter = Emitter.build(tok, frozenset({eos}), SamplingParams(stop=["о"], max_new_tokens=8), [])
        emitter.stop_ids = frozenset(stop_ids)
        deltas = [emitter.push(held, 1), emitter.push(eos, 2)]
        assert (emitter.text, emitter.stop_reason, emitter.finish) == ("", "о", "stop")
        assert "".join(deltas) == ""


def test_a_word_level_reply_reads_as_it_follows_the_prompt(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, context=tokenizer("w1 w2")["input_ids"])
    ids = tokenizer("w3 w4")["input_ids"]
    assert "".join(detok.push(t) for t in ids) + detok.flush() == " w3 w4"
    alone = IncrementalDetokenizer(tokenizer)
    assert "".join(alone.push(t) for t in ids) == "w3 w4"  # no prompt: as decode


def _emit(tokenizer, ids, **params) -> tuple[Emitter, list[str]]:
    emitter = Emitter.build(
        tokenizer, frozenset(), SamplingParams(**params), tokenizer(words(3))["input_ids"]
    )
    deltas = []
    for produced, token in enumerate(ids, 1):
        deltas.append(emitter.push(token, produced))
        if emitter.finish is not None:
            break
    return emitter, deltas


def test_min_tokens_stop_strings_count_only_after_the_first_min_tokens(tokenizer):
    """vLLM's rule: a stop string counts in the text of the tokens after the first ``min_tokens``. A short
    stop wholly inside that text was found once a longer stop widened the search (the reply was cut to ""
    after " w5" had been streamed), and the boundary token itself counted."""
    ids = tokenizer(" ".join(["w5"] * 6))["input_ids"]
    for stop in (["w5", "QQQQQQQQ"], ["w5"]):
        emitter, deltas = _emit(tokenizer, ids, max_new_tokens=6, min_tokens=3, stop=stop)
        assert emitter.text == " w5 w5 w5 " and emitter.stop_reason == "w5"
        assert "".join(deltas) == emitter.text  # streamed == returned
    # With min_tokens == max_new_tokens no stop string counts.
    emitter, _ = _emit(tokenizer, ids[:3], max_new_tokens=3, min_tokens=3, stop=["w5"])
    assert emitter.finish == "length" and emitter.text == " w5 w5 w5"
    # A stop reaching back over the boundary counts (it ends in a counted token's text).
    emitter, _ = _emit(tokenizer, ids, max_new_tokens=6, min_tokens=3, stop=["w5 w5"])
    assert emitter.text == " w5 w5 " and emitter.finish == "stop"  # cut where it starts, in token 3
