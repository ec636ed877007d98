"""Speculation inside the batched step (vLLM v1's way): each request that speculates here drafts tokens before
the step is scheduled (:func:`propose`); the scheduler feeds its last token and the drafts as one slice of the
packed forward (they never preempt anyone); the engine core then verifies them (:func:`verdict`) and commits
the accepted drafts plus one token, each through the emitter.

Two kinds of request speculate here (:func:`verifiable_in_step`): greedy ones whose next token is the argmax
of their raw logits (:func:`verifiable_by_argmax`: a draft is kept while it equals one argmax, exact whatever
the batch), and unseeded sampled ones whose processing does not depend on their history (temperature, top-k
/ top-p / min-p, ``logit_bias``), verified by speculative sampling (:func:`sampled_verdict`). Penalised and
seeded requests keep kvb-speculative's solo path; grammars and ``logprobs`` keep the one-token step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvb_cache.core.outputs import RequestOutput
from kvb_cache.core.sampler import process_logits
from kvb_cache.prediction import PREDICTION_DRAFT_TOKENS, PredictionCounts, PredictionSession

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kvb_cache.core.request import Request
    from kvb_cache.decoding import StepDrafter, StepDraftSession

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepSpeculation:
    """One request's drafter session and its committed tokens as the tensor the drafter reads: a buffer of
    ``prompt + max_new_tokens`` ids filled as tokens are committed (a fresh ``torch.tensor`` of the whole
    history for every request at every step cost O(context) host work each)."""

    session: StepDraftSession
    history: torch.Tensor  # [prompt_len + max_new_tokens] int64; the first ``filled`` are committed
    #: Most tokens drafted per step.
    gamma: int
    filled: int = 0
    #: A prediction's own counts (:mod:`kvb_cache.prediction`); None: the engine's drafter counts the rounds.
    counts: PredictionCounts | None = None

    @staticmethod
    def _history(prompt: list[int], max_new_tokens: int) -> torch.Tensor:
        history = torch.empty(len(prompt) + max_new_tokens, dtype=torch.long)
        history[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        return history

    @classmethod
    def start(cls, drafter: StepDrafter, prompt: list[int], max_new_tokens: int) -> StepSpeculation:
        history = cls._history(prompt, max_new_tokens)
        session = drafter.draft_session(history[: len(prompt)].clone())
        return cls(session=session, history=history, gamma=drafter.gamma, filled=len(prompt))

    @classmethod
    def predicted(
        cls, prediction: tuple[int, ...], prompt: list[int], max_new_tokens: int
    ) -> StepSpeculation:
        """Drafts from the request's own prediction (OpenAI's predicted outputs), whatever drafter the engine
        has (none included)."""
        return cls(
            session=PredictionSession(prediction, len(prompt)),
            history=cls._history(prompt, max_new_tokens),
            gamma=PREDICTION_DRAFT_TOKENS,
            filled=len(prompt),
            counts=PredictionCounts(),
        )

    def committed(self, tokens: list[int]) -> torch.Tensor:
        """``[len(tokens)]``: the committed tokens (a view of the buffer, brought up to date)."""
        n = len(tokens)
        if n > self.filled:
            self.history[self.filled : n] = torch.tensor(tokens[self.filled : n], dtype=torch.long)
            self.filled = n
        return self.history[:n]


def verifiable_by_argmax(req: Request) -> bool:
    """Whether ``req``'s next token is the argmax of its raw logits whatever it generated before: greedy,
    with no bias, ban, penalty, ``min_tokens`` hold or grammar."""
    return req.processor.is_identity and not req.params.min_tokens and req.grammar is None


def verifiable_in_step(req: Request) -> bool:
    """Whether the batched step can verify ``req``'s drafts: greedy by argmax (:func:`verifiable_by_argmax`),
    or sampled without a seed and with a processing that does not depend on its history (temperature,
    top-k / top-p / min-p, ``logit_bias``; no penalty, banned words, ``min_tokens`` or grammar), by
    rejection sampling (:func:`sampled_verdict`). A seeded request keeps the solo path: drafts cut by the
    step's budget would change how many random numbers it draws, so its text would depend on the load."""
    if verifiable_by_argmax(req):
        return True
    params = req.params
    return (
        not params.greedy
        and params.seed is None
        and req.grammar is None
        and not params.min_tokens
        and req.processor.history_free
    )


def propose(running: Iterable[Request]) -> list[Request]:
    """Set ``draft`` on every running request that speculates and is decoding (at most its ``gamma`` tokens,
    and short of its ``max_new_tokens``: the request was admitted for that many positions only); returns
    those that drafted any. A drafter's failure costs its request the drafts (it decodes on without), nothing
    else."""
    drafting = []
    for req in running:
        spec = req.spec
        if spec is None or req.remaining != 1:
            continue
        room = min(spec.gamma, req.params.max_new_tokens - req.num_output - 1)
        if room < 1:
            continue
        try:
            draft = spec.session.propose(spec.committed(req.tokens), room, req.processor)
            req.draft = [int(t) for t in draft.tokens[:room].tolist()]
            probs = getattr(draft, "probs", None)
            req.draft_probs = probs[: len(req.draft)] if probs is not None and not req.params.greedy else None
        except Exception as exc:
            logger.warning("request %s: drafting failed (%r); decoding without drafts", req.request_id, exc)
            req.draft, req.draft_probs = [], None
            if spec.counts is not None:  # a prediction: no more drafts, its counts kept for the usage
                spec.gamma = 0
            else:
                req.spec = None
        if req.draft:
            drafting.append(req)
    return drafting


def accepted(draft: list[int], best: list[int], nan: list[int]) -> int:
    """How many leading drafts are kept: draft ``j`` is kept while it is the argmax ``best[j]`` of the row
    before it (a row holding NaN keeps nothing after it)."""
    n = 0
    while n < len(draft) and not nan[n] and best[n] == draft[n]:
        n += 1
    return n


def verdict(req: Request, logits: torch.Tensor, draft: list[int]) -> tuple[int, list[int], list[int]]:
    """How many of ``draft`` are kept given ``logits`` ``[k + 1, V]`` (row ``j``: after draft ``j``), each
    row's token to commit after the kept ones (its argmax, or for a sampled request its residual / bonus
    draw) and which rows hold NaN; one host read. Greedy requests by argmax, sampled ones by speculative
    sampling over their processed distribution (history-free: every row processed alike)."""
    nan_rows = torch.isnan(logits).any(dim=-1).long()
    if req.params.greedy:
        best, nan = torch.stack([torch.argmax(logits, dim=-1), nan_rows]).tolist()
        return accepted(draft, best, nan), best, nan
    probs = torch.softmax(process_logits(logits, [req] * logits.shape[0]), dim=-1)
    q = req.draft_probs
    fits = isinstance(q, torch.Tensor) and q.shape[0] >= len(draft) and q.shape[-1] == probs.shape[-1]
    # A draft whose logits overflowed (+inf in fp16) has NaN rows in q, whose verdict would commit token 0:
    # its drafts are verified as point masses then (exact for any draft token).
    fits = fits and bool(torch.isfinite(q[: len(draft)]).all())
    keep, draws = sampled_verdict(probs, draft, q[: len(draft)].to(probs) if fits else None)
    k = len(draft)
    read = torch.cat([keep.long(), draws, nan_rows]).tolist()
    flags, best, nan = read[:k], read[k : 2 * k + 1], read[2 * k + 1 :]
    return accepted(draft, [d if f else -1 for d, f in zip(draft, flags)], nan), best, nan


def merge_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs of one request's tokens committed in one step, as one output (a caller reads one per
    request per step: text and token ids concatenated, the last one's result or error)."""
    if len(outputs) <= 1:
        return outputs
    last = outputs[-1]
    return [
        RequestOutput(
            request_id=last.request_id,
            delta_text="".join(o.delta_text for o in outputs),
            token_ids=tuple(t for o in outputs for t in o.token_ids),
            logprobs=(),
            result=last.result,
            error=last.error,
        )
    ]


def sampled_verdict(
    probs: torch.Tensor, draft: list[int], q: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling, all rows at once on the device: ``probs`` ``[k + 1, V]`` is the processed
    distribution after each drafted position, ``q`` ``[k, V]`` the distributions a draft model sampled the
    drafts from (None: point masses, as prompt lookup's). Draft ``j`` is kept with probability
    ``min(1, p_j(d_j) / q_j(d_j))``; the token after the last kept one is drawn from the residual
    ``max(p_j - q_j, 0)``, renormalised (``p_j`` without ``d_j`` for a point mass), or from ``p_k`` when every
    draft was kept. Each committed token then follows ``p`` exactly (Leviathan et al. 2023; kvb-speculative's
    verifier, tested by chi-square there and in tests/test_step_speculation.py). With a draft model's
    ``q``, a draft model close to the target has its drafts kept (read as point masses, which they are not,
    a perfect draft model's sampled drafts were kept with probability ``p(d)`` only: 1-23% on a tiny model,
    an audit, 2026-11-30).

    Returns ``[k]`` bool (kept, per draft) and ``[k + 1]`` int64: for ``j < k`` the residual draw at row ``j``,
    for ``k`` the bonus draw. Random numbers come from torch's global generator (unseeded requests only)."""
    k = len(draft)
    ids = torch.tensor(draft, dtype=torch.long, device=probs.device)
    rows = torch.arange(k, device=probs.device)
    residual = probs.clone()
    if q is None:
        kept = torch.rand(k, device=probs.device) < probs[rows, ids]
        residual[rows, ids] = 0.0
    else:
        ratio = probs[rows, ids] / q[rows, ids].clamp_min(torch.finfo(probs.dtype).tiny)
        kept = torch.rand(k, device=probs.device) < ratio
        residual[:k] = (probs[:k] - q).clamp_min(0.0)
        # p == q up to rounding leaves no residual mass; rejection then had probability ~0, so p is exact.
        empty = residual.sum(dim=-1) <= 0
        residual[empty] = probs[empty]
    # Exponential race: argmax(p / Exp(1)) draws from p (unnormalised is fine), as torch.multinomial does.
    race = torch.empty_like(residual).exponential_(1)
    return kept, torch.argmax(residual / race, dim=-1)
