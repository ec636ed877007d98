"""Chat logprobs' ``bytes``: a token that splits a character reports its own bytes, so joined they spell it."""

from __future__ import annotations

import openai
from conftest import build_tokenizer

from kvb_server.token_bytes import TokenBytes

MODEL = "tiny-llama"


def test_byte_level_tokens_of_one_character_join_to_its_bytes() -> None:
    tokenizer = build_tokenizer()  # byte-level BPE: "🎉" is 4 one-byte tokens, each decoding to U+FFFD alone
    token_bytes = TokenBytes(tokenizer)
    for text in ("🎉", "é", "naïve ☕ ok"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [token_bytes(i, tokenizer.decode([i])) for i in ids]
        assert b"".join(bytes(p) for p in pieces) == text.encode("utf-8")
    assert token_bytes(tokenizer.eos_token_id, "<|im_end|>") == list(b"<|im_end|>")


class _SentencePieceLike:
    """A byte-fallback vocabulary: id 7 is the piece ``<0xF0>``."""

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return {7: "<0xF0>", 8: "▁é"}[token_id]


def test_sentencepiece_byte_fallback_and_unknown_ids() -> None:
    token_bytes = TokenBytes(_SentencePieceLike())
    assert token_bytes(7, "\ufffd") == [0xF0]
    assert token_bytes(8, " é") == list(" é".encode())
    assert token_bytes(99, "\ufffd") == [239, 191, 189]  # no piece to read: the text's bytes


def test_served_chat_logprob_bytes_spell_the_reply(tiny_url: str) -> None:
    client = openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content
    # This seed's greedy reply has tokens that are parts of characters (they decode to U+FFFD alone).
    partial = [e for e in content if e.token == "\ufffd"]
    assert partial and all(e.bytes != [239, 191, 189] for e in partial)
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", errors="replace") == resp.choices[0].message.content
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    # The same bytes streamed (logprobs agree to float noise: the second request hits the cache).
    assert [(e.token, e.bytes) for e in entries] == [(e.token, e.bytes) for e in content]


def _assert_offsets_index_the_text(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each offset is where its token starts in ``text``: whole tokens read back at their offset, and the
    parts of a split character (U+FFFD alone) stay inside the text."""
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), (offsets, len(text))
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (token, offset, text)


def test_completion_text_offsets_count_split_characters_once(tiny_url: str) -> None:
    """Byte-level BPE splits "ï", "☕" and "🎉" into 2-4 tokens, each U+FFFD alone; their offsets used to add
    one character per part (here up to 17 in a 12-character text). Streamed offsets are the same."""
    client = openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="unused", max_retries=0)
    prompt = "naïve ☕ 🎉 ok"
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    choice = client.completions.create(**kw).choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert "\ufffd" in lp.tokens  # the prompt has tokens that are parts of characters
    _assert_offsets_index_the_text(choice.text, lp.tokens, lp.text_offset)

    # Generated: this seed's greedy reply has split characters and stray bytes (U+FFFD in the text).
    kw = {**kw, "prompt": "Hello", "max_tokens": 12, "temperature": 0, "echo": False}
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    _assert_offsets_index_the_text(choice.text, lp.tokens, lp.text_offset)
    streamed = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert "".join(c.text for c in streamed) == choice.text
    assert offsets == lp.text_offset
