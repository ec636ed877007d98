"""Serving one generation request: admission, queueing, waiting (with timeout and disconnect checks).

The HTTP routes call :meth:`GenerationService.complete` for a full response, or
:meth:`GenerationService.open_stream` followed by :meth:`OpenStream.sse` for SSE.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import torch

from kvb_cache.errors import CacheBusyError, ContextLengthError, InvalidRequestError, PromptTypeError
from kvb_cache.results import GenerationResult
from kvb_server.config import ServerConfig
from kvb_server.echo import Echo, PromptScoring, prompt_only_result
from kvb_server.engine import ServingEngine
from kvb_server.errors import (
    CacheBusyConflictError,
    EngineError,
    InvalidParameterError,
    OutOfMemoryDuringRunError,
    RequestTimeoutError,
    RequestTooLargeError,
    ServerError,
)
from kvb_server.gate import AdmissionDecision, AdmissionRequest, RequestGate
from kvb_server.jobs import GenerationJob, Inbox, JobIds, JobUpdate
from kvb_server.metrics import ServerMetrics
from kvb_server.request_plan import GenerationPlan, choice_params
from kvb_server.responses import (
    ResponseIds,
    TokenBytesFn,
    assistant_message,
    chunk,
    final_response,
    running_usage,
    usage_chunk,
    utf8,
)
from kvb_server.stats import ThroughputMeter
from kvb_server.token_bytes import TokenBytes
from kvb_server.tool_calls import ToolCallStream
from kvb_server.worker import EngineWorker

logger = logging.getLogger(__name__)

#: How often a waiting handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.2

IsDisconnected = Callable[[], Awaitable[bool]]
#: Response header carrying how many prompt tokens auto-truncation dropped (summed over prompts).
TRUNCATION_HEADER = "X-KVBoost-Prompt-Tokens-Dropped"


class Truncation(NamedTuple):
    """What auto-truncation did to a request: each prompt's original length and what was kept."""

    original_tokens: tuple[int, ...]
    kept_tokens: tuple[int, ...]

    @property
    def dropped(self) -> int:
        return sum(o - k for o, k in zip(self.original_tokens, self.kept_tokens))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kept": "last_tokens",
            "original_prompt_tokens": list(self.original_tokens),
            "prompt_tokens": list(self.kept_tokens),
            "dropped_tokens": self.dropped,
        }

    def headers(self) -> dict[str, str]:
        return self.header_for(self.dropped)

    @staticmethod
    def header_for(dropped: int) -> dict[str, str]:
        return {TRUNCATION_HEADER: str(dropped)}


class Submitted(NamedTuple):
    """A request's queued jobs and where their updates arrive."""

    jobs: list[GenerationJob]
    inbox: Inbox
    deadline: float
    plan: GenerationPlan
    truncation: Truncation | None


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready; its jobs were cancelled."""


def engine_error(exc: BaseException) -> ServerError:
    """Map an exception raised by the engine to the HTTP error the client gets."""
    if isinstance(exc, ServerError):
        return exc
    if _is_out_of_memory(exc):
        logger.error("engine ran out of memory: %r", exc)
        return OutOfMemoryDuringRunError(exc)
    if isinstance(exc, CacheBusyError):
        return CacheBusyConflictError(f"The cache was not reset: {exc}.")
    if isinstance(exc, ContextLengthError):
        return InvalidParameterError(str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError | PromptTypeError):
        return InvalidParameterError(str(exc), param=_openai_param(exc.param))
    logger.error("engine failed: %r", exc, exc_info=exc)
    return EngineError(f"The engine failed while serving this request: {type(exc).__name__}: {exc}")


def _is_out_of_memory(exc: BaseException) -> bool:
    # CUDA raises its own type; the CPU allocator raises a RuntimeError naming itself.
    return isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    )


def _openai_param(param: str | None) -> str | None:
    return {"max_new_tokens": "max_tokens", "logprobs": "logprobs"}.get(param or "", param)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


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
        self._scoring = PromptScoring(worker, engine) if engine is not None else None
        #: Chat logprobs' ``bytes``: a token that splits a character has its own bytes, not U+FFFD's.
        self.token_bytes: TokenBytesFn = TokenBytes(engine.tokenizer) if engine is not None else utf8
        self._config = config
        self._throughput = throughput
        self._worker = worker
        self._metrics = metrics
        self._gate = gate
        self._ids = JobIds()

    def _admit(self, plan: GenerationPlan) -> AdmissionDecision:
        decision = self._gate.admit(
            AdmissionRequest(
                endpoint=plan.endpoint,
                model=plan.model,
                prompt_tokens=tuple(len(p) for p in plan.prompts),
                max_new_tokens=plan.sampling.max_new_tokens,
                n=plan.n,
                queue_depth=self._worker.depth,
                constrained=plan.sampling.response_format is not None,
            )
        )
        if not decision.admitted:
            raise RequestTooLargeError(
                decision.message, details=decision.details, param=decision.param, fields=decision.error_fields
            )
        return decision

    def _submit(self, plan: GenerationPlan) -> Submitted:
        decision = self._admit(plan)
        truncation = None
        keep = decision.keep_last_tokens
        if keep is not None and any(len(p) > keep for p in plan.prompts):
            # Auto-truncation keeps the *end* of each prompt: the latest messages and the generation prompt.
            kept = tuple(p[-keep:] for p in plan.prompts)
            truncation = Truncation(tuple(len(p) for p in plan.prompts), tuple(len(p) for p in kept))
            plan = dataclasses.replace(plan, prompts=kept)
            if plan.echo is not None and self._engine is not None:
                # What is echoed is what the model saw: the kept tokens.
                plan = dataclasses.replace(plan, echo=tuple(self._engine.tokenizer.decode(p) for p in kept))
        arrival = time.monotonic()
        deadline = arrival + self._config.request_timeout_s
        inbox = Inbox(asyncio.get_running_loop())
        jobs = [
            GenerationJob(
                id=self._ids.next(),
                prompt=prompt,
                sampling=choice_params(plan.sampling, i),
                stream=plan.stream,
                choice=p * plan.n + i,
                inbox=inbox,
                deadline=deadline,
                enqueued_at=arrival,
                settings=decision.settings,
                probe=decision.probe,
                cache_salt=plan.cache_salt,
            )
            for p, prompt in enumerate(plan.prompts)
            for i in range(plan.n)
            if plan.generate
        ]
        if jobs:
            self._worker.submit(jobs)  # type: ignore[arg-type]
        return Submitted(jobs, inbox, deadline, plan, truncation)

    async def _next(self, inbox: Inbox, deadline: float, is_disconnected: IsDisconnected | None) -> JobUpdate:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(self._config.request_timeout_s)
            try:
                return await inbox.get(min(remaining, DISCONNECT_POLL_S))
            except TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    raise ClientDisconnected() from None

    async def _echoes(self, plan: GenerationPlan, deadline: float) -> list[Echo] | None:
        """Each prompt's :class:`Echo`; with logprobs its tokens are scored on the engine thread, one slice
        per call between steps (:class:`PromptScoring`)."""
        if plan.echo is None:
            return None
        if self._engine is None or self._scoring is None:
            raise EngineError("echo needs the service to hold the engine (GenerationService(engine=...)).")
        engine, top = self._engine, plan.sampling.logprobs
        echoes = []
        for prompt, text in zip(plan.prompts, plan.echo):
            scored = None
            if top is not None:
                try:
                    scored = await self._scoring.score(prompt, top_logprobs=top, deadline=deadline)
                except Exception as exc:  # engine_error passes a ServerError (queue full, timeout) through
                    raise engine_error(exc) from None
            echoes.append(Echo(text=text, first_token=engine.token_text(prompt[0]), logprobs=scored))
        return echoes

    def _prompt_only(self, plan: GenerationPlan) -> list[GenerationResult]:
        """Results of a request that generates nothing (echo with ``max_tokens: 0``), one per choice."""
        logprobs = plan.sampling.logprobs is not None
        return [prompt_only_result(len(p), logprobs=logprobs) for p in plan.prompts for _ in range(plan.n)]

    def _record(self, update: JobUpdate, result: GenerationResult) -> None:
        self._metrics.observe_result(result, queue_s=update.queue_s)
        self._throughput.add(result.completion_tokens)

    async def complete(self, plan: GenerationPlan, is_disconnected: IsDisconnected) -> dict[str, Any]:
        """Serve a non-streamed request; raises :class:`ServerError` or :class:`ClientDisconnected`.

        An auto-truncated request's body carries ``prompt_truncation`` (see :class:`Truncation`).
        """
        jobs, inbox, deadline, plan, truncation = self._submit(plan)
        results: list[GenerationResult | None] = [None] * len(jobs)
        try:
            echoes = await self._echoes(plan, deadline)
            if not plan.generate:
                results = self._prompt_only(plan)  # type: ignore[assignment]
            for _ in jobs:
                update = await self._next(inbox, deadline, is_disconnected)
                if update.error is not None:
                    raise engine_error(update.error)
                assert update.result is not None
                results[update.choice] = update.result
                self._record(update, update.result)
        finally:
            for job in jobs:  # the worker aborts whatever is still queued or running (no-op once finished)
                job.cancelled.set()
        body = final_response(plan, ResponseIds.new(plan), results, echoes, self.token_bytes)  # type: ignore[arg-type]
        if truncation is not None:
            body["prompt_truncation"] = truncation.to_dict()
        return body

    async def open_stream(self, plan: GenerationPlan, is_disconnected: IsDisconnected) -> OpenStream:
        """Queue a streamed request and wait for its first update, so that errors and timeouts before the
        first token still get a proper HTTP status (once streaming starts the status is 200)."""
        jobs, inbox, deadline, plan, truncation = self._submit(plan)
        first = None
        try:
            echoes = await self._echoes(plan, deadline)
            if jobs:
                first = await self._next(inbox, deadline, is_disconnected)
                if first.error is not None:
                    raise engine_error(first.error)
        except BaseException:
            for job in jobs:
                job.cancelled.set()
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


class OpenStream:
    """A streamed request whose first update has arrived; :meth:`sse` yields its Server-Sent Events."""

    def __init__(
        self,
        *,
        service: GenerationService,
        plan: GenerationPlan,
        jobs: list[GenerationJob],
        inbox: Inbox,
        deadline: float,
        first: JobUpdate | None,
        truncation: Truncation | None = None,
        echoes: list[Echo] | None = None,
    ) -> None:
        #: Set when auto-truncation shortened the prompt (reported in a response header).
        self.truncation = truncation
        self._service = service
        self._plan = plan
        self._jobs = jobs
        self._inbox = inbox
        self._deadline = deadline
        self._first = first
        self._echoes = echoes

    async def sse(self) -> AsyncIterator[bytes]:
        """The stream as Server-Sent Events: each :meth:`chunks` payload, then ``data: [DONE]``."""
        async for payload in self.chunks():
            yield sse(payload)

    async def chunks(self) -> AsyncIterator[dict[str, Any] | str]:
        """The stream's payloads: chunk objects, an error object (last), and the ``"[DONE]"`` marker.

        Other API shapes (the Responses API) translate these instead of parsing SSE text.
        """
        plan, ids = self._plan, ResponseIds.new(self._plan)
        results: list[GenerationResult | None] = [None] * len(self._jobs)
        started: set[int] = set()
        offsets = [0] * len(self._jobs)
        generated = [0] * len(self._jobs)  # tokens streamed so far, per choice
        # Tool-calling replies stream as tool-call deltas (or as text once they turn out to be text).
        tool_streams = [ToolCallStream(plan.tools) for _ in self._jobs] if plan.tools is not None else None
        update: JobUpdate | None = self._first
        try:
            if self._echoes is not None:
                # The echoed prompt opens each choice (OpenAI's order); generated text continues from it.
                choices = len(plan.prompts) * plan.n
                for i in range(choices):
                    echo = self._echoes[i // plan.n]
                    yield chunk(plan, ids, index=i, echo=echo, usage=running_usage(plan, i, 0))
                    if echo.logprobs is not None:
                        offsets[i] = echo.logprob_arrays()[1]
                if not plan.generate:
                    prompt_only = self._service._prompt_only(plan)
                    for i in range(choices):
                        yield chunk(
                            plan, ids, index=i, finish_reason="length", usage=running_usage(plan, i, 0)
                        )
                    if plan.include_usage:
                        yield usage_chunk(plan, ids, prompt_only)
                    yield "[DONE]"
                    return
            while True:
                if update is None:
                    try:
                        # Disconnects cancel this generator (Starlette watches the connection): no polling.
                        update = await self._service._next(self._inbox, self._deadline, None)
                    except ServerError as exc:
                        yield exc.body()
                        return
                if update.error is not None:
                    error = engine_error(update.error)
                    yield error.body()
                    if isinstance(error, RequestTooLargeError):
                        # A memory refusal known only after the stream began: the final event, then [DONE].
                        yield "[DONE]"
                    return
                event, i = update.event, update.choice
                assert event is not None
                generated[i] += len(event.token_ids)
                # vLLM's continuous_usage_stats: every chunk of the choice carries its usage so far.
                counted = running_usage(plan, i, generated[i]) if plan.continuous_usage else None
                if tool_streams is not None:
                    deltas = tool_streams[i].deltas(
                        event.delta_text, final=event.result is not None, force=bool(event.logprobs)
                    )
                    for k, delta in enumerate(deltas):
                        yield chunk(
                            plan,
                            ids,
                            index=i,
                            delta=delta,
                            logprobs=None if k else event.logprobs,
                            token_bytes=self._service.token_bytes,
                            usage=counted,
                        )
                elif plan.chat_logprobs and i not in started:
                    started.add(i)
                    yield chunk(plan, ids, index=i, role=True, usage=counted)
                if tool_streams is None and (event.delta_text or event.logprobs):
                    yield chunk(
                        plan,
                        ids,
                        index=i,
                        text=event.delta_text,
                        logprobs=event.logprobs,
                        offset=offsets[i],
                        token_bytes=self._service.token_bytes,
                        usage=counted,
                    )
                    offsets[i] += len(event.delta_text)
                if event.result is not None:
                    results[i] = event.result
                    self._service._record(update, event.result)
                    finish = event.result.finish_reason
                    if plan.tools is not None:
                        # The same reading as the non-streamed message: whole calls finish "tool_calls".
                        _, finish = assistant_message(plan.tools, event.result.output_text, finish)
                    if counted is not None:  # the result's count is the exact one
                        counted = running_usage(plan, i, event.result.completion_tokens)
                    yield chunk(
                        plan,
                        ids,
                        index=i,
                        finish_reason=finish,
                        stop_reason=event.result.stop_reason,
                        usage=counted,
                    )
                    if all(r is not None for r in results):
                        break
                update = None
            if plan.include_usage:
                yield usage_chunk(plan, ids, results)  # type: ignore[arg-type]
            yield "[DONE]"
        finally:
            for job in self._jobs:
                job.cancelled.set()
