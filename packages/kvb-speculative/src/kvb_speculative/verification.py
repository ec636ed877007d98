"""Deciding how many drafted tokens the target accepts, and which token it commits after them.

Greedy: a draft token is accepted iff it equals the argmax of the target's processed logits at its position;
the first mismatch is replaced by that argmax, so the output is the target's own greedy sequence.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``x`` drawn from ``q`` is accepted with
probability ``min(1, p(x) / q(x))``; on rejection the committed token is drawn from
``norm(max(p - q, 0))``; when all ``k`` are accepted a bonus token is drawn from ``p`` at position ``k``.
Each committed token is then distributed exactly as ``p``. A deterministic drafter has ``q = onehot(x)``:
accept with probability ``p(x)``, else draw from ``p`` with ``x`` removed.

A row of target scores that holds NaN decides nothing honestly, so verification raises
:class:`~kvb_speculative.errors.NonFiniteLogitsError` when it would consult one (rows after the first
rejection are never consulted, so a NaN there, e.g. from a drafted token the target overflows on, is ignored).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from kvb_speculative.errors import NonFiniteLogitsError
from kvb_speculative.protocols import Draft
from kvb_speculative.sampling import sample_token


class Verdict(NamedTuple):
    """Outcome of verifying one draft.

    Attributes:
        num_accepted: how many leading draft tokens are committed (``0..k``).
        next_token: the token committed after them (the correction, or the bonus when all were accepted).
    """

    num_accepted: int
    next_token: int


class Verifier(Protocol):
    """Turns target scores and a draft into a :class:`Verdict`."""

    def verify(
        self, scores: torch.Tensor, draft: Draft, *, greedy: bool, generator: torch.Generator | None
    ) -> Verdict:
        """Args:
        scores: ``[k + 1, V]`` processed target logits; row ``j`` scores the token after ``j`` drafts.
        draft: ``k`` drafted tokens (and their proposal distributions, or None for point masses).
        greedy: argmax decoding instead of sampling.
        generator: RNG for every random draw.
        """
        ...


class ExactVerifier:
    """The lossless rule: greedy output equals the target's greedy output, samples follow its distribution."""

    def verify(
        self, scores: torch.Tensor, draft: Draft, *, greedy: bool, generator: torch.Generator | None
    ) -> Verdict:
        """See :class:`Verifier`.

        Raises:
            NonFiniteLogitsError: a row the verdict depends on holds NaN.
        """
        tokens = draft.tokens.tolist()
        nan_rows = torch.isnan(scores).any(dim=-1).long()  # [k + 1]: argmax would return a NaN's index
        if greedy:
            # One host sync for the argmax and the NaN flags together.
            best, nan = torch.stack([torch.argmax(scores, dim=-1), nan_rows]).tolist()  # [k + 1] each
            for j, token in enumerate(tokens):
                _check_row(nan, j)
                if token != best[j]:
                    return Verdict(j, best[j])
            _check_row(nan, len(tokens))
            return Verdict(len(tokens), best[-1])
        nan = nan_rows.tolist()
        p = torch.softmax(scores, dim=-1)  # [k + 1, V]
        uniforms = torch.rand(len(tokens), generator=generator, device=p.device).tolist()
        for j, token in enumerate(tokens):
            _check_row(nan, j)
            q_token = 1.0 if draft.probs is None else float(draft.probs[j, token])
            p_token = float(p[j, token])
            # Strict "<": a token the target excludes (p = 0) is never accepted, even when u == 0.
            if q_token > 0 and uniforms[j] < p_token / q_token:
                continue
            if draft.probs is None:
                residual = p[j].clone()
                residual[token] = 0.0
            else:
                residual = torch.clamp(p[j] - draft.probs[j].to(p.device), min=0.0)
            total = float(residual.sum())
            # p == q up to rounding leaves no residual mass; rejection then had probability ~0, so p is exact.
            return Verdict(j, sample_token(residual / total if total > 0 else p[j], generator))
        _check_row(nan, len(tokens))
        return Verdict(len(tokens), sample_token(p[-1], generator))


def _check_row(nan: list[int], row: int) -> None:
    """Raise when the scores row the verdict is about to use holds NaN."""
    if nan[row]:
        raise NonFiniteLogitsError()
