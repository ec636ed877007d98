"""Stitched requests held back until earlier requests' prompts are computed.

A request whose prompt repeats documents that an earlier, still-prefilling request is computing would find
nothing to stitch if planned at once (chunks enter the stitching store once a prompt is computed) and would
prefill those documents a second time beside it. Held here, it is planned once every request it waits for
has computed its prompt (or finished, or was aborted), and then stitches their chunks.

A stitched prompt whose exact prefix continues in a disk/Redis tier is also held here while those records
are read off the loop thread (``load``, :mod:`kvb_cache.core.tier_loads`): planning reads that prefix.

Planning assembles a prompt's whole KV outside the pool (the exact prefix and the re-positioned pieces, on
the model's device) until its repair is done and it is admitted, so how many prompts are planned at once is
bounded (:class:`PlanRoom`): a prompt beyond the bound is held here too, and released oldest first as room
frees. Before, a burst of stitched prompts was planned as it arrived: 60 prompts of 1,600 tokens on a small
model held 1.5 GB (25 MB each) beside the pool, a server's queue of 256 on a 7B model tens of GB, on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request, RequestStatus
from kvb_cache.core.tier_loads import TierLoad, drop_load, in_flight


@dataclass(slots=True)
class _Held:
    req: Request
    sources: tuple[Request, ...]
    #: How many leading ``sources`` are known to be done (they never pend again).
    done: int = 0
    #: Tier records being read for the request's planning (None: none); it is held until they are read.
    load: TierLoad | None = None
    #: Ready to be planned but for room (:class:`PlanRoom`): a waiting request, not a running one.
    for_room: bool = False


@dataclass(slots=True)
class PlanRoom:
    """How many more stitched prompts may be planned now: prompts planned and not admitted yet (preparing, or
    waiting with their prepared KV) hold at most ``tokens`` more prompt tokens and ``count`` more prompts. The
    first is always let in (a prompt longer than the bound is still served, alone)."""

    tokens: int
    count: int
    #: Prompts planned and not admitted yet.
    planned: int

    def take(self, req: Request) -> bool:
        """Whether ``req`` may be planned now; if so its room is taken."""
        if self.planned and (req.prompt_len > self.tokens or self.count <= 0):
            return False
        self.tokens -= req.prompt_len
        self.count -= 1
        self.planned += 1
        return True


class Deferred:
    """The held requests, oldest first, each with the requests whose prompts it waits for.

    Sources are held as the request objects, not their ids: an ended request's id may be taken by a new
    request before the next step, and waiting on the id, a held request waited on the newcomer, which
    could be held behind it in turn (a deadlock: ``has_unfinished()`` stayed true forever).
    """

    def __init__(self) -> None:
        self._held: dict[RequestId, _Held] = {}
        #: Held requests ready but for room (:class:`PlanRoom`): while any is, a new stitched prompt is held
        #: with them (planned in queue order, none starved). They are waiting requests, not running ones.
        self.awaiting_room = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def requests(self) -> Iterable[Request]:
        return (held.req for held in self._held.values())

    def add(self, req: Request, sources: tuple[Request, ...], load: TierLoad | None = None) -> None:
        self._held[req.request_id] = _Held(req, sources, load=load)

    def with_loads(self) -> list[Request]:
        """The held requests whose tier lookup has started (their prefix's records read or being read)."""
        return [h.req for h in self._held.values() if h.load is not None]

    def loading(self) -> list[TierLoad]:
        """The tier lookups still in flight for held requests."""
        return in_flight(h.load for h in self._held.values())

    def put_back(self, reqs: list[Request]) -> None:
        """Hold ``reqs`` again, first, in their order: released by a step that an interrupt cut before it
        planned them. One without a tier load waits for room again (it was released for room it took)."""
        back = {r.request_id: _Held(r, (), load=r.tier_load, for_room=r.tier_load is None) for r in reqs}
        self.awaiting_room += sum(held.for_room for held in back.values())
        self._held = {**back, **self._held}

    def hold_for_room(self, req: Request) -> None:
        """Hold ``req``, ready to be planned, until :meth:`release` finds room for it."""
        self._held[req.request_id] = _Held(req, (), for_room=True)
        self.awaiting_room += 1

    def release(
        self, pending: Callable[[Request], bool], room: PlanRoom, *, by_rank: bool = False
    ) -> list[Request]:
        """The held requests none of whose sources is ``pending`` any more and whose tier load (if any) is
        done, as many as ``room`` lets be planned (removed here): oldest first, or with ``by_rank`` (the
        priority policy) in ``(priority, arrival)`` order; the first ready one that does not fit stops the
        release (none is passed over).

        A source that stopped pending never pends again (its prompt is computed or it ended), so each held
        request keeps a cursor past its done sources: a step costs O(held), not O(held x sources).
        """
        candidates = []
        for held in self._held.values():
            while held.done < len(held.sources) and not pending(held.sources[held.done]):
                held.done += 1
            if held.done == len(held.sources) and (held.load is None or held.load.done):
                candidates.append(held)
        if by_rank:
            candidates.sort(key=lambda held: held.req.rank)
        ready = []
        blocked = False
        for held in candidates:
            # One whose prefix was read already holds its room (counted in PlanRoom.planned while it read).
            if held.load is None and (blocked or not room.take(held.req)):
                blocked = True  # none planned past the first that does not fit
                self._mark_for_room(held)
                continue
            ready.append(held.req)
            self._forget(held)
        return ready

    def _mark_for_room(self, held: _Held) -> None:
        if not held.for_room:
            held.for_room = True
            self.awaiting_room += 1

    def _forget(self, held: _Held) -> None:
        del self._held[held.req.request_id]
        if held.for_room:
            self.awaiting_room -= 1

    def abort(self, request_id: RequestId) -> bool:
        entry = self._held.get(request_id)
        if entry is None:
            return False
        self._forget(entry)
        drop_load(entry.req)
        entry.req.status = RequestStatus.FINISHED
        return True
