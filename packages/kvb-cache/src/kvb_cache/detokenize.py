"""Incremental detokenization (text deltas that concatenate to the reply's text after its prompt), and one
token's text."""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

#: A SentencePiece byte-fallback piece, ``<0xHH>``.
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"  # SentencePiece's word-start mark, "▁"

#: Prompt tokens the window starts with (vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and the leading-space rules of SentencePiece
    tokenizers, and re-decoding everything each step is quadratic. Like TGI and vLLM, decode a short window
    ``ids[prefix:]`` and emit what lies past ``ids[prefix:read]``; hold back while the text ends in an
    incomplete character (U+FFFD).

    The window starts with the last ``CONTEXT_TOKENS`` tokens of the prompt (``context``), as vLLM's and
    TGI's do, so the first generated token reads as it does after the prompt: a SentencePiece decoder
    (Llama 2, Mistral) strips the space of a sequence's first ``▁word``, so decoded alone the reply's first
    word lost its space ("Hello world" + ``▁x`` read "Hello worldx"), a stop string starting with a space
    could not match it, and a regex-constrained reply did not match its own regex. The text is then what
    follows the prompt, as transformers' pipelines cut it (``decode(prompt + reply)[len(decode(prompt)):]``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(context[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
        self._prefix = 0
        self._read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            delta = text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (called once generation ends)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text) :] if text.startswith(prefix_text) else ""


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """One token's text as it reads inside a sequence (the ``token`` of a logprob entry).

    ``decode([id])``, except where a SentencePiece decoder (Llama 2, Mistral: ``Replace("▁", " ")``,
    ``ByteFallback``, ``Strip``) decodes a lone token unlike the same token mid-text: a word-initial piece
    ``▁x`` decodes alone to ``"x"`` (the space of a sequence's first word is stripped), though it reads
    ``" x"`` in the reply; a byte-fallback piece of an ASCII byte (``<0x20>``) decodes alone to ``""``
    (stripped) or to its character. Without this, the logprobs' tokens, ``bytes`` and completions'
    ``text_offset`` lost one space per word and no longer spelt or indexed the text.
    """
    text = tokenizer.decode([token_id])
    piece = token_piece(tokenizer, token_id)
    if piece is None:
        return text
    fallback = BYTE_PIECE.fullmatch(piece)
    if fallback is not None and int(fallback.group(1), 16) < 0x80:
        return chr(int(fallback.group(1), 16))
    # Only where the decoder turns the marks into spaces (they are gone from the text) and stripped some:
    # a run of them (``▁▁``, ``▁▁▁▁``: indentation in code) decodes alone with one space fewer (Llama 2's
    # Strip) or as one space (a Metaspace decoder), though it reads as that many spaces mid-text.
    if piece.startswith(_METASPACE) and _METASPACE not in text:
        marks = len(piece) - len(piece.lstrip(_METASPACE))
        spaces = len(text) - len(text.lstrip(" "))
        if spaces < marks:
            return " " * (marks - spaces) + text
    return text


def token_piece(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str | None:
    """The vocabulary piece of ``token_id`` (``convert_ids_to_tokens``); None for an id the vocabulary
    lacks or a tokenizer without pieces."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    try:
        piece = convert(token_id) if convert is not None else None
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return piece if isinstance(piece, str) else None
