"""Choose the next token of every sampling row at once, each row with its own parameters.

The processing semantics are transformers' logits processors, applied per row with per-row
values (transformers' warpers take one value for the whole batch, which is why they are not used here;
``tests/test_core_loop.py`` checks every row against them): OpenAI ``logit_bias``, vLLM's
``allowed_token_ids`` and ``bad_words`` (:mod:`kvb_cache.token_bans`), the grammar mask of
rows with a ``response_format`` (disallowed tokens ``-inf``, before any filter so top-k/top-p choose among
allowed tokens), end-of-sequence banned while a row has fewer than its ``min_tokens`` (transformers'
``MinNewTokensLengthLogitsProcessor``), repetition penalty (over prompt and output), OpenAI presence/frequency penalties (over the
output), temperature, then min-p before top-k and top-p (vLLM's order; transformers applies min-p last,
which keeps tokens vLLM drops). Greedy rows take the argmax; sampled rows draw from the softmax with the
request's own seeded generator, so a row's token does not depend on which other rows share the step.
Constrained rows then advance their matcher with the chosen token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvb_cache.core.penalties import PenaltyHistory
from kvb_cache.core.request import Request
from kvb_cache.errors import NonFiniteLogitsError
from kvb_cache.structured.mask import apply_bitmask, bitmask_words
from kvb_cache.token_bans import check_choosable


def process_logits(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """``logits`` ``[R, V]`` raw -> ``[R, V]`` float32 processed (filtered tokens ``-inf``); ``logits`` is
    left as it was. Its only effect on ``requests`` is bringing their penalty statistics up to date with
    their tokens (:mod:`kvb_cache.core.penalties`), so running it again gives the same scores."""
    # A copy even for fp32 logits (where .float() is the same tensor): the rows are edited in place below,
    # and the caller still reads the raw rows afterwards (logprobs, captured logits).
    scores = logits.to(torch.float32, copy=True)
    vocab = scores.shape[-1]
    device = scores.device
    rows = range(len(requests))
    for i, req in zip(rows, requests):
        bias_ids = req.processor.bias_ids
        if bias_ids is not None:
            scores[i].index_add_(0, bias_ids, req.processor.bias_values.to(scores.dtype))
    _mask_grammar_rows(scores, requests)
    for i, req in zip(rows, requests):
        p = req.params
        bans = req.processor.bans
        if bans is not None:
            bans.apply_(scores[i], req.tokens, req.prompt_len)
        if _holds_eos(req):
            # An end-of-sequence id past the logits (a generation config or tokenizer naming a token the
            # model cannot produce) needs no ban; indexing it would fail the whole step.
            scores[i, [t for t in sorted(req.emitter.stop_tokens) if t < vocab]] = -float("inf")
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            if req.penalty_history is None:
                req.penalty_history = PenaltyHistory()
            history = req.penalty_history
        if p.repetition_penalty != 1.0:
            seen = history.seen_ids(req.tokens, vocab, device)  # [U]
            picked = scores[i].gather(0, seen)
            picked = torch.where(picked < 0, picked * p.repetition_penalty, picked / p.repetition_penalty)
            scores[i].scatter_(0, seen, picked)
        if (p.presence_penalty or p.frequency_penalty) and req.num_output:
            counts = history.output_counts(req.tokens, req.prompt_len, vocab, device)  # [V]
            scores[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if bans is not None:
            check_choosable(scores[i], p, holds_eos=_holds_eos(req), constrained=req.grammar is not None)
    sampled = [i for i, r in zip(rows, requests) if not r.params.greedy]
    if not sampled:
        return scores
    idx = torch.tensor(sampled, device=device)
    sub = scores[idx]
    params = [requests[i].params for i in sampled]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=sub.dtype)
    sub = sub / temps.unsqueeze(1)
    # Which filters run is read from the requests' own numbers: a .any() of the device tensors would be a
    # host sync each on CUDA (the results agree: a value the float32 copy rounds to off filters nothing);
    # each filter's per-row tensor is uploaded only when it runs.
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=sub.dtype)
        # transformers' MinPLogitsWarper: drop tokens whose probability is below min_p x the top one's
        # (the top token always stays). Before top-k / top-p, as vLLM's sampler applies it (transformers'
        # order puts it after top-p: top-p then cut the nucleus of the unfiltered distribution, and a model
        # whose generation config sets top_p, asked for min_p, sampled tokens vLLM never picks).
        probs = sub.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        sub = sub.masked_fill(probs < threshold, -float("inf"))
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        k = top_k.clamp(min=1, max=vocab)
        # The k-th largest value from topk over the largest k asked, not a full sort of the vocabulary: the
        # sort was 58% of processing a top-k/top-p step on CPU (profiled, [32, 49152]); same values, so the
        # same tokens (tested), 0.55x the step.
        largest = max(min(max(p.top_k, 1), vocab) for p in params)
        kth = torch.topk(sub, largest, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        sub = torch.where((top_k > 0).unsqueeze(1) & (sub < kth), torch.full_like(sub, -float("inf")), sub)
    if any(p.top_p < 1 for p in params):
        # transformers' TopPLogitsWarper: drop the ascending-sorted tokens whose cumulative mass <= 1 - top_p,
        # always keeping the most likely one.
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=sub.dtype)
        ordered, order = torch.sort(sub, dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        drop &= (top_p < 1).unsqueeze(1)
        sub = sub.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    scores[idx] = sub
    return scores


def _holds_eos(req: Request) -> bool:
    """True while ``min_tokens`` still bans this request's end-of-sequence and stop tokens."""
    # min_tokens first: this runs for every row of every step, and it is 0 for most requests (and
    # num_output, not len(output_ids), which copied every generated token each time).
    min_tokens = req.params.min_tokens
    return bool(min_tokens) and req.num_output < min_tokens and bool(req.emitter.stop_tokens)


def _mask_grammar_rows(scores: torch.Tensor, requests: Sequence[Request]) -> None:
    """``-inf`` for the tokens each constrained row's grammar does not allow next (``scores`` ``[R, V]``)."""
    constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not constrained:
        return
    bitmask = torch.empty(len(constrained), bitmask_words(scores.shape[-1]), dtype=torch.int32)  # [M, W]
    for j, i in enumerate(constrained):
        requests[i].grammar.fill_bitmask(bitmask[j])
    apply_bitmask(scores, torch.tensor(constrained, device=scores.device), bitmask)


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int | Exception]:
    """One token per row of ``logits`` ``[R, V]`` for ``requests`` (same order); constrained rows' matchers
    consume their token.

    A row whose token cannot be chosen (its processing, draw or matcher raised) gets the exception in its
    place; the other rows are unaffected (each row's draw uses its own generator, and a batched processing
    failure is redone row by row: running :func:`process_logits` again gives the same scores).
    """
    # NOTE: a constrained greedy row is not an identity row: the fast path would skip its mask.
    greedy_fast = all(r.processor.is_identity and r.grammar is None and not _holds_eos(r) for r in requests)
    if greedy_fast:
        # A NaN's index would be read as a token: such rows are flagged, read with the tokens. torch.max
        # propagates NaN into a row's value (CPU and CUDA; tested) and returns the first maximal index as
        # argmax does, so one pass gives both. Measured on CPU, [64, 49152] fp32 logits (SmolLM2's vocabulary),
        # one thread: argmax 17-21 ms and isnan().any() 9-19 ms (two passes) against max 5-12 ms.
        values, picked = torch.max(logits, dim=-1)  # [R], [R]
        tokens, nan = torch.stack([picked, torch.isnan(values).long()]).tolist()  # one host sync
        return _flag_nan(tokens, nan)
    # argmax would pick a NaN's index as if it were a token: such rows are flagged, read with the tokens.
    nan_rows = torch.isnan(logits).any(dim=-1)  # [R]
    rows, best, nan = _processed_rows(logits, requests, nan_rows)
    tokens: list[int | Exception | None] = []
    draws: dict[int, torch.Tensor] = {}  # sampled row -> its [2] (token, valid) on the device
    for i, (scores, req) in enumerate(zip(rows, requests)):
        if isinstance(scores, Exception):
            tokens.append(scores)
        elif not req.params.greedy:
            tokens.append(None)
            try:
                draws[i] = _draw(scores, req.processor.generator)
            except Exception as exc:  # this row's failure ends this request only (the caller reports it)
                tokens[i] = exc
        else:
            try:
                tokens.append(best[i] if best is not None else int(torch.argmax(scores)))
            except Exception as exc:
                tokens.append(exc)
    if draws:  # every sampled row's token in one host read
        for i, (token, valid) in zip(draws, torch.stack(list(draws.values())).tolist(), strict=True):
            tokens[i] = token if valid else RuntimeError(_INVALID_DRAW)
    for i, req in enumerate(requests):
        token = tokens[i]
        if req.grammar is not None and isinstance(token, int):
            try:
                req.grammar.advance(token)
            except Exception as exc:
                tokens[i] = exc
    return _flag_nan(tokens, nan)


#: What ``torch.multinomial`` raises for the probabilities :func:`_draw` flags as invalid.
_INVALID_DRAW = "probability tensor contains either `inf`, `nan` or element < 0, or sums to 0"


def _draw(scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``[2]`` on ``scores``' device: a token drawn from ``softmax(scores)`` and whether the probabilities were
    valid (finite, >= 0, not all 0).

    ``torch.multinomial(probs, 1)`` draws exactly so (ATen's one-sample path: ``argmax(probs / q)`` with ``q ~
    Exp(1)`` from the same generator, hence the same token; tested), but first reads two validity checks
    back to the host, and its caller a third for the token: three syncs per sampled row per step on CUDA.
    Here the checks travel with the token, and the sampler reads every row's at once."""
    probs = torch.softmax(scores, dim=-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    token = torch.argmax(torch.div(probs, race, out=race), dim=-1)  # in place, as ATen's own path
    valid = (probs.max() < float("inf")) & (probs.min() >= 0) & (probs.sum() != 0)
    return torch.stack([token, valid.long()])


def _flag_nan(tokens: list, nan: list) -> list[int | Exception]:
    """``tokens`` with each row whose logits hold NaN replaced by a :class:`NonFiniteLogitsError`."""
    if not any(nan):
        return tokens
    return [NonFiniteLogitsError() if bad else token for token, bad in zip(tokens, nan)]


def _processed_rows(
    logits: torch.Tensor, requests: Sequence[Request], nan_rows: torch.Tensor
) -> tuple[list[torch.Tensor | Exception], list[int] | None, list[int]]:
    """:func:`process_logits` of every row (``[V]`` each), every row's argmax when batched, and ``nan_rows``
    ``[R]`` as a list (read in the argmax's host sync).

    Batched normally; row by row when the batch raised (``process_logits`` can run again), so that one
    row's failure, its exception in its place, leaves the other rows' scores as the batch gives them."""
    try:
        scores = process_logits(logits, requests)
    except Exception:
        rows: list[torch.Tensor | Exception] = []
        for i, req in enumerate(requests):
            try:
                rows.append(process_logits(logits[i : i + 1], [req])[0])
            except Exception as exc:
                rows.append(exc)
        return rows, None, nan_rows.tolist()
    best, nan = torch.stack([torch.argmax(scores, dim=-1), nan_rows.long()]).tolist()
    return list(scores.unbind(0)), best, nan
