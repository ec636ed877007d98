"""The generation requests the worker handed to the engine, and where their outputs go.

:class:`InFlight` adds a :class:`~kvb_server.jobs.GenerationJob` to the engine (``add_request``; an error
there fails only that job), routes each engine output to its job's :class:`~kvb_server.jobs.Inbox`
(streamed jobs: every output; others: only the result), and aborts requests in the engine (client gone,
deadline passed, failed step, shutdown). It runs on the engine thread only, as the engine is not thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvb_cache.core.outputs import RequestId, RequestOutput
from kvb_cache.results import StreamEvent
from kvb_server.config import ServerConfig
from kvb_server.engine import ServingEngine
from kvb_server.errors import RequestTimeoutError
from kvb_server.jobs import GenerationJob, JobUpdate

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Flight:
    """A job the engine holds."""

    job: GenerationJob
    queue_s: float
    #: Still measurable: it entered an idle engine and no other request has joined since.
    solo: bool


class InFlight:
    """The requests the engine holds for the worker, by engine request id, with their counters.

    Attributes:
        added / finished / aborted / rejected / failed: requests handed to the engine / completed / dropped
            (client gone, deadline, failed step, shutdown) / refused by ``add_request`` / ended alone by the
            engine (their token could not be chosen or emitted; the step went on).
        largest_step: most requests that received output from one step.
    """

    def __init__(self, engine: ServingEngine, config: ServerConfig) -> None:
        self._engine = engine
        self._config = config
        self._flights: dict[RequestId, _Flight] = {}
        self.added = self.finished = self.aborted = self.rejected = self.failed = self.largest_step = 0

    def __len__(self) -> int:
        return len(self._flights)

    def add(self, job: GenerationJob) -> None:
        """Hand ``job`` to the engine; an expired one is answered (504) instead, a refused one gets the error."""
        if job.expired():
            self._answer_expired(job)
            return
        queue_s = time.monotonic() - job.enqueued_at
        solo = job.probe is not None and not self._flights
        if solo:
            _call_probe(job, "start")
        try:
            if job.warm:
                request_id = self._engine.add_warm_request(
                    job.prompt, cache_salt=job.cache_salt, prefill_chunk_size=job.settings.prefill_chunk_size
                )
            else:
                request_id = self._engine.add_request(
                    job.prompt,
                    job.sampling,
                    prefill_chunk_size=job.settings.prefill_chunk_size,
                    kv_cache_bits=job.settings.kv_cache_bits,
                    cache_salt=job.cache_salt,
                )
        except Exception as exc:  # invalid for the engine: only this job fails
            self.rejected += 1
            job.inbox.put_threadsafe(JobUpdate(choice=job.choice, error=exc, queue_s=queue_s))
            return
        for other in self._flights.values():
            other.solo = False  # it now shares steps with this one: its measurement would be mixed
        self._flights[request_id] = _Flight(job=job, queue_s=queue_s, solo=solo)
        self.added += 1

    def route_step(self, outputs: list[RequestOutput]) -> None:
        """Route the outputs of one ``engine.step()``."""
        self.largest_step = max(self.largest_step, len({o.request_id for o in outputs}))
        for output in outputs:
            self.route(output)

    def route(self, output: RequestOutput) -> None:
        """Deliver ``output`` to its job's inbox (ignored when the request is not ours)."""
        flight = self._flights.get(output.request_id)
        if flight is None:  # aborted earlier in this iteration, or not ours
            return
        job = flight.job
        if output.error is not None:  # the engine ended this request alone (its sampler row failed)
            del self._flights[output.request_id]
            self.failed += 1
            job.inbox.put_threadsafe(JobUpdate(choice=job.choice, error=output.error, queue_s=flight.queue_s))
            return
        if output.finished:
            del self._flights[output.request_id]
            self.finished += 1
            if flight.solo:
                _call_probe(job, "finish")
        if job.stream:
            event = StreamEvent(
                delta_text=output.delta_text,
                token_ids=output.token_ids,
                logprobs=output.logprobs,
                result=output.result,
            )
            job.inbox.put_threadsafe(JobUpdate(choice=job.choice, event=event, queue_s=flight.queue_s))
        elif output.finished:
            job.inbox.put_threadsafe(
                JobUpdate(choice=job.choice, result=output.result, queue_s=flight.queue_s)
            )

    def abort_expired(self) -> int:
        """Abort the requests whose client went away or whose deadline passed (a timed-out one gets 504).

        Returns how many were aborted."""
        aborted = 0
        for request_id, flight in list(self._flights.items()):
            if flight.job.expired():
                logger.info("job %d aborted: client gone or past its deadline", flight.job.id)
                self._abort(request_id)
                self._answer_expired(flight.job, flight.queue_s)
                aborted += 1
        return aborted

    def fail_all(self, error: BaseException) -> None:
        """Abort every request in flight and answer each with ``error``."""
        for request_id, flight in list(self._flights.items()):
            self._abort(request_id)
            flight.job.inbox.put_threadsafe(
                JobUpdate(choice=flight.job.choice, error=error, queue_s=flight.queue_s)
            )

    def abort_all(self) -> None:
        """Abort every request in flight without answering it (on shutdown: so that an engine shared with
        another server starts clean)."""
        for request_id in list(self._flights):
            self._abort(request_id)

    def _answer_expired(self, job: GenerationJob, queue_s: float = 0.0) -> None:
        # A cancelled job's handler is gone; a timed-out one may still be waiting for its 504.
        if job.timed_out():
            error = RequestTimeoutError(self._config.request_timeout_s)
            job.inbox.put_threadsafe(JobUpdate(choice=job.choice, error=error, queue_s=queue_s))

    def _abort(self, request_id: RequestId) -> None:
        del self._flights[request_id]
        self.aborted += 1
        try:
            self._engine.abort(request_id)
        except Exception:  # the request is gone for us either way; the engine may have dropped it already
            logger.warning("engine.abort(%s) failed", request_id, exc_info=True)


def _call_probe(job: GenerationJob, method: str) -> None:
    """Measurement must never fail a request: a probe error is logged and ignored."""
    if job.probe is None:
        return
    try:
        getattr(job.probe, method)()
    except Exception:
        logger.warning("run probe %s failed for job %d", method, job.id, exc_info=True)
