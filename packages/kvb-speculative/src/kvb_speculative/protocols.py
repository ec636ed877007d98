"""Identifiers and protocols shared by drafters, verifiers and the decoder.

``TokenProcessor`` mirrors the contract of ``kvb_cache.decoding.TokenProcessor`` structurally: this package
imports nothing from kvb_cache, yet every processor the engine passes satisfies it.
"""

from __future__ import annotations

from typing import NamedTuple, NewType, Protocol, runtime_checkable

import torch

#: A vocabulary index of the target model.
TokenId = NewType("TokenId", int)


@runtime_checkable
class TokenProcessor(Protocol):
    """One request's sampling rule (penalties, temperature, top-k, top-p) applied to raw logits."""

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of :meth:`process` (temperature 0)."""
        ...

    @property
    def generator(self) -> torch.Generator | None:
        """The request's seeded RNG (None: torch's global RNG); every random draw uses it."""
        ...

    def process(self, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Map ``[V]`` raw logits following ``history`` (``[S]`` int64) to ``[V]`` float32 processed logits.

        Excluded tokens are ``-inf``; sampling draws from the softmax, greedy takes the argmax.
        """
        ...


class Draft(NamedTuple):
    """Tokens a drafter proposes to follow the committed history.

    Attributes:
        tokens: ``[k]`` int64 proposed token ids, ``0 <= k <= max_tokens`` (``k == 0``: nothing to propose).
        probs: ``[k, V]`` float32 proposal distributions the tokens were sampled from (the drafter's
            processed softmax), or None when the drafter is deterministic (each proposal is a point mass).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None


@runtime_checkable
class DraftSession(Protocol):
    """A drafter's state for one request (e.g. the draft model's own KV cache)."""

    def propose(self, history: torch.Tensor, max_tokens: int, processor: TokenProcessor) -> Draft:
        """Propose up to ``max_tokens`` tokens to follow ``history``.

        Args:
            history: ``[S]`` int64 committed token ids (prompt + output so far). It only ever grows by
                tokens the target committed: rejected proposals never appear in it. It may equal the
                previous call's when that proposal was never verified (an engine step that failed first).
            max_tokens: upper bound on the number of proposed tokens (>= 1).
            processor: the request's sampling rule; a model drafter samples (or argmaxes) through it.
        """
        ...

    def rollback(self, num_accepted: int) -> None:
        """Forget the proposals after the first ``num_accepted`` of the last :meth:`propose` call."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """A pluggable source of draft tokens; one :class:`DraftSession` per request."""

    def start(self, prompt_ids: torch.Tensor) -> DraftSession:
        """Open a session for a request whose prompt is ``prompt_ids`` (``[S]`` int64)."""
        ...
