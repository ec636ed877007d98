"""Predicted outputs (OpenAI's ``prediction``): text the reply is expected to repeat, used as drafts.

A client that regenerates a document with small edits (code, a form) knows most of the reply in advance.
The prediction's tokens are proposed as drafts of the request's own in-step speculation
(:mod:`kvb_cache.core.speculation`) and verified like any draft: a greedy request keeps a draft only while
it is the argmax, so its text is exactly what it would be without the prediction; an unseeded sampled one
verifies them as point masses (the committed tokens follow the request's distribution). Only the speed
changes: a run of ``k`` kept drafts costs one forward instead of ``k``, and a wrong prediction costs the
rejected drafts' rows of that forward.

Where the reply leaves the prediction (an edit), drafting stops until the last few generated tokens occur
in the prediction again, and resumes after that occurrence (the first one at or after where the reply had
got to, else the first one): an edit that replaces a name resynchronises two tokens after it. A proposal
that is rejected shortens the next one (to what was kept, at least one token); a proposal kept whole
doubles it, up to :data:`PREDICTION_DRAFT_TOKENS`: a reply that writes the predicted text in other tokens
(a different split of the same characters) resynchronises on every step and would otherwise pay for
eight rejected rows on each (measured: 0.85x of plain decoding on one benchmark task before this rule).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from kvb_cache.errors import InvalidRequestError

#: Most prediction tokens proposed per step (the speculation's gamma). A kept run of 8 saves 7 decode steps;
#: a rejected one costs 8 extra rows of that step's forward, about what one decode step's other rows cost
#: on a small batch (docs/speculative.md#predicted-outputs).
PREDICTION_DRAFT_TOKENS = 8
#: The longest and shortest run of generated tokens looked up in the prediction to resynchronise.
_RESYNC_NGRAMS = (4, 3, 2)


def prediction_limit(max_new_tokens: int) -> int:
    """Prediction tokens kept for a request that generates at most ``max_new_tokens``: the reply repeats at
    most that many, with room for deletions it skips. Bounds the resynchronisation index, built on the
    engine's thread the first time the reply leaves the prediction (a 300k-token prediction stalled every
    request's step for 1.3 s there)."""
    return 2 * max_new_tokens + 1024


def check_prediction(value: object) -> tuple[int, ...] | None:
    """``prediction_ids`` as a tuple of token ids >= 0 (None or empty: no prediction).

    Raises:
        InvalidRequestError: anything but a sequence of non-negative ints.
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise InvalidRequestError(
            f"prediction_ids must be a list of token ids, got {type(value).__name__} (tokenize a text "
            "prediction first: tokenizer.encode(text, add_special_tokens=False))",
            param="prediction_ids",
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise InvalidRequestError("prediction_ids must hold token ids >= 0", param="prediction_ids")
    return tuple(value) or None


@dataclass(slots=True)
class PredictionCounts:
    """What a request's prediction did (OpenAI's ``completion_tokens_details``): drafts the verification
    kept, and drafts it rejected."""

    accepted: int = 0
    rejected: int = 0


def prediction_counts(counts: PredictionCounts | None) -> dict[str, int]:
    """A result's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens`` (0 without a prediction)."""
    if counts is None:
        return {}
    return {"accepted_prediction_tokens": counts.accepted, "rejected_prediction_tokens": counts.rejected}


@dataclass(slots=True)
class _Draft:
    tokens: torch.Tensor  # [k] int64
    probs: None = None  # point masses: verified by the target's distribution alone


@dataclass(slots=True)
class PredictionSession:
    """A :class:`~kvb_cache.decoding.StepDraftSession` whose drafts are the prediction's next tokens."""

    prediction: tuple[int, ...]
    prompt_len: int
    #: Index in ``prediction`` of the token expected next (None: out of step with the prediction).
    pos: int | None = 0
    #: How far into the prediction the reply has got (resynchronising prefers occurrences after it).
    reached: int = 0
    #: Generated tokens seen so far (the committed history past the prompt).
    generated: list[int] = field(default_factory=list)
    #: Each 2-, 3- and 4-token run of the prediction -> the positions right after its occurrences (ascending).
    index: dict[tuple[int, ...], list[int]] | None = None
    #: Tokens to propose next: doubled (up to the step's gamma) when a whole proposal is kept, cut to what was
    #: kept (at least 1) otherwise, so a prediction the reply does not follow costs one row a step, not gamma.
    length: int = PREDICTION_DRAFT_TOKENS
    proposed: int = 0

    def propose(self, history: torch.Tensor, max_tokens: int, processor: Any) -> _Draft:
        """Up to ``max_tokens`` of the prediction after what ``history`` (``[S]``) generated so far."""
        new = history[self.prompt_len + len(self.generated) :].tolist()
        if new:
            self.generated += new
            if self.pos is not None:
                ahead = self.prediction[self.pos : self.pos + len(new)]
                matched = next((i for i, (a, b) in enumerate(zip(ahead, new)) if a != b), len(ahead))
                self.reached = self.pos + matched
                self.pos = self.reached if matched == len(new) else None
            if self.pos is None:
                self.pos = self._resync()
            if self.pos is not None:
                self.reached = self.pos
        if self.pos is None or max_tokens < 1:
            self.proposed = 0
            return _Draft(torch.empty(0, dtype=torch.long))
        draft = self.prediction[self.pos : self.pos + min(max_tokens, self.length)]
        self.proposed = len(draft)
        return _Draft(torch.tensor(draft, dtype=torch.long))

    def rollback(self, num_accepted: int) -> None:
        """Adapt the proposal length to what the verification kept (the next :meth:`propose` reads the
        committed tokens themselves)."""
        if self.proposed and num_accepted >= self.proposed:
            self.length = min(2 * self.length, PREDICTION_DRAFT_TOKENS)
        elif self.proposed:
            self.length = max(1, num_accepted)

    def _resync(self) -> int | None:
        """Where the prediction continues the last generated tokens: after the first occurrence of their
        longest tail (4, 3 or 2 tokens) that ends at or after :attr:`reached`, else after the first
        occurrence; None when no tail occurs."""
        if self.index is None:
            self.index = {}
            for n in _RESYNC_NGRAMS:
                for i in range(len(self.prediction) - n + 1):
                    self.index.setdefault(self.prediction[i : i + n], []).append(i + n)
        for n in _RESYNC_NGRAMS:
            ends = self.index.get(tuple(self.generated[-n:])) if len(self.generated) >= n else None
            if ends:
                later = bisect.bisect_left(ends, self.reached)
                return ends[later] if later < len(ends) else ends[0]
        return None
