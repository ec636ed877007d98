"""Requests whose KV is still being prepared outside the pool (a stitched prompt's repair forward).

A stitched request is planned when it is added (pieces found, KV re-positioned, recompute positions
chosen); its repair then runs in ascending slices of positions (see :mod:`kvb_cache.repair.recompute`).
The repair work is bounded per *window*, the time from one :meth:`Preparing.advance` (called at the start
of each ``step()``) to the next: ``add`` requests spend from it first (a small repair finishes at once, so
the request is queued from ``add_request`` as before), then ``advance`` spends what is left on the
preparing requests oldest first. So however many stitched requests arrive, decoding requests wait for at
most ``budget`` repaired positions (the scheduler's ``max_num_batched_tokens``) per step; each request's
share is also capped by its ``prefill_chunk_size``. A request whose work is done adopts its prepared KV
(:func:`adopt_stitched`) and is handed back to be queued.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import PreparedKV, Request, RequestStatus
from kvb_cache.kv_sharing import own_kv_layers
from kvb_cache.repair.recompute import RepairWork

if TYPE_CHECKING:
    from kvb_cache.prepared import PreparedPrompt


class PrepareWork(RepairWork, Protocol):
    """Sliced repair that fills ``prepared`` when done (a :class:`~kvb_cache.stitch_job.StitchJob`)."""

    prepared: PreparedPrompt


def adopt_stitched(req: Request, prepared: PreparedPrompt) -> None:
    """Hand a stitched prompt's assembled KV to its loop request: written into the request's private blocks
    at admission, it then prefills the rest and decodes in the batched step like any other request. Only
    ``ids[:exact_until]`` may ever be registered under prefix hashes (the store rule)."""
    layers = tuple((layer.keys, layer.values) for layer in own_kv_layers(prepared.cache))
    req.prepared_kv = PreparedKV(layers=layers, length=prepared.cached_tokens)
    req.exact_until = prepared.exact_until
    req.copied = prepared.copied
    req.idle_refine = prepared.under_held
    req.cached_tokens = prepared.served_tokens
    req.chunk_hits = prepared.chunks
    req.recomputed_tokens = prepared.recomputed_tokens


class Preparing:
    """The preparing requests, in arrival order, and the repair budget left in this window."""

    def __init__(self, budget: int) -> None:
        #: Positions of work per window (the scheduler's ``max_num_batched_tokens``).
        self.budget = budget
        self.spent = 0
        #: Positions of work the last closed window ran (the scheduler reserves them from its step budget).
        self.window_spent = 0
        # dicts keep insertion order: oldest first.
        self._jobs: dict[RequestId, tuple[Request, PrepareWork]] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._jobs

    def requests(self) -> list[Request]:
        return [req for req, _ in self._jobs.values()]

    def find(self, request_id: RequestId) -> Request | None:
        entry = self._jobs.get(request_id)
        return None if entry is None else entry[0]

    def add(self, req: Request, work: PrepareWork) -> bool:
        """Run what this window allows of ``req``'s work; True when it is done (``req`` adopted its KV and
        should be queued), False when it waits here for later steps."""
        if self._run(req, work):
            return True
        self._jobs[req.request_id] = (req, work)
        return False

    def advance(self) -> list[Request]:
        """Spend the rest of this window on the preparing requests, oldest first, and open a new window.

        Returns:
            The requests whose work finished, their prepared KV adopted, oldest first: queue them.
        """
        ready: list[Request] = []
        for request_id, (req, work) in list(self._jobs.items()):
            if self.spent >= self.budget:
                break
            if self._run(req, work):
                del self._jobs[request_id]
                ready.append(req)
        self.window_spent, self.spent = self.spent, 0
        return ready

    def abort(self, request_id: RequestId) -> bool:
        """Drop a preparing request: it holds no pool blocks, only its assembled KV (freed with it)."""
        entry = self._jobs.pop(request_id, None)
        if entry is None:
            return False
        entry[0].status = RequestStatus.FINISHED
        return True

    def _slice(self, req: Request) -> int:
        left = max(0, self.budget - self.spent)
        return min(left, req.prefill_chunk_size) if req.prefill_chunk_size else left

    def _run(self, req: Request, work: PrepareWork) -> bool:
        """One slice of ``req``'s work; True (and ``req`` adopted) once all of it has run."""
        # A zero budget still lets work with no positions left finish (its result is handed over).
        size = self._slice(req)
        if size:
            # Its repair is this request's first compute: the end of its WAITING phase (Request.queued_ms),
            # as preparing requests count as running in the engine's gauges.
            req.mark_scheduled()
        self.spent += work.run(size)
        if not work.done:
            return False
        adopt_stitched(req, work.prepared)
        return True
