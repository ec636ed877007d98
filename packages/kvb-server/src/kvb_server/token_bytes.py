"""The UTF-8 bytes of one token, for chat logprobs' ``bytes`` field and completions' ``text_offset``.

OpenAI gives each token's bytes so that a client can join the bytes of the tokens that split one character
(an emoji is often 2-4 byte tokens). A token's decoded text cannot give them: alone, a partial character
decodes to U+FFFD, whose bytes ``[239, 191, 189]`` are not the token's. So for such a token the bytes come
from its vocabulary piece: a byte-level BPE piece (GPT-2, Llama 3, Qwen, SmolLM) spells one byte per
character through GPT-2's byte-to-unicode table; a SentencePiece byte-fallback piece is ``<0xHH>``.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvb_cache.detokenize import BYTE_PIECE, token_piece

_REPLACEMENT = "\ufffd"

#: A token's UTF-8 bytes from its id and decoded text (:class:`TokenBytes`).
TokenBytesFn = Callable[[int, str], list[int]]


def utf8(token_id: int, text: str) -> list[int]:
    """The bytes of a token's decoded text (exact unless it is part of a character)."""
    return list(text.encode("utf-8"))


class TokenBytes:
    """``token_bytes(token_id, text)``: the bytes of the token whose decoded text is ``text``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def __call__(self, token_id: int, text: str) -> list[int]:
        if _REPLACEMENT not in text:
            return list(text.encode("utf-8"))  # a whole character (or several): its text is exact
        piece = token_piece(self._tokenizer, token_id)
        if piece is not None:
            if (fallback := BYTE_PIECE.fullmatch(piece)) is not None:
                return [int(fallback.group(1), 16)]
            if all(char in self._byte_of for char in piece):
                raw = bytes(self._byte_of[char] for char in piece)
                # Only when they decode to what the tokenizer decodes (a byte-level vocabulary, not a
                # SentencePiece piece that happens to use the same characters).
                if raw.decode("utf-8", errors="replace") == text:
                    return list(raw)
        return list(text.encode("utf-8"))


class TextOffsets:
    """Completions logprobs' ``text_offset``: where each token starts in a choice's text, in characters.

    A token that is part of a character reads U+FFFD alone, so summing the tokens' texts counts one
    character per part and runs past the text ("naïve ☕ 🎉 ok", 12 characters in 17 byte-level tokens,
    had offsets up to 17). The tokens' bytes are decoded incrementally instead: a character counts once,
    when its last byte arrives, and the parts of it all start where it starts. One instance follows one
    choice, echoed prompt first, across the chunks of a stream.
    """

    def __init__(self, token_bytes: TokenBytesFn = utf8) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        #: Characters of the text so far (bytes of an unfinished character not counted yet).
        self.position = 0

    def advance(self, token_id: int, token: str) -> int:
        """The offset of the token ``token_id`` (decoded text ``token``), which then counts as read."""
        data = bytes(self._token_bytes(token_id, token))
        start = self.position
        pending, _ = self._decoder.getstate()
        if pending and data and not _continues(pending, data[0]):
            # The unfinished character never finishes: the text has U+FFFD for it before this token.
            start += len(pending.decode("utf-8", errors="replace"))
        self.position += len(self._decoder.decode(data))
        return start


def _continues(pending: bytes, byte: int) -> bool:
    """Whether ``byte`` can follow ``pending``, the start of a character, in valid UTF-8."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(pending + bytes([byte]))
    except UnicodeDecodeError:
        return False
    return True
