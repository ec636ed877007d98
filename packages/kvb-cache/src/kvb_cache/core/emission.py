"""One sampled token into its request's output: logprobs, text delta, stop checks, the finished result."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvb_cache.core.outputs import RequestOutput
from kvb_cache.core.request import Request
from kvb_cache.core.scheduler import Scheduler
from kvb_cache.emitter import TokenTexts, token_logprob, token_logprobs
from kvb_cache.results import GenerationResult, TokenLogprob


class TokenEmission:
    """Turns each sampled token into its request's :class:`RequestOutput` (the engine step's last stage).

    Args:
        scheduler: a finished request is removed from it (its blocks freed) before its result is built.
        texts: the tokenizer's per-token texts (logprobs' alternatives).
        build_result: the finished request's :class:`GenerationResult`.
        before_free: reads a finished request's private KV before its blocks go back to the pool.
        after_prefill: called once a request's prompt is computed (its first token sampled).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        texts: TokenTexts,
        *,
        build_result: Callable[[Request], GenerationResult],
        before_free: Callable[[Request], None] | None,
        after_prefill: Callable[[Request], None] | None,
    ) -> None:
        self.scheduler = scheduler
        self.texts = texts
        self.build_result = build_result
        self.before_free = before_free
        self.after_prefill = after_prefill
        #: Requests whose token was part-way through :meth:`emit` when an interrupt escaped it.
        self.torn: list[Request] = []

    def logprobs(
        self, logits: torch.Tensor, requests: list[Request], tokens: list[int | Exception]
    ) -> dict[int, TokenLogprob]:
        """The sampled tokens' logprobs for the rows that asked for them, by row (``logits`` ``[R, V]``)."""
        rows = [
            i
            for i, (r, t) in enumerate(zip(requests, tokens))
            if r.params.logprobs is not None and not isinstance(t, Exception)
        ]
        if not rows:
            return {}
        try:
            found = token_logprobs(
                self.texts,
                logits[rows],
                [tokens[i] for i in rows],
                [requests[i].params.logprobs for i in rows],
            )
        except Exception:  # each row then redoes its own in emit(), where a failure ends that request only
            return {}
        return dict(zip(rows, found))

    def emit(
        self, req: Request, token: int, logits: torch.Tensor, logprob: TokenLogprob | None = None
    ) -> RequestOutput | None:
        """Append ``token`` (chosen from ``logits`` ``[V]``) to ``req`` and return the output it makes: its text
        delta, token ids and logprobs; the result when the token finished it (its blocks then freed). None when
        there is nothing to send yet (a partial UTF-8 character or a stop string being matched, no logprobs).

        A failure of the request's own (a callback, the grammar) propagates for the caller to end the request;
        an interrupt part-way leaves ``req`` in :attr:`torn`.
        """
        params = req.params
        if params.logprobs is not None:
            if logprob is None:
                logprob = token_logprob(self.texts, logits, token, params.logprobs)
            req.logprobs.append(logprob)
        if req.capture_logits:
            req.last_logits = logits
        req.tokens.append(token)
        try:
            produced = len(req.tokens) - req.prompt_len
            if produced == 1:
                req.ttft_ms = (time.perf_counter() - req.arrival) * 1e3
                if self.after_prefill is not None:
                    self.after_prefill(req)
            delta = req.emitter.push(token, produced)
            if req.grammar is not None and req.grammar.finished and not req.emitter.finish:
                delta += req.emitter.end("stop")  # the response_format is complete
            result = None
            if req.emitter.finish:
                if self.before_free is not None:
                    self.before_free(req)
                self.scheduler.remove(req)
                result = self.build_result(req)
            elif not delta and params.logprobs is None:
                return None
            logprobs: tuple[TokenLogprob, ...] = ()
            if params.logprobs is not None:
                covered = req.emitter.covered()
                logprobs = tuple(req.logprobs[req.logprobs_sent : covered])
                req.logprobs_sent = max(req.logprobs_sent, covered)
            token_ids = tuple(req.tokens[req.prompt_len + req.streamed :])
            req.streamed += len(token_ids)
            return RequestOutput(
                request_id=req.request_id,
                delta_text=delta,
                token_ids=token_ids,
                logprobs=logprobs,
                result=result,
            )
        except Exception:
            raise  # the request's own failure: the caller ends it (EngineCore._fail)
        except BaseException:
            self.torn.append(req)  # cut part-way by an interrupt: the engine's step ends it
            raise
