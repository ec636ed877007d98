"""Turning chosen tokens into streamed text: stop strings and tokens, end-of-sequence, token limits, logprobs."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvb_cache.detokenize import IncrementalDetokenizer
from kvb_cache.results import FinishReason, TokenLogprob
from kvb_cache.stopping import StopMatch, StopStrings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvb_cache.sampling import SamplingParams


class TokenTexts(Protocol):
    def token_text(self, token_id: int) -> str: ...


@dataclass(slots=True)
class Emitter:
    """Turns chosen tokens into text deltas, applying stop strings, stop tokens and end-of-sequence.

    ``eos`` ends generation (empty with ``ignore_eos``); ``stop_ids`` (the request's ``stop_token_ids``) end
    it too and become its ``stop_reason``. The text of the token or string that stopped generation is left
    out unless ``include_stop`` (vLLM's ``include_stop_str_in_output``). ``min_new`` (the request's
    ``min_tokens``): stop strings count only in the text of the tokens after the first ``min_new``, as
    vLLM's detokenizer does (one reaching back into that text counts, one wholly inside it never does);
    stop tokens are held back earlier, in the logits.
    """

    detok: IncrementalDetokenizer
    stops: StopStrings
    eos: frozenset[int]
    max_new: int
    min_new: int = 0
    stop_ids: frozenset[int] = frozenset()
    include_stop: bool = False
    text: str = ""
    sent: int = 0
    finish: FinishReason | None = None
    stop_reason: str | int | None = None
    #: Offset in ``text`` where each generated token's text begins (non-decreasing: text is cut only at the end).
    starts: list[int] = field(default_factory=list)
    cut: bool = False  # a stop string ended generation and was cut from the text

    @classmethod
    def build(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        eos: frozenset[int],
        params: SamplingParams,
        prompt: Sequence[int] = (),
    ) -> Emitter:
        """The emitter of one request (``eos``: the model's end-of-sequence ids; ``prompt``: its prompt ids,
        whose last tokens the text is decoded after)."""
        return cls(
            detok=IncrementalDetokenizer(
                tokenizer, skip_special_tokens=params.skip_special_tokens, context=prompt
            ),
            stops=StopStrings(params.stop),
            eos=frozenset() if params.ignore_eos else eos,
            max_new=params.max_new_tokens,
            min_new=params.min_tokens,
            stop_ids=frozenset(params.stop_token_ids),
            include_stop=params.include_stop_str_in_output,
        )

    @property
    def stop_tokens(self) -> frozenset[int]:
        """Every token id that ends generation (what ``min_tokens`` bans)."""
        return self.eos | self.stop_ids

    def push(self, token: int, produced: int) -> str:
        """Account for one generated token; return the text now safe to stream."""
        self.starts.append(len(self.text))
        if token in self.stop_ids or token in self.eos:
            before = len(self.text)
            if self.include_stop:
                self.text += self.detok.push(token)
            self.text += self.detok.flush()
            # The flushed text was held back (a token ending inside a character can hold whole characters
            # too): a stop string in it ends the text there, as when max_new_tokens ends it.
            match = self.stops.find(self.text, before) if produced > self.min_new else None
            if match is not None:
                return self._stopped(match)
            if token in self.stop_ids:
                self.stop_reason = token
            return self._finish("stop", len(self.text))
        before = len(self.text)
        self.text += self.detok.push(token)
        counts = produced > self.min_new  # stop strings count in this token's text
        match = self.stops.find(self.text, before) if counts else None
        if match is not None:
            return self._stopped(match)
        if produced >= self.max_new:
            self.text += self.detok.flush()
            match = self.stops.find(self.text, before) if counts else None
            if match is not None:
                return self._stopped(match)
            return self._finish("length", len(self.text))
        safe = len(self.text) - self.stops.holdback(self.text)
        delta, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return delta

    def end(self, reason: FinishReason) -> str:
        """Finish now (the grammar is complete): flush the text held back; return what is left to stream."""
        self.text += self.detok.flush()
        match = self.stops.find(self.text, self.sent)
        if match is not None:
            return self._stopped(match)
        return self._finish(reason, len(self.text))

    def covered(self) -> int:
        """How many generated tokens the text streamed so far covers: whose logprobs may be released.

        Every token once finished, except the tokens of a stop string cut from the text (a token whose text
        only begins before the cut stays). While a stop string may still match, tokens whose text is held back
        wait with it; so the logprobs' tokens spell the returned text, as on OpenAI.
        """
        if not self.stops.stops or (self.finish is not None and not self.cut):
            return len(self.starts)
        return bisect_left(self.starts, len(self.text) if self.finish is not None else self.sent)

    def _stopped(self, match: StopMatch) -> str:
        self.cut = True
        self.stop_reason = match.stop
        return self._finish("stop", match.index + (len(match.stop) if self.include_stop else 0))

    def _finish(self, reason: FinishReason, end: int) -> str:
        self.finish = reason
        self.text = self.text[:end]
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


def token_logprob(texts: TokenTexts, logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-probability of ``token`` under the model's raw next-token distribution ``logits`` ``[V]``."""
    return token_logprobs(texts, logits.unsqueeze(0), [token], [top])[0]


def token_logprobs(
    texts: TokenTexts, logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """:func:`token_logprob` of every row of ``logits`` ``[N, V]`` (row ``i`` chose ``tokens[i]`` and asks
    for ``tops[i]`` alternatives), in one log-softmax, one top-k and one host transfer each: done row by
    row, a 32-row decode step with logprobs spent ~15% of its time in per-row ops and syncs."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device).unsqueeze(1)
    chosen = logp.gather(1, index)[:, 0].tolist()
    # More than the vocabulary is the whole vocabulary (vLLM's max_logprobs -1), not topk's RuntimeError.
    k = min(max(tops, default=0), logp.shape[-1])
    values: list[list[float]] = []
    indices: list[list[int]] = []
    if k:
        top_values, top_indices = torch.topk(logp, k)
        values, indices = top_values.tolist(), top_indices.tolist()
    results = []
    for row, (token, top) in enumerate(zip(tokens, tops)):
        # topk's rows are sorted, so a row's first ``top`` are its own top-k.
        pairs = zip(values[row][:top], indices[row][:top]) if top else ()
        alternatives = tuple((i, texts.token_text(i), v) for v, i in pairs)
        results.append(
            TokenLogprob(token_id=token, token=texts.token_text(token), logprob=chosen[row], top=alternatives)
        )
    return results
