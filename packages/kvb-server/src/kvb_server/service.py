"""Serving one generation request: admission, queueing, waiting (with timeout and disconnect checks).

The HTTP routes call :meth:`GenerationService.complete` for a full response, or
:meth:`GenerationService.open_stream` followed by :meth:`OpenStream.sse` for SSE.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvb_cache.errors import ContextLengthError, InvalidRequestError, PromptTypeError
from kvb_cache.results import GenerationResult
from kvb_server.config import ServerConfig
from kvb_server.errors import (
    EngineError,
    InvalidParameterError,
    RequestTimeoutError,
    RequestTooLargeError,
    ServerError,
)
from kvb_server.gate import AdmissionRequest, RequestGate
from kvb_server.jobs import GenerationJob, Inbox, JobIds, JobUpdate
from kvb_server.metrics import ServerMetrics
from kvb_server.request_plan import GenerationPlan
from kvb_server.responses import ResponseIds, chunk, final_response, usage_chunk
from kvb_server.stats import ThroughputMeter
from kvb_server.worker import EngineWorker

logger = logging.getLogger(__name__)

#: How often a waiting handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.2

IsDisconnected = Callable[[], Awaitable[bool]]


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready; its jobs were cancelled."""


def engine_error(exc: BaseException) -> ServerError:
    """Map an exception raised by the engine to the HTTP error the client gets."""
    if isinstance(exc, ServerError):
        return exc
    if isinstance(exc, ContextLengthError):
        return InvalidParameterError(str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError | PromptTypeError):
        return InvalidParameterError(str(exc), param=_openai_param(exc.param))
    logger.error("engine failed: %r", exc, exc_info=exc)
    return EngineError(f"The engine failed while serving this request: {type(exc).__name__}: {exc}")


def _openai_param(param: str | None) -> str | None:
    return {"max_new_tokens": "max_tokens", "logprobs": "logprobs"}.get(param or "", param)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class GenerationService:
    """Turns plans into jobs on the worker and waits for their results."""

    def __init__(self, *, config: ServerConfig, worker: EngineWorker, metrics: ServerMetrics,
                 gate: RequestGate, throughput: ThroughputMeter) -> None:
        self._config = config
        self._throughput = throughput
        self._worker = worker
        self._metrics = metrics
        self._gate = gate
        self._ids = JobIds()

    def _admit(self, plan: GenerationPlan) -> None:
        decision = self._gate.admit(AdmissionRequest(
            endpoint=plan.endpoint, model=plan.model, prompt_tokens=tuple(len(p) for p in plan.prompts),
            max_new_tokens=plan.sampling.max_new_tokens, n=plan.n, queue_depth=self._worker.depth,
        ))
        if not decision.admitted:
            raise RequestTooLargeError(decision.message, details=decision.details)

    def _submit(self, plan: GenerationPlan) -> tuple[list[GenerationJob], Inbox, float]:
        self._admit(plan)
        arrival = time.monotonic()
        deadline = arrival + self._config.request_timeout_s
        inbox = Inbox(asyncio.get_running_loop())
        jobs = [
            GenerationJob(id=self._ids.next(), prompt=prompt, sampling=plan.sampling.for_choice(i),
                          stream=plan.stream, choice=p * plan.n + i, inbox=inbox, deadline=deadline,
                          enqueued_at=arrival)
            for p, prompt in enumerate(plan.prompts)
            for i in range(plan.n)
        ]
        self._worker.submit(jobs)  # type: ignore[arg-type]
        return jobs, inbox, deadline

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

    def _record(self, update: JobUpdate, result: GenerationResult) -> None:
        self._metrics.observe_result(result, queue_s=update.queue_s)
        self._throughput.add(result.completion_tokens)

    async def complete(self, plan: GenerationPlan, is_disconnected: IsDisconnected) -> dict[str, Any]:
        """Serve a non-streamed request; raises :class:`ServerError` or :class:`ClientDisconnected`."""
        jobs, inbox, deadline = self._submit(plan)
        results: list[GenerationResult | None] = [None] * len(jobs)
        try:
            for _ in jobs:
                update = await self._next(inbox, deadline, is_disconnected)
                if update.error is not None:
                    raise engine_error(update.error)
                assert update.result is not None
                results[update.choice] = update.result
                self._record(update, update.result)
        finally:
            for job in jobs:  # stops whatever is still queued or running (no-op for finished jobs)
                job.cancelled.set()
        return final_response(plan, ResponseIds.new(plan), results)  # type: ignore[arg-type]

    async def open_stream(self, plan: GenerationPlan, is_disconnected: IsDisconnected) -> OpenStream:
        """Queue a streamed request and wait for its first update, so that errors and timeouts before the
        first token still get a proper HTTP status (once streaming starts the status is 200)."""
        jobs, inbox, deadline = self._submit(plan)
        try:
            first = await self._next(inbox, deadline, is_disconnected)
            if first.error is not None:
                raise engine_error(first.error)
        except BaseException:
            for job in jobs:
                job.cancelled.set()
            raise
        return OpenStream(service=self, plan=plan, jobs=jobs, inbox=inbox, deadline=deadline, first=first)


class OpenStream:
    """A streamed request whose first update has arrived; :meth:`sse` yields its Server-Sent Events."""

    def __init__(self, *, service: GenerationService, plan: GenerationPlan, jobs: list[GenerationJob],
                 inbox: Inbox, deadline: float, first: JobUpdate) -> None:
        self._service = service
        self._plan = plan
        self._jobs = jobs
        self._inbox = inbox
        self._deadline = deadline
        self._first = first

    async def sse(self) -> AsyncIterator[bytes]:
        plan, ids = self._plan, ResponseIds.new(self._plan)
        results: list[GenerationResult | None] = [None] * len(self._jobs)
        started: set[int] = set()
        offsets = [0] * len(self._jobs)
        update: JobUpdate | None = self._first
        try:
            while True:
                if update is None:
                    try:
                        # Disconnects cancel this generator (Starlette watches the connection): no polling.
                        update = await self._service._next(self._inbox, self._deadline, None)
                    except ServerError as exc:
                        yield sse(exc.body())
                        return
                if update.error is not None:
                    yield sse(engine_error(update.error).body())
                    return
                event, i = update.event, update.choice
                assert event is not None
                if plan.chat_logprobs and i not in started:
                    started.add(i)
                    yield sse(chunk(plan, ids, index=i, role=True))
                if event.delta_text or event.logprobs:
                    yield sse(chunk(plan, ids, index=i, text=event.delta_text, logprobs=event.logprobs,
                                    offset=offsets[i]))
                    offsets[i] += len(event.delta_text)
                if event.result is not None:
                    results[i] = event.result
                    self._service._record(update, event.result)
                    yield sse(chunk(plan, ids, index=i, finish_reason=event.result.finish_reason))
                    if all(r is not None for r in results):
                        break
                update = None
            if plan.include_usage:
                yield sse(usage_chunk(plan, ids, results))  # type: ignore[arg-type]
            yield sse("[DONE]")
        finally:
            for job in self._jobs:
                job.cancelled.set()
