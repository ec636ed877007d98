"""Which requests run in the next step, and how many of their tokens.

Each step feeds the model at most ``max_num_batched_tokens`` tokens from at most ``max_num_seqs`` requests:

1. every running request that is decoding (one token each), oldest first, so streams never stall;
2. waiting requests, longest cached prefix first among the oldest ``ADMIT_WINDOW`` (their prefill is mostly
   a cache hit, so they reach their first token soonest), except that the oldest waiting request goes first
   once ``MAX_BYPASS`` later requests were admitted ahead of it (so its wait is bounded under a stream of
   cache hits), admitted while the token budget, the sequence cap and the pool allow; a request
   carrying prepared KV (a stitched prompt) adopts it into private blocks instead of a prefix lookup;
3. running requests still part-way through a long prompt, with what is left of the budget;
4. the tokens drafted for decoding requests that speculate (:mod:`kvb_cache.core.speculation`), oldest
   first, with the budget and the free blocks still left: drafts never preempt nor delay anyone.

Long prompts are prefilled in slices of at most the remaining budget (and the request's own
``prefill_chunk_size``), so a new arrival's first token never waits for another request's whole prompt.
When a running request needs a block and the pool has none, the newest other running request is
preempted: its blocks are released (full ones stay cached, so its resumption is mostly a prefix hit) and it
goes back to the front of the waiting queue; it keeps its generated tokens and recomputes their KV. A
request admitted in the same step is taken back first (it has not run yet): admitted before the running
prefills continue, two requests that fit the pool one at a time, not together, otherwise took turns
preempting themselves, each admission taking the block the other needed, and neither ever finished.

Under the ``priority`` policy (vLLM's ``--scheduling-policy priority``) the waiting queue is kept in
``(priority, arrival)`` order (a preempted request goes back to its place in it, not to the front), decodes
are fed in that order, and the running request preempted for want of blocks is the lowest-ranked one: the
largest ``(priority, arrival)``, which may be the request that needs the blocks itself.

A request's first admission is stamped (``Request.scheduled_at``, the end of its WAITING phase in the
vLLM metrics); a preempted request readmitted later keeps that first time, as vLLM v1 does.

With disk/Redis tiers, a waiting request whose prefix runs past the pool's blocks has those records read on
a loader thread (:mod:`kvb_cache.core.tier_loads`) and is skipped until they are in memory, as vLLM v1
skips requests waiting for remote KV: a slow tier holds up that request only, never the step.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from kvb_cache.core.kv_manager import KVCacheManager, PrefixHit
from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request, RequestStatus
from kvb_cache.core.tier_admission import TierAdmission
from kvb_cache.core.tier_loads import TierLoad, drop_load, loaded_records

#: Waiting requests (oldest first) among which each step admits the longest cached prefixes first.
ADMIT_WINDOW = 256
#: Admissions that may pass the oldest waiting request before it goes first. NOTE: without a bound, a
#: request with no cached prefix waited forever while cache-hitting arrivals kept the batch full (still
#: waiting after 500 steps and 250 later requests, in an audit).
MAX_BYPASS = 32


@dataclass(frozen=True, slots=True)
class Scheduled:
    """``request`` feeds ``tokens[num_computed : num_computed + num_tokens - drafted]`` this step, then the
    first ``drafted`` tokens of its ``draft`` (speculative tokens the step verifies)."""

    request: Request
    num_tokens: int
    drafted: int = 0

    @property
    def samples(self) -> bool:
        """Whether this slice reaches the end of the request's tokens (so a token is sampled after it)."""
        return self.request.num_computed + self.num_tokens - self.drafted == len(self.request.tokens)


@dataclass(frozen=True, slots=True)
class Admission:
    request: Request
    hit: PrefixHit


@dataclass(slots=True)
class _Admitted:
    """What admitting ``request`` this step did, to undo it (:meth:`Scheduler._take_back`)."""

    request: Request
    num_tokens: int
    counted: tuple[int, int]  # the prefix-cache queries and hits its lookup added
    scheduled_at: float | None  # its first-scheduling time before this step


@dataclass(frozen=True, slots=True)
class StepPlan:
    scheduled: tuple[Scheduled, ...]
    #: Requests admitted from waiting this step, with what their lookup reused (first admission only).
    admitted: tuple[Admission, ...]
    preempted: tuple[Request, ...]


class Scheduler:
    #: Waiting requests considered for admission each step (:data:`ADMIT_WINDOW`).
    admit_window = ADMIT_WINDOW

    def __init__(
        self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, priority: bool = False
    ) -> None:
        self.kv = kv
        #: The ``priority`` policy (else first come, first served).
        self.priority = priority
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        #: Which waiting requests' tier lookups run (disk/Redis records read off the loop thread).
        self.loads = TierAdmission(self)
        # Waiting and running requests by id: add_request checks every new id against them (a scan of both
        # queues, linear in a queue of thousands).
        self._by_id: dict[RequestId, Request] = {}

    def add(self, req: Request) -> None:
        # The last sampled token is never fed back, so its KV is never computed.
        needed = req.prompt_len + req.params.max_new_tokens - 1
        if not self.kv.can_fit(needed):
            # Callers check this (ContextLengthError); one that did not would loop forever, the request
            # preempting itself for want of blocks no one else holds. Fail loudly instead.
            raise ValueError(
                f"request {req.request_id} needs {needed} tokens of KV, "
                f"more than the pool's {self.kv.pool.num_blocks} blocks hold"
            )
        if self.priority:
            self._insert_ranked(req)
        else:
            self.waiting.append(req)
        self._by_id[req.request_id] = req

    def _insert_ranked(self, req: Request) -> None:
        """Put ``req`` into the waiting queue at its ``(priority, arrival)`` place (scanning from the back:
        most arrivals rank last)."""
        i = len(self.waiting)
        while i and self.waiting[i - 1].rank > req.rank:
            i -= 1
        self.waiting.insert(i, req)

    def _requeue(self, req: Request) -> None:
        """A preempted or taken-back request waits again: first in line under FCFS, at its rank otherwise."""
        if self.priority:
            self._insert_ranked(req)
        else:
            self.waiting.appendleft(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it and release its blocks (finish or abort)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        drop_load(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        if self._by_id.get(req.request_id) is req:
            del self._by_id[req.request_id]

    def schedule(self, *, reserved: int = 0) -> StepPlan:
        """Decide this step: one token for each decoding request, then prefill slices in the budget left.

        Args:
            reserved: tokens of this step's budget already spent outside the forward (the repair slices of
                stitched requests being prepared, :mod:`kvb_cache.core.preparing`): prefills get what is
                left, so a step's work stays about ``max_num_batched_tokens`` tokens; decodes are never held
                back by it (a running request's next token is what the budget protects).
        """
        budget = self.max_num_batched_tokens
        scheduled: list[Scheduled] = []
        preempted: list[Request] = []
        admitted: list[Admission] = []
        chosen: set[int] = set()
        fresh: list[_Admitted] = []  # admitted this step, oldest first

        def grow(req: Request, n: int) -> bool:
            """Blocks for ``n`` more tokens of running ``req``: take back this step's admissions (newest
            first), then preempt newer running requests, then ``req`` itself."""
            nonlocal budget
            while not self.kv.allocate(req, n):
                if fresh:
                    budget += self._take_back(fresh.pop(), scheduled, admitted, chosen)
                    continue
                victim = self._victim(req, chosen)
                if victim is None:
                    self._preempt(req)
                    preempted.append(req)
                    return False
                if id(victim) in chosen:  # priority: already scheduled this step; nothing has run yet
                    budget += sum(s.num_tokens for s in scheduled if s.request is victim)
                    scheduled[:] = [s for s in scheduled if s.request is not victim]
                    admitted[:] = [a for a in admitted if a.request is not victim]
                    chosen.discard(id(victim))
                self._preempt(victim)
                preempted.append(victim)
            return True

        decoding = [r for r in self.running if r.remaining == 1]
        if self.priority:
            decoding.sort(key=lambda r: r.rank)
        for req in decoding:
            if budget == 0:
                break
            if req.status is RequestStatus.RUNNING and grow(req, 1):
                scheduled.append(Scheduled(req, 1))
                chosen.add(id(req))
                budget -= 1

        budget = max(0, budget - reserved)
        if not preempted:
            self._admit(budget, scheduled, admitted, chosen, fresh)
            budget = max(0, self.max_num_batched_tokens - reserved - sum(s.num_tokens for s in scheduled))

        for req in [r for r in self.running if id(r) not in chosen and r.remaining > 1]:
            if budget == 0:
                break
            n = self._slice(req, budget)
            if req.status is RequestStatus.RUNNING and grow(req, n):
                scheduled.append(Scheduled(req, n))
                chosen.add(id(req))
                budget -= n
        self._add_drafts(scheduled, budget)
        return StepPlan(tuple(scheduled), tuple(admitted), tuple(preempted))

    def _add_drafts(self, scheduled: list[Scheduled], budget: int) -> None:
        """Extend the decoding slices in ``scheduled`` by their requests' drafts, oldest first, with the
        budget and the free blocks left once the step is otherwise planned (every decoding request's token,
        admissions, prefill slices): drafts never cost another request its token, its prefill or its blocks,
        and nothing is preempted for them. A draft that does not fit is cut (``Request.draft`` keeps what is
        fed)."""
        for i, s in enumerate(scheduled):
            req = s.request
            if not req.draft:
                continue
            # Cut to the room the free blocks leave (its token's slot is already taken).
            extra = max(0, min(len(req.draft), budget, self.kv.room(req) - 1))
            if extra and not self.kv.allocate(req, 1 + extra):
                extra = 0
            del req.draft[extra:]
            if extra:
                scheduled[i] = Scheduled(req, 1 + extra, extra)
                budget -= extra

    def _admit(
        self,
        budget: int,
        scheduled: list[Scheduled],
        admitted: list[Admission],
        chosen: set[int],
        fresh: list[_Admitted],
    ) -> None:
        if not self.waiting or budget == 0 or len(self.running) >= self.max_num_seqs:
            # Nothing can be admitted: skip ordering the queue (a lookup per block per request), but let the
            # next requests' tier records load meanwhile, so they are in memory when a place frees up.
            if self.waiting and self.kv.tiers is not None:
                self.loads.start_loads(list(itertools.islice(self.waiting, self.max_num_seqs)), grace_s=0.0)
            return
        # Longest cached prefix first; arrival order among equals (sorted() is stable). Among the oldest
        # ADMIT_WINDOW only: the key is a pool lookup per cached block, and ordering a queue of thousands
        # (generate_batch queues every prompt at once) cost more than the step it scheduled.
        window = itertools.islice(self.waiting, ADMIT_WINDOW)
        if self.priority:  # the window is in rank order; within a priority, cache hits first
            order = sorted(
                window, key=lambda r: (r.priority, -self.kv.cached_prefix_len(r, len(r.tokens) - 1))
            )
        else:
            order = sorted(window, key=lambda r: -self.kv.cached_prefix_len(r, len(r.tokens) - 1))
        head = self.waiting[0]
        if head.bypassed >= MAX_BYPASS:
            order.remove(head)
            order.insert(0, head)
        loading = self.loads.start_loads(order) if self.kv.tiers is not None else set()
        for req in order:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if id(req) in loading:
                continue  # its tier records are still being read (or wait their turn): the others go first
            if self.kv.tiers is not None and self.loads.reload(req):
                continue  # its pool prefix shrank since its lookup (evicted): read again, the others go first
            # A failed attempt is retried next step: only the lookup that admits counts as a query.
            counted = self.kv.queries, self.kv.hits
            if self._short_of_blocks(req, budget):
                break  # nothing fits now; retry next step (running requests free blocks)
            # With tiers, only what a lookup already read is promoted: the step never waits on a tier.
            loaded = loaded_records(self.kv.tiers, req.tier_load)
            if req.prepared_kv is not None:
                adopted = self.kv.adopt(req, req.prepared_kv, loaded=loaded)
                if adopted is None:
                    self.kv.queries, self.kv.hits = counted
                    break  # the pool is short; retry next step
                hit = adopted
            else:
                # Queried: every token, as vLLM counts (its hits stop one short, as ours: the last token is
                # always computed); counting one fewer put a fully cached prompt's hit rate at 100%.
                hit = self.kv.admit(
                    req,
                    max_tokens=len(req.tokens) - 1,
                    # A re-admission after a preemption is not counted again: vLLM keeps those in separate
                    # preempted_* stats, out of its prefix_cache_queries/hits (22% read for 0% served).
                    count=req.counted and not req.preemptions,
                    queried=len(req.tokens),
                    loaded=loaded,
                )
            n = self._slice(req, budget)
            if not self.kv.allocate(req, n):
                self.kv.free(req)  # nothing fits now; retry next step (running requests free blocks)
                self.kv.queries, self.kv.hits = counted
                break
            if req is not head:
                head.bypassed += 1
            req.tier_load = None  # promoted into the pool (its blocks stay cached if it is taken back)
            self.waiting.remove(req)
            if req.prepared_kv is None:  # an adopted (stitched) admission is not taken back: its KV is spent
                delta = (self.kv.queries - counted[0], self.kv.hits - counted[1])
                fresh.append(_Admitted(req, n, delta, req.scheduled_at))
            req.prepared_kv = None  # written into its blocks
            req.status = RequestStatus.RUNNING
            req.mark_scheduled()  # first admission only: a preempted request keeps its time
            self.running.append(req)
            if req.cached_tokens is None:
                admitted.append(Admission(req, hit))
            scheduled.append(Scheduled(req, n))
            chosen.add(id(req))
            budget -= n

    def loading(self) -> list[TierLoad]:
        """The tier lookups still in flight for waiting requests."""
        return self.loads.loading()

    def _take_back(
        self, entry: _Admitted, scheduled: list[Scheduled], admitted: list[Admission], chosen: set[int]
    ) -> int:
        """Undo this step's admission of ``entry.request``: it goes back to the front of the waiting queue
        as it was (not a preemption: it never ran); returns the budget its slice held."""
        req = entry.request
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.scheduled_at = entry.scheduled_at
        self._requeue(req)
        self.kv.queries -= entry.counted[0]
        self.kv.hits -= entry.counted[1]
        scheduled[:] = [s for s in scheduled if s.request is not req]
        admitted[:] = [a for a in admitted if a.request is not req]
        chosen.discard(id(req))
        return entry.num_tokens

    def _short_of_blocks(self, req: Request, budget: int) -> bool:
        """Whether the pool surely lacks the blocks admitting ``req`` this step would take (checked before
        any lookup changes the pool: see :meth:`KVCacheManager.blocks_to_admit`)."""
        if req.prepared_kv is not None:
            need = self.kv.blocks_to_admit(req, max_tokens=req.lookup_limit, upto=req.prepared_kv.length)
        else:
            cap = min(budget, req.prefill_chunk_size) if req.prefill_chunk_size else budget
            need = self.kv.blocks_to_admit(req, max_tokens=len(req.tokens) - 1, cap=cap)
        return need > self.kv.pool.num_free

    @staticmethod
    def _slice(req: Request, budget: int) -> int:
        n = min(req.remaining, budget)
        return min(n, req.prefill_chunk_size) if req.prefill_chunk_size else n

    def _victim(self, req: Request, chosen: set[int]) -> Request | None:
        """The running request to preempt so ``req`` can grow; None: ``req`` itself must go.

        FCFS: the newest other request not yet scheduled this step. Priority: the lowest-ranked other running
        request, even one scheduled this step already (its slice is taken back: nothing has run yet), unless
        ``req`` ranks lower still: vLLM preempts the lowest-priority request, whichever it is. (Only the
        unscheduled ones were considered, so a high-priority request still prefilling preempted itself while
        a low-priority one that decoded first in the step kept its blocks.)"""
        if not self.priority:
            return next((r for r in reversed(self.running) if r is not req and id(r) not in chosen), None)
        others = [r for r in self.running if r is not req]
        if not others:
            return None
        victim = max(others, key=lambda r: r.rank)
        return None if req.rank > victim.rank else victim

    def _preempt(self, req: Request) -> None:
        self._send_back(req)
        req.preemptions += 1
        self.preemptions += 1

    def _send_back(self, req: Request) -> None:
        """Running ``req`` waits again, to be recomputed exactly: its blocks are released (full ones stay
        cached, so its resumption is mostly a prefix hit)."""
        self.running.remove(req)
        self.kv.free(req)
        # NOTE: a stitched request resumes by recomputing everything after its exact prefix, exactly.
        req.exact_until = None
        req.copied = ()
        req.status = RequestStatus.WAITING
        self._requeue(req)

    def recover(self) -> int:
        """After an exception escaped a step part-way (a ``KeyboardInterrupt``, a signal handler's exception
        while the step ran): every running request whose last token's KV was computed but whose next token
        was never emitted (``remaining == 0``: no step would schedule it again, and its stream would wait
        forever) goes back to waiting, as a preempted request does, to be recomputed exactly; its full
        blocks stay cached. Drafts of the failed step are dropped. Returns how many went back."""
        stuck = 0
        for req in list(self.running):
            req.draft.clear()
            req.draft_probs = None
            if req.remaining <= 0:
                self._send_back(req)  # as a preemption, not counted as one
                stuck += 1
        return stuck

    def find(self, request_id: RequestId) -> Request | None:
        return self._by_id.get(request_id)
