"""Turning chosen tokens into streamed text: stop strings, end-of-sequence, token limits, logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvb_cache.detokenize import IncrementalDetokenizer
from kvb_cache.results import FinishReason, TokenLogprob
from kvb_cache.stopping import StopStrings


class TokenTexts(Protocol):
    def token_text(self, token_id: int) -> str: ...


@dataclass(slots=True)
class Emitter:
    """Turns chosen tokens into text deltas, applying stop strings and end-of-sequence.

    ``min_new`` (the request's ``min_tokens``): stop strings count only once that many tokens are generated,
    as vLLM does; end-of-sequence is held back earlier, in the logits.
    """

    detok: IncrementalDetokenizer
    stops: StopStrings
    eos: frozenset[int]
    max_new: int
    min_new: int = 0
    text: str = ""
    sent: int = 0
    finish: FinishReason | None = None
    stop_reason: str | None = None

    def push(self, token: int, produced: int) -> str:
        """Account for one generated token; return the text now safe to stream."""
        if token in self.eos:
            self.text += self.detok.flush()
            return self._finish("stop", len(self.text))
        before = len(self.text)
        self.text += self.detok.push(token)
        match = self.stops.find(self.text, before) if produced >= self.min_new else None
        if match is not None:
            self.stop_reason = match.stop
            return self._finish("stop", match.index)
        if produced >= self.max_new:
            self.text += self.detok.flush()
            match = self.stops.find(self.text, before)
            if match is not None:
                self.stop_reason = match.stop
                return self._finish("stop", match.index)
            return self._finish("length", len(self.text))
        safe = len(self.text) - self.stops.holdback(self.text)
        delta, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return delta

    def end(self, reason: FinishReason) -> str:
        """Finish now (the grammar is complete): flush the text held back; return what is left to stream."""
        self.text += self.detok.flush()
        match = self.stops.find(self.text, self.sent)
        if match is not None:
            self.stop_reason = match.stop
            return self._finish("stop", match.index)
        return self._finish(reason, len(self.text))

    def _finish(self, reason: FinishReason, end: int) -> str:
        self.finish = reason
        self.text = self.text[:end]
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


def token_logprob(texts: TokenTexts, logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-probability of ``token`` under the model's raw next-token distribution ``logits`` ``[V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, str, float], ...] = ()
    if top:
        values, indices = torch.topk(logp, top)
        alternatives = tuple((int(i), texts.token_text(int(i)), float(v)) for v, i in zip(values, indices))
    return TokenLogprob(
        token_id=token, token=texts.token_text(token), logprob=float(logp[token]), top=alternatives
    )
