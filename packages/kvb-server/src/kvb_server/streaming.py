"""A streamed generation request as its Server-Sent Events: chunk objects, a final error object, ``[DONE]``.

:meth:`GenerationService.open_stream <kvb_server.service.GenerationService.open_stream>` queues the request
and waits for its first update; the :class:`OpenStream` it returns turns the updates into chunks (echoed
prompts first, tool-call deltas for tool-calling replies, usage when asked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from kvb_cache.results import GenerationResult
from kvb_server.echo import Echo
from kvb_server.engine_errors import engine_error, grammar_failure
from kvb_server.errors import ServerError
from kvb_server.jobs import GenerationJob, Inbox, JobUpdate
from kvb_server.reasoning import FIELDS as REASONING_FIELDS
from kvb_server.reasoning import ReasoningStream
from kvb_server.request_plan import GenerationPlan
from kvb_server.responses import (
    ResponseIds,
    assistant_message,
    chunk,
    cut_short,
    running_usage,
    usage_chunk,
)
from kvb_server.token_bytes import TextOffsets
from kvb_server.tool_calls import ToolCallStream
from kvb_server.truncation import Truncation

if TYPE_CHECKING:
    from kvb_server.service import GenerationService

logger = logging.getLogger(__name__)

#: A send may take this long past the request's deadline (its last event, the 504, still goes out).
_SEND_GRACE_S = 5.0
#: NOTE: ``asyncio.timeout`` (Python 3.11+) arms a timer on the running task: 6 us per send here, where
#: ``asyncio.wait_for`` wraps each send in a new task: 19 us, a real share of the event loop at thousands
#: of chunks per second. Python 3.10 keeps ``wait_for``.
_timeout = getattr(asyncio, "timeout", None)


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


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
        # Set once chunks() runs: from then on its own ``finally`` cancels the jobs and counts the rest.
        self._iterated = False

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` past which the request is stopped (``--request-timeout`` from its arrival)."""
        return self._deadline

    def release_unread(self) -> None:
        """Cancel the jobs of a stream whose :meth:`chunks` never ran and count their results when they
        come; a stream that ran did both in its ``finally``. Idempotent.

        A client that hangs up between the status line and the first body chunk makes Starlette cancel
        the response before it iterates the body: an async generator that never started has no
        ``finally`` to run, and the engine would generate the whole reply for nobody.
        """
        if self._iterated:
            return
        self._iterated = True
        for job in self._jobs:
            job.cancelled.set()
        self._service.record_unread(self._inbox, [None] * len(self._jobs), self._first)

    async def sse(self) -> AsyncIterator[bytes]:
        """The stream as Server-Sent Events: each :meth:`chunks` payload, then ``data: [DONE]``."""
        async for payload in self.chunks():
            yield sse(payload)

    async def chunks(self) -> AsyncIterator[dict[str, Any] | str]:
        """The stream's payloads: chunk objects, an error object (the last before the marker), and the ``"[DONE]"`` marker (always last).

        Other API shapes (the Responses API) translate these instead of parsing SSE text.
        """
        self._iterated = True
        plan, ids = self._plan, ResponseIds.new(self._plan)
        results: list[GenerationResult | None] = [None] * len(self._jobs)
        started: set[int] = set()
        # Each choice's completions text offsets, echoed prompt first, running on across its chunks.
        # (Echo with max_tokens 0 has choices but no jobs.)
        offsets = [TextOffsets(self._service.token_bytes) for _ in range(len(plan.prompts) * plan.n)]
        generated = [0] * len(self._jobs)  # tokens streamed so far, per choice
        # Per choice: when its last tokens left the engine, and the seconds between its tokens (metrics).
        last_at: list[float | None] = [None] * len(self._jobs)
        intervals: list[list[float]] = [[] for _ in self._jobs]
        # Tool-calling replies stream as tool-call deltas (or as text once they turn out to be text).
        tool_streams = [ToolCallStream(plan.tools) for _ in self._jobs] if plan.tools is not None else None
        # With --reasoning-parser, a reply's thinking streams as reasoning deltas, its answer as content.
        thinking = [ReasoningStream(plan.reasoning) for _ in self._jobs] if plan.reasoning else None
        show_thinking = plan.reasoning is not None and plan.reasoning.include
        update: JobUpdate | None = self._first
        try:
            if self._echoes is not None:
                # The echoed prompt opens each choice (OpenAI's order); generated text continues from it.
                choices = len(plan.prompts) * plan.n
                for i in range(choices):
                    echo = self._echoes[i // plan.n]
                    yield chunk(
                        plan, ids, index=i, echo=echo, offsets=offsets[i], usage=running_usage(plan, i, 0)
                    )
                if not plan.generate:
                    prompt_only = self._service.prompt_only(plan)
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
                        update = await self._service.next_update(self._inbox, self._deadline, None)
                    except ServerError as exc:  # --request-timeout, a shutdown
                        yield exc.body()
                        yield "[DONE]"
                        return
                if update.error is not None:
                    # An error known only after the stream began is its final event, then [DONE] (as vLLM
                    # ends every stream: clients waiting for the marker are not left hanging).
                    yield engine_error(update.error).body()
                    yield "[DONE]"
                    return
                event, i = update.event, update.choice
                assert event is not None
                generated[i] += len(event.token_ids)
                if event.token_ids:
                    if last_at[i] is not None:
                        # Tokens held back (a stop-string prefix) arrive together: split the wait evenly.
                        gap = (update.at - last_at[i]) / len(event.token_ids)
                        intervals[i].extend([gap] * len(event.token_ids))
                    last_at[i] = update.at
                # vLLM's continuous_usage_stats: every chunk of the choice carries its usage so far.
                counted = running_usage(plan, i, generated[i]) if plan.continuous_usage else None
                text, logprobs = event.delta_text, event.logprobs
                if tool_streams is None and plan.chat_logprobs and i not in started:
                    started.add(i)
                    # The role chunk comes before this event's tokens (vLLM counts 0 there).
                    before = generated[i] - len(event.token_ids)
                    opening = running_usage(plan, i, before) if plan.continuous_usage else None
                    yield chunk(plan, ids, index=i, role=True, usage=opening)
                if thinking is not None:
                    thought, text = thinking[i].feed(text, final=event.result is not None)
                    if thought and show_thinking:
                        yield chunk(
                            plan,
                            ids,
                            index=i,
                            delta=dict.fromkeys(REASONING_FIELDS, thought),
                            logprobs=logprobs,
                            token_bytes=self._service.token_bytes,
                            usage=counted,
                        )
                        logprobs = None  # sent with the reasoning piece
                if tool_streams is not None:
                    deltas = tool_streams[i].deltas(
                        text,
                        final=event.result is not None,
                        force=bool(logprobs),
                        truncated=event.result is not None
                        and cut_short(plan.tools, event.result.finish_reason),
                    )
                    for k, delta in enumerate(deltas):
                        yield chunk(
                            plan,
                            ids,
                            index=i,
                            delta=delta,
                            logprobs=None if k else logprobs,
                            token_bytes=self._service.token_bytes,
                            usage=counted,
                        )
                elif text or logprobs:
                    yield chunk(
                        plan,
                        ids,
                        index=i,
                        text=text,
                        logprobs=logprobs,
                        offsets=offsets[i],
                        token_bytes=self._service.token_bytes,
                        usage=counted,
                    )
                if event.result is not None:
                    results[i] = event.result
                    self._service.record(update, event.result, intervals[i])
                    failure = grammar_failure(
                        event.result, tools=plan.tools is not None, field=plan.format_field
                    )
                    if failure is not None:
                        # Its text is out already: the error replaces the finish chunk (no "stop" for an
                        # output that does not match), as any error after the first chunk ends a stream.
                        yield failure.body()
                        yield "[DONE]"
                        return
                    finish = event.result.finish_reason
                    if plan.tools is not None:
                        # The same reading as the non-streamed message: whole calls finish "tool_calls"
                        # ("stop" for a named tool_choice).
                        _, finish = assistant_message(
                            plan.tools, event.result.output_text, finish, plan.reasoning
                        )
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
            # NOTE: a stream that ends early (client gone) may leave choices the engine finishes anyway,
            # in hand, queued or still to come: they count as finished, as vLLM counts at the engine.
            self._service.record_unread(self._inbox, results, update, intervals)


class StalledReaderError(Exception):
    """The client stopped reading a stream: a send could not complete before the request's deadline.

    Not an ``OSError``: Starlette turns those into ``ClientDisconnect``, which the app's handlers answer."""


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` response over ``body`` (events of ``stream``) that releases ``stream`` however
    the response ends, including before Starlette iterated ``body`` (:meth:`OpenStream.release_unread`).

    Each send must complete before the request's deadline (``--request-timeout`` from its arrival). NOTE: a
    client that stops reading without closing its connection blocks the send once the socket's buffers are
    full; before, nothing bounded that wait, so the handler, the updates queued for it (the whole reply:
    ~190 MB for n=16 x 256 tokens with 20 logprobs, an audit, 2026-12-02) and the connection were held for
    as long as the client kept it open. Now the response ends at the deadline, its jobs cancelled (the
    engine already stops a request at its deadline) and its updates freed; uvicorn then closes the
    connection once its write buffer drains, so a client that never reads keeps only the socket and the
    bytes already in its buffers until it goes away.
    """

    def __init__(self, body: AsyncIterator[bytes], stream: OpenStream, headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = self._stream.deadline

        async def send_by_deadline(message: Message) -> None:
            delay = max(deadline - time.monotonic(), 0.0) + _SEND_GRACE_S
            try:
                if _timeout is not None:
                    async with _timeout(delay):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), delay)
            except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
                raise StalledReaderError() from None

        try:
            await super().__call__(scope, receive, send_by_deadline)
        except StalledReaderError:
            logger.warning(
                "stream closed: the client stopped reading it and the request's deadline passed "
                "(--request-timeout)"
            )
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:  # its finally cancels the jobs and counts what they produced
                await aclose()
        finally:
            self._stream.release_unread()
