"""Serving one generation request: admission, queueing, waiting (with timeout and disconnect checks).

The HTTP routes call :meth:`GenerationService.complete` for a full response, or
:meth:`GenerationService.open_stream` followed by :meth:`~kvb_server.streaming.OpenStream.sse` for SSE.
Engine errors become HTTP errors through :func:`kvb_server.engine_errors.engine_error`; auto-truncation is
:mod:`kvb_server.truncation`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvb_cache.results import GenerationResult, TokenLogprob
from kvb_cache.sampling import SamplingParams
from kvb_server.config import ServerConfig
from kvb_server.echo import Echo, PromptScoring, prompt_only_result
from kvb_server.engine import ServingEngine
from kvb_server.engine_errors import engine_error, grammar_failure
from kvb_server.errors import EngineError, RequestTimeoutError, RequestTooLargeError
from kvb_server.gate import AdmissionDecision, AdmissionRequest, EngineSettings, RequestGate
from kvb_server.jobs import (
    DISCONNECT_POLL_S,
    ClientDisconnected,
    GenerationJob,
    Inbox,
    IsDisconnected,
    JobIds,
    JobUpdate,
)
from kvb_server.metrics import ServerMetrics
from kvb_server.request_log import log_request
from kvb_server.request_plan import GenerationPlan
from kvb_server.responses import ResponseIds, final_response
from kvb_server.stats import ThroughputMeter
from kvb_server.streaming import OpenStream
from kvb_server.token_bytes import TokenBytes, TokenBytesFn, utf8
from kvb_server.truncation import Truncation, keep_last_tokens
from kvb_server.worker import EngineWorker


class Submitted(NamedTuple):
    """A request's queued jobs and where their updates arrive."""

    jobs: list[GenerationJob]
    inbox: Inbox
    deadline: float
    plan: GenerationPlan
    truncation: Truncation | None


class GenerationService:
    """Turns plans into jobs on the worker and waits for their results."""

    def __init__(
        self,
        *,
        config: ServerConfig,
        worker: EngineWorker,
        metrics: ServerMetrics,
        gate: RequestGate,
        throughput: ThroughputMeter,
        engine: ServingEngine | None = None,
    ) -> None:
        #: Names echoed prompts' first tokens; ``_scoring`` scores them (on the engine thread).
        self._engine = engine
        self._scoring = (
            PromptScoring(worker, engine, timeout_s=config.request_timeout_s) if engine is not None else None
        )
        #: Chat logprobs' ``bytes``: a token that splits a character has its own bytes, not U+FFFD's.
        self.token_bytes: TokenBytesFn = TokenBytes(engine.tokenizer) if engine is not None else utf8
        self._config = config
        self._throughput = throughput
        self._worker = worker
        self._metrics = metrics
        self._gate = gate
        self._ids = JobIds()

    def _admit(self, plan: GenerationPlan) -> AdmissionDecision:
        return self._admit_request(
            AdmissionRequest(
                endpoint=plan.endpoint,
                model=plan.model,
                prompt_tokens=tuple(len(p) for p in plan.prompts),
                max_new_tokens=plan.sampling.max_new_tokens,
                n=plan.n,
                queue_depth=self._worker.depth,
                constrained=plan.sampling.response_format is not None,
                prompt_logprobs=(plan.echo is not None and plan.sampling.logprobs is not None)
                or plan.prompt_logprobs is not None,
            )
        )

    def _admit_request(self, request: AdmissionRequest) -> AdmissionDecision:
        decision = self._gate.admit(request)
        if not decision.admitted:
            raise RequestTooLargeError(
                decision.message, details=decision.details, param=decision.param, fields=decision.error_fields
            )
        return decision

    def _submit(self, plan: GenerationPlan) -> Submitted:
        decision = self._admit(plan)
        plan, truncation = keep_last_tokens(plan, decision.keep_last_tokens, self._engine)
        arrival = time.monotonic()
        deadline = arrival + self._config.request_timeout_s
        inbox = Inbox(asyncio.get_running_loop())
        jobs = [
            GenerationJob(
                id=self._ids.next(),
                prompt=prompt,
                sampling=plan.prompt_sampling(p, i),
                stream=plan.stream,
                choice=p * plan.n + i,
                inbox=inbox,
                deadline=deadline,
                enqueued_at=arrival,
                settings=decision.settings,
                probe=decision.probe,
                cache_salt=plan.cache_salt,
                priority=plan.priority,
            )
            for p, prompt in enumerate(plan.prompts)
            for i in range(plan.n)
            if plan.generate
        ]
        if self._config.log_requests:
            log_request(
                endpoint=plan.endpoint,
                model=plan.model,
                job_ids=[job.id for job in jobs],
                prompts=plan.prompts,
                n=plan.n,
                sampling=plan.sampling,
                tokenizer=None if self._engine is None else self._engine.tokenizer,
                max_len=self._config.max_log_len,
            )
        if jobs:
            self._worker.submit(jobs)  # type: ignore[arg-type]
        return Submitted(jobs, inbox, deadline, plan, truncation)

    async def next_update(
        self, inbox: Inbox, deadline: float, is_disconnected: IsDisconnected | None
    ) -> JobUpdate:
        """The next update of a request's jobs.

        Raises:
            RequestTimeoutError: ``deadline`` passed first.
            ClientDisconnected: ``is_disconnected`` (polled every :data:`DISCONNECT_POLL_S`) said so.
        """
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(self._config.request_timeout_s)
            try:
                return await inbox.get(min(remaining, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
                if is_disconnected is not None and await is_disconnected():
                    raise ClientDisconnected() from None

    async def warm(
        self, prompt: list[int], *, cache_salt: str | None, is_disconnected: IsDisconnected
    ) -> GenerationResult:
        """Compute and cache ``prompt`` (a ``/v1/warm`` text) as an engine request like any other: admitted
        by the gate, bounded by the queue, prefilled in slices between the other requests' steps, aborted
        when its client leaves or its deadline passes. (As one engine call it ran the whole prefill on the
        engine thread: every stream stalled for it, 16 s for a 3.3k-token text here, and it ran on after
        its client had gone.) Returns the engine's result (its ``cached_tokens``: those cached before)."""
        decision = self._admit_request(
            AdmissionRequest(
                endpoint="warm",
                model=self._config.model_names[0],
                prompt_tokens=(len(prompt),),
                max_new_tokens=1,
                n=1,
                queue_depth=self._worker.depth,
            )
        )
        deadline = time.monotonic() + self._config.request_timeout_s
        job = GenerationJob(
            id=self._ids.next(),
            prompt=prompt,
            sampling=SamplingParams(max_new_tokens=1),
            stream=False,
            choice=0,
            inbox=Inbox(asyncio.get_running_loop()),
            deadline=deadline,
            settings=EngineSettings(prefill_chunk_size=decision.settings.prefill_chunk_size),
            cache_salt=cache_salt,
            warm=True,
        )
        self._worker.submit([job])
        try:
            update = await self.next_update(job.inbox, deadline, is_disconnected)
        finally:
            job.cancelled.set()  # the worker aborts it if still queued or running (a no-op once finished)
        if update.error is not None:
            raise engine_error(update.error)
        assert update.result is not None
        return update.result

    async def _scores(
        self, plan: GenerationPlan, deadline: float, is_disconnected: IsDisconnected
    ) -> list[tuple[TokenLogprob, ...]] | None:
        """Each prompt's tokens after the first, scored on the engine thread one slice per call between steps
        (:class:`PromptScoring`) until the client goes away, with as many alternatives as echo's logprobs
        and vLLM's ``prompt_logprobs`` ask (one pass serves both); None when neither asks."""
        echo_top = plan.sampling.logprobs if plan.echo is not None else None
        asked = [k for k in (echo_top, plan.prompt_logprobs) if k is not None]
        if not asked:
            return None
        if self._scoring is None:
            raise EngineError("scoring needs the service to hold the engine (GenerationService(engine=...)).")
        scores = []
        for prompt in plan.prompts:
            try:
                scores.append(
                    await self._scoring.score(
                        prompt, top_logprobs=max(asked), deadline=deadline, is_disconnected=is_disconnected
                    )
                )
            except ClientDisconnected:
                raise
            except Exception as exc:  # engine_error passes a ServerError (queue full, timeout) through
                raise engine_error(exc) from None
        return scores

    def _echoes(
        self, plan: GenerationPlan, scores: list[tuple[TokenLogprob, ...]] | None
    ) -> list[Echo] | None:
        """Each prompt's :class:`Echo`, its tokens' logprobs (when asked) cut to echo's alternatives."""
        if plan.echo is None:
            return None
        if self._engine is None:
            raise EngineError("echo needs the service to hold the engine (GenerationService(engine=...)).")
        engine, top = self._engine, plan.sampling.logprobs
        special = frozenset(getattr(engine.tokenizer, "all_special_ids", ()) or ())
        echoes = []
        for p, (prompt, text) in enumerate(zip(plan.prompts, plan.echo)):
            scored = None
            if top is not None and scores is not None:
                scored = tuple(dataclasses.replace(e, top=e.top[:top]) for e in scores[p])
            echoes.append(
                Echo(
                    text=text,
                    first_token=engine.token_text(prompt[0]),
                    first_token_id=prompt[0],
                    logprobs=scored,
                    special_ids=special,
                )
            )
        return echoes

    def prompt_only(self, plan: GenerationPlan) -> list[GenerationResult]:
        """Results of a request that generates nothing (echo with ``max_tokens: 0``), one per choice,
        counted in the metrics."""
        logprobs = plan.sampling.logprobs is not None
        results = [prompt_only_result(len(p), logprobs=logprobs) for p in plan.prompts for _ in range(plan.n)]
        for result in results:
            self._metrics.observe_prompt_only(result)
        return results

    def record(
        self, update: JobUpdate, result: GenerationResult, token_intervals: Sequence[float] | None = None
    ) -> None:
        """Count a finished choice in the metrics and the throughput meter (``token_intervals``: a stream's
        seconds between consecutive tokens, see :meth:`ServerMetrics.observe_result`)."""
        self._metrics.observe_result(result, queue_s=update.queue_s, token_intervals=token_intervals)
        self._throughput.add(result.completion_tokens)

    def record_unread(
        self,
        inbox: Inbox,
        results: list[GenerationResult | None],
        in_hand: JobUpdate | None = None,
        token_intervals: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Count the choices a leaving handler did not record (``results[i]`` None) once their result
        comes: the update ``in_hand``, those queued and those the engine delivers later.

        The engine may finish a choice after its client left but before the worker aborts it (the worker
        counts it ``finished``); without this it was in neither ``vllm:request_success_total`` nor the
        token counters.
        """
        if all(r is not None for r in results):
            return
        pending = {i for i, r in enumerate(results) if r is None}

        def on_unread(update: JobUpdate) -> None:
            result = update.result if update.event is None else update.event.result
            if result is None or update.choice not in pending:
                return
            pending.discard(update.choice)
            intervals = token_intervals[update.choice] if token_intervals is not None else None
            self.record(update, result, intervals)

        if in_hand is not None:
            on_unread(in_hand)
        inbox.abandon(on_unread)

    async def complete(self, plan: GenerationPlan, is_disconnected: IsDisconnected) -> dict[str, Any]:
        """Serve a non-streamed request; raises :class:`ServerError` or :class:`ClientDisconnected`.

        An auto-truncated request's body carries ``prompt_truncation`` (see :class:`Truncation`).
        """
        jobs, inbox, deadline, plan, truncation = self._submit(plan)
        results: list[GenerationResult | None] = [None] * len(jobs)
        try:
            scores = await self._scores(plan, deadline, is_disconnected)
            echoes = self._echoes(plan, scores)
            if not plan.generate:
                results = self.prompt_only(plan)  # type: ignore[assignment]
            for _ in jobs:
                update = await self.next_update(inbox, deadline, is_disconnected)
                if update.error is not None:
                    raise engine_error(update.error)
                assert update.result is not None
                results[update.choice] = update.result
                self.record(update, update.result)
                failure = grammar_failure(
                    update.result, tools=plan.tools is not None, field=plan.format_field
                )
                if failure is not None:
                    raise failure
        finally:
            for job in jobs:  # the worker aborts whatever is still queued or running (no-op once finished)
                job.cancelled.set()
            self.record_unread(inbox, results)
        build = functools.partial(
            final_response, plan, ResponseIds.new(plan), results, echoes, self.token_bytes, scores
        )
        # NOTE: logprobs make bodies of tens of MB (64 echoed prompts of 2,000 tokens with 20 alternatives:
        # 80 MB), built on the event loop they held /health for seconds (an audit, 2026-12-02).
        body = await asyncio.to_thread(build) if plan.scored else build()  # type: ignore[arg-type]
        if truncation is not None:
            body["prompt_truncation"] = truncation.to_dict()
        return body

    async def open_stream(self, plan: GenerationPlan, is_disconnected: IsDisconnected) -> OpenStream:
        """Queue a streamed request and wait for its first update, so that errors and timeouts before the
        first token still get a proper HTTP status (once streaming starts the status is 200)."""
        jobs, inbox, deadline, plan, truncation = self._submit(plan)
        first = None
        try:
            echoes = self._echoes(plan, await self._scores(plan, deadline, is_disconnected))
            if jobs:
                first = await self.next_update(inbox, deadline, is_disconnected)
                if first.error is not None:
                    raise engine_error(first.error)
        except BaseException:
            for job in jobs:
                job.cancelled.set()
            self.record_unread(inbox, [None] * len(jobs), first)
            raise
        return OpenStream(
            service=self,
            plan=plan,
            jobs=jobs,
            inbox=inbox,
            deadline=deadline,
            first=first,
            truncation=truncation,
            echoes=echoes,
        )
