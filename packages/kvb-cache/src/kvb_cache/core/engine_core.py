"""The engine loop: ``add`` / ``step`` / ``abort`` over the scheduler, the pool, the runner and the sampler.

One step = one scheduling decision, one packed model forward for every scheduled request, one sampled
token for every request whose slice reached the end of its tokens. A finished request releases its blocks
at once (full ones stay cached for the next request).

Requests that need a private ``transformers`` cache (speculative decoding, per-request quantized KV) run
as *solo* requests: an iterator of :class:`~kvb_cache.results.StreamEvent` advanced by one event per step,
beside the batched forward (see docs/server.md for what that means in a mixed batch). Stitched (non-prefix
reuse) requests are not solo: their assembled KV is written into their private blocks at admission
(:meth:`~kvb_cache.core.kv_manager.KVCacheManager.adopt`) and they decode in the batched forward.

Preparing a stitched prompt (its repair forward) is sliced so it never stalls the running requests for
long (:mod:`kvb_cache.core.preparing`): ``add_request`` plans it (lookup, re-positioning, recompute
positions) and runs at most one slice of the repair; a request with work left is *preparing* (not yet
queued). At the start of every step, before scheduling, the preparing requests (oldest first) run their
next slices of ascending recompute positions, in all at most ``max_num_batched_tokens`` positions per step
counting what ``add_request`` ran since the last step (each request at most its ``prefill_chunk_size``);
one whose repair is done adopts its KV and is queued, so it may be admitted in the same step. The
positions repaired come out of that step's prefill budget (``Scheduler.schedule(reserved=...)``), so a
step still does about ``max_num_batched_tokens`` tokens of work plus its decodes. Preparing
requests count as unfinished and running and can be aborted (they hold no pool blocks).

When no request is unfinished, a step computes the next prompt of the idle queue instead
(:mod:`kvb_cache.core.idle`: stitched prompts computed exactly, to store them); that internal request is
invisible to callers (no outputs, not unfinished, not running) and is taken out at the start of the first
step that has a request of theirs to run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from kvb_cache.core.deferred import Deferred, PlanRoom
from kvb_cache.core.emission import TokenEmission
from kvb_cache.core.idle import IdleKey, IdleSlot
from kvb_cache.core.kv_manager import KVCacheManager
from kvb_cache.core.outputs import RequestId, RequestOutput
from kvb_cache.core.preparing import PrepareWork, Preparing
from kvb_cache.core.request import Request, RequestStatus
from kvb_cache.core.runner import ModelRunner, SeqInput
from kvb_cache.core.sampler import sample
from kvb_cache.core.scheduler import Scheduled, Scheduler
from kvb_cache.core.solo import SoloRequests, SoloStart
from kvb_cache.core.speculation import merge_outputs, propose, verdict
from kvb_cache.core.tier_loads import IDLE_WAIT_S, TierLoad, wait_first
from kvb_cache.decoding import StepDrafter
from kvb_cache.emitter import TokenTexts
from kvb_cache.errors import InvalidRequestError, NonFiniteLogitsError, RequestInterruptedError
from kvb_cache.results import GenerationResult, StreamEvent

logger = logging.getLogger(__name__)

ResultHook = Callable[[Request], GenerationResult]
#: Called with a finished request while it still holds its blocks.
FinishHook = Callable[[Request], None]
#: Builds the internal loop request that computes an idle prompt.
IdleHook = Callable[[IdleKey], Request]


class EngineCore:
    """Single-threaded: every method is called from one thread (the caller's, or the server's worker)."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVCacheManager,
        runner: ModelRunner,
        texts: TokenTexts,
        *,
        build_result: ResultHook,
        before_free: FinishHook | None = None,
        after_prefill: FinishHook | None = None,
        plan_deferred: FinishHook | None = None,
        make_idle: IdleHook | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.runner = runner
        #: Each sampled token into its request's output (reads a finished request's private KV through
        #: ``before_free`` before its blocks go back to the pool; ``after_prefill`` once a prompt is computed).
        self.emission = TokenEmission(
            scheduler, texts, build_result=build_result, before_free=before_free, after_prefill=after_prefill
        )
        #: Plans and queues a deferred request once its sources' prompts are computed (see :meth:`defer`).
        self.plan_deferred = plan_deferred
        self.deferred = Deferred()
        #: Requests that run over a private cache, at most ``max_num_seqs`` at once (:mod:`kvb_cache.core.solo`).
        self.solos = SoloRequests(scheduler.max_num_seqs)
        #: Verifies speculating requests' drafts inside the batched step (None: none speculates there).
        self.drafter: StepDrafter | None = None
        self.preparing = Preparing(scheduler.max_num_batched_tokens)
        self.steps = 0
        #: Prompts to compute when no request is unfinished, and the one being computed.
        self.idle = IdleSlot(make_idle)
        # Aborts asked for while a step runs, applied when it ends (see abort()).
        self._stepping = False
        self._abort_after_step: dict[RequestId, None] = {}
        #: Outputs a step produced before an exception escaped it part-way: the next step returns them first
        #: (dropped, a stream missed a token, or a finished request's result never arrived).
        self._carried: list[RequestOutput] = []

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def add_preparing(self, req: Request, work: PrepareWork) -> None:
        """Queue ``req`` once ``work`` (its stitched prompt's repair) is done; one slice may run now."""
        if self.preparing.add(req, work):
            self.scheduler.add(req)

    def defer(self, req: Request, sources: tuple[Request, ...], load: TierLoad | None = None) -> None:
        """Hold ``req`` until the requests ``sources`` have computed their prompts (or ended) and ``load``
        (its prefix's tier records) is read; then ``plan_deferred`` plans and queues it (a stitched prompt
        that reuses their documents)."""
        self.deferred.add(req, sources, load)

    def plan_room(self) -> PlanRoom:
        """Room to plan stitched prompts now: those planned and not admitted (preparing, or waiting with their
        prepared KV) or held while their prefix's tier records are read (about to be planned, the records in
        memory) hold at most half the pool's tokens and ``max_num_seqs`` prompts, the bounds tier lookups
        have (:mod:`kvb_cache.core.deferred`)."""
        planned = [
            *self.preparing.requests(),
            *(r for r in self.scheduler.waiting if r.prepared_kv is not None),
            *self.deferred.with_loads(),
        ]
        pool = self.kv.pool
        return PlanRoom(
            tokens=pool.num_blocks * pool.block_size // 2 - sum(r.prompt_len for r in planned),
            count=self.scheduler.max_num_seqs - len(planned),
            planned=len(planned),
        )

    def pending_prompts(self) -> list[Request]:
        """Loop requests whose prompts are not computed yet (no token sampled), oldest first."""
        queued = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if not r.internal]
        return [
            *self.deferred.requests(),
            *self.preparing.requests(),
            *(r for r in queued if not r.num_output and r.status is not RequestStatus.FINISHED),
        ]

    @staticmethod
    def _prompt_pending(source: Request) -> bool:
        """Whether ``source`` (a request a deferred one waits for) is yet to compute its prompt: neither
        ended (finished or aborted: ``FINISHED``) nor past its first token."""
        return source.status is not RequestStatus.FINISHED and not source.num_output

    def add_solo(self, request_id: RequestId, start: SoloStart) -> None:
        """Run a solo request (:meth:`SoloRequests.add`)."""
        self.solos.add(request_id, start)

    @property
    def solo(self) -> dict[RequestId, Iterator[StreamEvent]]:
        """The running solo requests' events, by id."""
        return self.solos.running

    @property
    def solo_waiting(self) -> dict[RequestId, SoloStart]:
        """The solo requests waiting for a place, by id, oldest first."""
        return self.solos.waiting

    def knows(self, request_id: RequestId) -> bool:
        """Whether ``request_id`` is in use by an unfinished request."""
        return (
            request_id in self.solos
            or request_id in self.preparing
            or request_id in self.deferred
            or self.scheduler.find(request_id) is not None
        )

    def has_unfinished(self) -> bool:
        """Whether a caller's request is unfinished (the idle prompt being computed is not one)."""
        return (
            (bool(self._carried) and not self._stepping)  # a step returns them
            or bool(self.solos)
            or bool(self.preparing)
            or bool(self.deferred)
            or len(self.scheduler.waiting) + len(self.scheduler.running) > (self.idle.current is not None)
        )

    def has_idle_work(self) -> bool:
        """Whether a step with no request unfinished would compute an idle prompt."""
        return self.idle.has_work()

    def clear_idle(self) -> None:
        """Forget the idle work (a cache reset): the prompt part-way is taken out, the queue emptied."""
        self.idle.clear(self.scheduler)

    def abort(self, request_id: RequestId) -> bool:
        """End an unfinished request now (its blocks go back to the pool); False if none has this id.

        NOTE: called *during* a step (a stream dropped in a reference cycle, closed by the garbage collector
        while this thread runs the step's forward: the engine lock is re-entrant) the abort waits for the
        step's end: freed part-way, a scheduled request's blocks were gone when the step committed its KV
        (``IndexError``, failing every request of the batch), or it was sampled and emitted after its abort.
        """
        if self._stepping:
            req = self.scheduler.find(request_id)
            if not self.knows(request_id) or (req is not None and req.internal):
                return False
            self._abort_after_step[request_id] = None
            return True
        self._carried = [o for o in self._carried if o.request_id != request_id]
        if self.preparing.abort(request_id) or self.deferred.abort(request_id):
            return True
        if self.solos.abort(request_id):
            return True
        req = self.scheduler.find(request_id)
        if req is None or req.internal:
            return False
        self.scheduler.remove(req)
        return True

    def carry(self, outputs: Iterable[RequestOutput]) -> None:
        """Outputs a caller took from :meth:`step` but could not deliver (interrupted part-way): the next
        step returns them first."""
        self._carried[:0] = outputs

    def step(self) -> list[RequestOutput]:
        """One scheduling decision, one forward, one token for each request whose slice ended; returns the
        outputs of the callers' requests (none for a request aborted during the step).

        An exception that escapes part-way (``KeyboardInterrupt``; a per-request failure ends that request
        only and is its output) leaves the engine consistent: the outputs already produced come with the next
        step, and requests left between their forward and their token are recomputed (``Scheduler.recover``).
        """
        self._stepping = True
        # The step appends to the carried list itself: until it is handed over below, an exception anywhere
        # (the forward, an emission, this method's own bookkeeping) leaves what was produced for the next step.
        try:
            self._step(self._carried)
        except BaseException:
            self._end_torn()
            self.scheduler.recover()
            raise
        finally:
            self._stepping = False
            aborted, self._abort_after_step = self._abort_after_step, {}
            for request_id in aborted:
                self.abort(request_id)  # also drops its carried outputs
        outputs, self._carried = self._carried, []
        return outputs

    def _end_torn(self) -> None:
        """End the requests whose token was part-way through :meth:`TokenEmission.emit` when an exception escaped the
        step: appended but maybe not detokenized, or finished but not freed (a later step would have
        decoded past ``max_new_tokens``), so their stream cannot go on whole. They end with
        :class:`RequestInterruptedError` (the next step delivers it) instead of a torn text."""
        torn, self.emission.torn = self.emission.torn, []
        for req in torn:
            output = self._fail(req, RequestInterruptedError())
            if not req.internal:
                self._carried.append(output)

    def _plan_released(self, ready: list[Request], outputs: list[RequestOutput]) -> None:
        """Plan the deferred requests ``ready`` (taken out of the held set). One whose planning fails ends
        with that error as its output; an interrupt (``KeyboardInterrupt``) puts the ones not yet queued
        back, to be planned by the next step (before, they were in no queue: their streams never ended)."""
        assert self.plan_deferred is not None
        for i, req in enumerate(ready):
            try:
                self.plan_deferred(req)
            except Exception as exc:
                self._unqueue(
                    req
                )  # queued before it failed: out again (abort() would wait for the step's end
                outputs.append(self._fail_unqueued(req, exc))  # and then drop this output with the request's)
            except BaseException:
                # First again, in their order (appended, they lost their place behind newer held prompts).
                self.deferred.put_back([r for r in ready[i:] if not self.knows(r.request_id)])
                raise

    @torch.inference_mode()
    def _step(self, outputs: list[RequestOutput]) -> None:
        """The step itself; appends its outputs to ``outputs`` as they are produced (kept if it raises)."""
        if self.deferred and self.plan_deferred is not None:
            released = self.deferred.release(
                self._prompt_pending, self.plan_room(), by_rank=self.scheduler.priority
            )
            self._plan_released(released, outputs)
        for req in self.preparing.advance():
            self.scheduler.add(req)
        self.idle.schedule(self.scheduler, busy=self.has_unfinished())
        drafting = propose(self.scheduler.running)
        plan = self.scheduler.schedule(reserved=self.preparing.window_spent)
        for admission in plan.admitted:
            req = admission.request
            req.cached_tokens = admission.hit.tokens
            req.partial_tokens = admission.hit.partial
            req.exact_blocks = admission.hit.full_blocks
        if not plan.scheduled and not self.solo and not self.preparing:
            # Nothing to run but tier lookups in flight: wait for one (not a busy loop of empty steps).
            wait_first([*self.scheduler.loading(), *self.deferred.loading()], IDLE_WAIT_S)
        if plan.scheduled:
            seqs = [
                SeqInput(
                    token_ids=s.request.tokens[
                        s.request.num_computed : s.request.num_computed + s.num_tokens - s.drafted
                    ]
                    + s.request.draft[: s.drafted],
                    start=s.request.num_computed,
                    slots=self.kv.slots(s.request, s.request.num_computed + s.num_tokens),
                    sample=s.samples,
                    logits=1 + s.drafted,
                )
                for s in plan.scheduled
            ]
            logits = self.runner.forward(seqs)
            sampling: list[Request] = []
            verifying: list[tuple[Scheduled, int]] = []  # speculating requests and their first logits row
            rows: list[int] = []
            row = 0
            for s in plan.scheduled:
                if s.drafted:
                    verifying.append((s, row))
                elif s.samples:
                    sampling.append(s.request)
                    rows.append(row)
                row += (1 + s.drafted) if s.samples else 0
            if verifying:
                drafted_logits, logits = logits, logits[rows]
            for s in plan.scheduled:
                # A speculating request's drafts get their KV only once verified (_verify).
                s.request.num_computed += s.num_tokens - s.drafted
                self.kv.commit(s.request)
                if s.request.internal:
                    self.idle.tokens += s.num_tokens
            for s, first in verifying:
                self._verify(s.request, drafted_logits[first : first + 1 + s.drafted], outputs)
            tokens = sample(logits, sampling)
            logprobs = self.emission.logprobs(logits, sampling, tokens)
            for row, (req, token) in enumerate(zip(sampling, tokens)):
                try:
                    if isinstance(token, Exception):
                        raise token
                    output = self.emission.emit(req, token, logits[row], logprobs.get(row))
                except Exception as exc:  # ends this request only; the rest of the batch goes on
                    output = self._fail(req, exc)
                if req.spec is not None and req.spec.counts is None and self.drafter is not None:
                    self.drafter.record_round(0, 0)  # nothing drafted for it: a plain step
                if output is None:
                    continue
                if req.internal:
                    self.idle.finished(output)
                else:
                    outputs.append(output)
        for req in drafting:
            req.draft.clear()  # a draft is for one step (verified, or not scheduled)
            req.draft_probs = None
        self.solos.start_waiting(outputs)
        self.solos.advance(outputs)
        self.steps += 1

    def _verify(self, req: Request, logits: torch.Tensor, into: list[RequestOutput]) -> None:
        """Verify ``req``'s drafts against ``logits`` ``[k + 1, V]`` (row ``j``: after its ``j``-th draft):
        greedy by argmax (accept drafts while each is the argmax before it, then commit the argmax after the
        last accepted one: the correction, or a bonus token when all were accepted), sampled by speculative
        sampling (:func:`~kvb_cache.core.speculation.sampled_verdict`); each token goes through the emitter in
        turn (a stop may end the request part-way). The accepted drafts' KV, computed this step, is kept; the
        blocks taken only for rejected drafts go back to the pool. One output, appended to ``into`` (also when an
        exception escapes part-way), carries every committed token."""
        draft = req.draft[: logits.shape[0] - 1]
        kept, best, nan = verdict(req, logits, draft)
        assert req.spec is not None
        req.spec.session.rollback(kept)
        counts = req.spec.counts  # a prediction's (OpenAI's usage): what the reply holds
        if counts is not None:
            counts.rejected += len(draft) - kept
        outputs: list[RequestOutput] = []
        committed = 0
        try:
            if nan[kept]:  # argmax would read a NaN row's index as a token
                outputs.append(self._fail(req, NonFiniteLogitsError()))
            for j, token in enumerate([] if nan[kept] else [*draft[:kept], best[kept]]):
                if j:  # the previous token was an accepted draft: its KV (computed this step) is valid
                    req.num_computed += 1
                    self.kv.commit(req)
                if counts is not None and j < kept:
                    # Before emit(): the request's last token builds its result. A stop inside the kept run
                    # leaves the drafts after it uncounted (they are not in the reply).
                    counts.accepted += 1
                try:
                    output = self.emission.emit(req, token, logits[j])
                except Exception as exc:
                    outputs.append(self._fail(req, exc))
                    break
                committed += 1
                if output is not None:
                    outputs.append(output)
                if req.status is RequestStatus.FINISHED:
                    break
        finally:  # what was emitted reaches its stream even when an exception escapes part-way
            into.extend(merge_outputs(outputs))
        if counts is None and self.drafter is not None:
            # What was committed: a stop part-way leaves later drafts uncounted.
            self.drafter.record_round(len(draft), max(0, min(kept, committed - 1)))
        if req.status is not RequestStatus.FINISHED:
            self.kv.trim(req)

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End ``req`` because its token could not be chosen or emitted: its blocks are freed, nothing of it
        is stored, and its last output carries ``error``."""
        if isinstance(
            error, InvalidRequestError
        ):  # the request's own options (token bans): the client's error
            logger.info("request %s ended: %s", req.request_id, error)
        else:
            logger.error(
                "request %s failed in the sampler/emitter: %r", req.request_id, error, exc_info=error
            )
        if req.status is not RequestStatus.FINISHED:  # emit() may have finished it before failing
            self.scheduler.remove(req)
        if req.internal:
            self.idle.failed()
        return RequestOutput(request_id=req.request_id, delta_text="", error=error)

    def _unqueue(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it (none: nothing to do), its blocks released."""
        rid = req.request_id
        if not (self.preparing.abort(rid) or self.deferred.abort(rid)) and self.scheduler.find(rid) is req:
            self.scheduler.remove(req)

    @staticmethod
    def _fail_unqueued(req: Request, error: Exception) -> RequestOutput:
        """End ``req``, which no queue holds (its planning failed), with ``error`` as its last output."""
        logger.error("request %s failed while it was planned: %r", req.request_id, error, exc_info=error)
        req.status = RequestStatus.FINISHED
        return RequestOutput(request_id=req.request_id, delta_text="", error=error)

    @property
    def running(self) -> int:
        running = sum(not r.internal for r in self.scheduler.running)
        held = len(self.deferred) - self.deferred.awaiting_room  # held for room: waiting, not running
        return running + len(self.solo) + len(self.preparing) + held

    @property
    def waiting(self) -> int:
        """The callers' requests not running yet: queued for admission, stitched prompts held for planning
        room, solo requests waiting for a place."""
        queued = sum(not r.internal for r in self.scheduler.waiting)
        return queued + self.deferred.awaiting_room + len(self.solo_waiting)
