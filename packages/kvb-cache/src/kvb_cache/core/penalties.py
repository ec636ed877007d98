"""Token statistics a request's penalties read, kept up to date as its tokens grow.

Repetition, presence and frequency penalties depend on which tokens a request has seen and how often it
generated each. Rebuilding those from the whole token list every step (a list -> tensor copy per row per
step) made sampling cost O(generated) per token: with 16 penalized rows at 1,750 output tokens it took
longer than the forward. Here each step only folds in the tokens added since the last one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PenaltyHistory:
    """One request's seen-token ids and output-token counts, updated incrementally.

    ``tokens`` passed in must be the request's full token list (prompt then output); it only grows in the
    engine loop. A list that shrank (a rollback) or a different vocabulary width rebuilds from scratch.
    """

    __slots__ = ("_counted", "_counts", "_seen", "_seen_ids", "_seen_upto", "_vocab")

    def __init__(self) -> None:
        self._reset(-1)

    def _reset(self, vocab: int) -> None:
        self._vocab = vocab
        self._seen: set[int] = set()
        self._seen_ids: torch.Tensor | None = None  # [U] int64, distinct ids < vocab, in first-seen order
        self._seen_upto = 0  # tokens[:_seen_upto] are in _seen
        self._counts: torch.Tensor | None = None  # [V] float32 occurrences per output token id
        self._counted = 0  # output tokens folded into _counts

    def _check(self, vocab: int, device: torch.device, length: int) -> None:
        stale = (
            vocab != self._vocab
            or length < self._seen_upto
            or (self._seen_ids is not None and self._seen_ids.device != device)
        )
        if stale:
            self._reset(vocab)

    def seen_ids(self, tokens: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        """``[U]`` int64: the distinct ids below ``vocab`` among ``tokens`` (prompt and output)."""
        self._check(vocab, device, len(tokens))
        fresh = [t for t in dict.fromkeys(tokens[self._seen_upto :]) if t < vocab and t not in self._seen]
        if fresh or self._seen_ids is None:
            self._seen.update(fresh)
            new = torch.tensor(fresh, dtype=torch.long, device=device)
            self._seen_ids = new if self._seen_ids is None else torch.cat([self._seen_ids, new])
        self._seen_upto = len(tokens)
        return self._seen_ids

    def output_counts(
        self, tokens: Sequence[int], prompt_len: int, vocab: int, device: torch.device
    ) -> torch.Tensor:
        """``[V]`` float32: how many times each id occurs in ``tokens[prompt_len:]`` (ids >= vocab ignored)."""
        self._check(vocab, device, len(tokens))
        if self._counts is None or len(tokens) - prompt_len < self._counted:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._counted = 0
        new = [t for t in tokens[prompt_len + self._counted :] if t < vocab]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=device)
            self._counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.float32, device=device))
        self._counted = len(tokens) - prompt_len
        return self._counts
