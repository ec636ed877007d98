"""vLLM's ``allowed_token_ids`` and ``bad_words``: tokens a request may or may not produce next.

``allowed_token_ids`` keeps only the listed ids (the rest ``-inf``): a judge that must answer ``Yes`` or
``No``, a classifier over a label set. ``bad_words`` bans words: each is a token sequence whose *last* token
is banned whenever the output so far ends with the sequence's other tokens (a one-token word is banned
everywhere). As in vLLM, only the output is matched, never the prompt (transformers'
``NoBadWordsLogitsProcessor`` matches the prompt too, so a word the prompt ends half-way through would be
banned at the first step: a different rule, hence not used here), and a word is tokenized twice, as it
would start the text and after a space (:func:`bad_words_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvb_cache.errors import InvalidRequestError, check_utf8


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def bad_words_ids(tokenizer: _Encoder, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token sequences for :attr:`kvb_cache.SamplingParams.bad_words_ids`.

    Each word (leading whitespace dropped) is encoded as is and after a space; the spaced form is kept when
    it is another word of the same length (``"Paris"`` and ``" Paris"`` are two tokens in most BPE
    vocabularies, the second the one that follows other text), as vLLM keeps it.

    Raises:
        InvalidRequestError: a word that is empty or only whitespace (it bans nothing).
    """
    found: list[tuple[int, ...]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise InvalidRequestError(
                f"bad_words must be non-empty strings that are not only whitespace, got {word!r}",
                param="bad_words",
            )
        check_utf8(word, "bad_words")
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        found.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    return tuple(dict.fromkeys(found))


def _token_ids(value: object) -> bool:
    """Whether ``value`` is a non-empty list or tuple of token ids (ints >= 0, not bools)."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def check_sequences(value: object) -> tuple[tuple[int, ...], ...]:
    """``bad_words_ids`` as a tuple of non-empty tuples of token ids >= 0.

    Raises:
        InvalidRequestError: anything else.
    """
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(
            f"bad_words_ids must be a list of token-id lists, got {type(value).__name__}",
            param="bad_words_ids",
        )
    out = []
    for seq in value:
        if not _token_ids(seq):
            raise InvalidRequestError(
                f"bad_words_ids must hold non-empty lists of token ids >= 0, got {seq!r}",
                param="bad_words_ids",
            )
        out.append(tuple(seq))
    return tuple(out)


def check_allowed(value: object) -> tuple[int, ...] | None:
    """``allowed_token_ids`` as a non-empty tuple of distinct token ids >= 0 (None: every token).

    Raises:
        InvalidRequestError: an empty list (no token could ever be chosen) or anything but token ids.
    """
    if value is None:
        return None
    if not _token_ids(value):
        raise InvalidRequestError(
            f"allowed_token_ids must be a non-empty list of token ids >= 0, got {value!r}",
            param="allowed_token_ids",
        )
    return tuple(dict.fromkeys(value))


class TokenBans:
    """One request's ``allowed_token_ids`` and ``bad_words_ids``, applied to a ``[V]`` row of scores."""

    def __init__(
        self,
        allowed: tuple[int, ...] | None,
        bad_words: tuple[tuple[int, ...], ...],
        device: torch.device,
    ) -> None:
        self.allowed: torch.Tensor | None = (
            None if allowed is None else torch.tensor(allowed, dtype=torch.long, device=device)
        )
        self._single = sorted({seq[0] for seq in bad_words if len(seq) == 1})
        # (the tokens before the banned one, the banned one): matched against the output's tail each step.
        self._multi = [(list(seq[:-1]), seq[-1]) for seq in bad_words if len(seq) > 1]

    def banned(self, tokens: list[int], prompt_len: int) -> list[int]:
        """Ids banned next, given ``tokens`` (prompt then output) of which the output starts at
        ``prompt_len``."""
        out = list(self._single)
        generated = len(tokens) - prompt_len
        for prefix, last in self._multi:
            n = len(prefix)
            if n <= generated and tokens[len(tokens) - n :] == prefix:
                out.append(last)
        return out

    def apply_(self, row: torch.Tensor, tokens: list[int], prompt_len: int) -> None:
        """``-inf`` in ``row`` ``[V]`` float32 for every token the request may not produce next (in place)."""
        if self.allowed is not None:
            keep = row.index_select(0, self.allowed)
            row.fill_(-float("inf"))
            row.index_copy_(0, self.allowed, keep)
        banned = self.banned(tokens, prompt_len)
        if banned:
            row[[t for t in banned if t < row.shape[0]]] = -float("inf")


def check_choosable(row: torch.Tensor, params: object, *, holds_eos: bool, constrained: bool) -> None:
    """Raise when every token of ``row`` ``[V]`` (fully processed scores) is ``-inf``.

    With ``allowed_token_ids`` and ``bad_words`` (with ``min_tokens``, which bans end-of-sequence, or a
    ``response_format`` grammar) a request can exclude every token; argmax would then return token 0 as if
    the model had chosen it, and a draw from the NaN softmax raise from inside torch. ``params`` (a
    :class:`~kvb_cache.SamplingParams`), ``holds_eos`` and ``constrained`` say which options ban tokens at
    this step; they are read only to word the error.

    Raises:
        InvalidRequestError: naming those options.
    """
    if bool(torch.isfinite(row).any()):
        return
    causes = []
    if getattr(params, "allowed_token_ids", None) is not None:
        causes.append("allowed_token_ids")
    if getattr(params, "bad_words_ids", ()):
        causes.append("bad_words")
    if constrained:
        causes.append("response_format (or the tools' grammar)")
    if holds_eos:
        causes.append("min_tokens (which holds end-of-sequence back)")
    raise InvalidRequestError(
        f"no token can be chosen: {' and '.join(causes)} together exclude every token at this point of the "
        "output; loosen one of them",
        param="allowed_token_ids" if "allowed_token_ids" in causes else (causes[0] if causes else None),
    )
