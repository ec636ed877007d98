"""The UTF-8 bytes of one token, for chat logprobs' ``bytes`` field.

OpenAI gives each token's bytes so that a client can join the bytes of the tokens that split one character
(an emoji is often 2-4 byte tokens). A token's decoded text cannot give them: alone, a partial character
decodes to U+FFFD, whose bytes ``[239, 191, 189]`` are not the token's. So for such a token the bytes come
from its vocabulary piece: a byte-level BPE piece (GPT-2, Llama 3, Qwen, SmolLM) spells one byte per
character through GPT-2's byte-to-unicode table; a SentencePiece byte-fallback piece is ``<0xHH>``.
"""

from __future__ import annotations

import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_REPLACEMENT = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """``token_bytes(token_id, text)``: the bytes of the token whose decoded text is ``text``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def __call__(self, token_id: int, text: str) -> list[int]:
        if _REPLACEMENT not in text:
            return list(text.encode("utf-8"))  # a whole character (or several): its text is exact
        piece = self._piece(token_id)
        if piece is not None:
            if (fallback := _BYTE_FALLBACK.fullmatch(piece)) is not None:
                return [int(fallback.group(1), 16)]
            if all(char in self._byte_of for char in piece):
                raw = bytes(self._byte_of[char] for char in piece)
                # Only when they decode to what the tokenizer decodes (a byte-level vocabulary, not a
                # SentencePiece piece that happens to use the same characters).
                if raw.decode("utf-8", errors="replace") == text:
                    return list(raw)
        return list(text.encode("utf-8"))

    def _piece(self, token_id: int) -> str | None:
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        try:
            piece = convert(token_id) if convert is not None else None
        except (IndexError, KeyError, TypeError, ValueError):  # an id the vocabulary lacks
            return None
        return piece if isinstance(piece, str) else None
