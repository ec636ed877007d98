"""Prompt-lookup drafting: propose the continuation of the latest earlier occurrence of the current suffix.

No model is involved. Input-grounded generation (editing a given function, quoting a document) repeats long
spans of its input, so the tokens that followed the last n-gram the last time it appeared are likely to
follow it again. Unlike transformers' ``PromptLookupCandidateGenerator``, which rescans the whole sequence
every step and takes the *first* match of at most 2 tokens, the index here is built incrementally (O(1)
amortised per committed token) and prefers the longest n-gram, then its *most recent* occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvb_speculative.errors import SpeculativeConfigError
from kvb_speculative.protocols import Draft, TokenProcessor


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptLookupConfig:
    """How suffixes are matched.

    Attributes:
        max_ngram: longest suffix (in tokens) looked up first.
        min_ngram: shortest suffix tried before giving up (then the decoder takes one plain step). The
            default 2 skips single-token matches: on the benchmark they were wrong often enough that the
            wasted verification compute cost more than they saved.
    """

    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        for name in ("min_ngram", "max_ngram"):
            value = getattr(self, name)
            # A str was a bare TypeError; a float was accepted and then failed every request in the engine.
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpeculativeConfigError(f"{name} must be an int, got {value!r}.")
        if self.min_ngram < 1:
            raise SpeculativeConfigError(f"min_ngram={self.min_ngram} must be >= 1.")
        if self.max_ngram < self.min_ngram:
            raise SpeculativeConfigError(
                f"max_ngram={self.max_ngram} must be >= min_ngram={self.min_ngram}; raise max_ngram."
            )


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the prompt and the text generated so far."""

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self.config = config or PromptLookupConfig()

    def start(self, prompt_ids: torch.Tensor) -> PromptLookupSession:
        """Index ``prompt_ids`` (``[S]`` int64) for a new request."""
        return PromptLookupSession(self.config, prompt_ids)


class PromptLookupSession:
    """The n-gram index of one request; it grows with every committed token."""

    def __init__(self, config: PromptLookupConfig, prompt_ids: torch.Tensor) -> None:
        self._config = config
        self._tokens: list[int] = []
        # _index[n][ngram] = position right after the latest occurrence of ``ngram`` that has a continuation.
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)
        }
        self._append(prompt_ids.tolist())

    def _append(self, tokens: list[int]) -> None:
        for token in tokens:
            end = len(self._tokens)
            # The n-gram ending at ``end`` now has a continuation (``token`` at position ``end``).
            for n, table in self._index.items():
                if end >= n:
                    table[tuple(self._tokens[end - n : end])] = end
            self._tokens.append(token)

    def propose(self, history: torch.Tensor, max_tokens: int, processor: TokenProcessor) -> Draft:
        """Return the continuation of the longest, most recent earlier match of the history's suffix.

        Args:
            history: ``[S]`` int64 committed tokens; must extend the tokens seen so far.
            max_tokens: upper bound on the draft length.
            processor: unused (the draft is a point mass whatever the sampling rule).

        Returns:
            A draft of ``0..max_tokens`` tokens with ``probs=None`` (deterministic).
        """
        seen = len(self._tokens)
        if history.shape[0] > seen:
            self._append(history[seen:].tolist())
        tokens = self._tokens
        length = len(tokens)
        for n in range(min(self._config.max_ngram, length), self._config.min_ngram - 1, -1):
            start = self._index[n].get(tuple(tokens[length - n :]))
            if start is not None:
                draft = tokens[start : min(start + max_tokens, length)]
                return Draft(torch.tensor(draft, dtype=torch.long), None)
        return Draft(torch.empty(0, dtype=torch.long), None)

    def rollback(self, num_accepted: int) -> None:
        """Nothing to undo: the index only ever holds committed tokens."""
