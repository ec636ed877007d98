"""Stitched requests held back until earlier requests' prompts are computed.

A request whose prompt repeats documents that an earlier, still-prefilling request is computing would find
nothing to stitch if planned at once (chunks enter the stitching store once a prompt is computed) and would
prefill those documents a second time beside it. Held here, it is planned once every request it waits for
has computed its prompt (or finished, or was aborted), and then stitches their chunks.

A stitched prompt whose exact prefix continues in a disk/Redis tier is also held here while those records
are read off the loop thread (``load``, :mod:`kvb_cache.core.tier_loads`): planning reads that prefix.
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


class Deferred:
    """The held requests, oldest first, each with the requests whose prompts it waits for.

    Sources are held as the request objects, not their ids: an ended request's id may be taken by a new
    request before the next step, and waiting on the id, a held request waited on the newcomer, which
    could be held behind it in turn (a deadlock: ``has_unfinished()`` stayed true forever).
    """

    def __init__(self) -> None:
        self._held: dict[RequestId, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def requests(self) -> Iterable[Request]:
        return (held.req for held in self._held.values())

    def add(self, req: Request, sources: tuple[Request, ...], load: TierLoad | None = None) -> None:
        self._held[req.request_id] = _Held(req, sources, load=load)

    def loading(self) -> list[TierLoad]:
        """The tier lookups still in flight for held requests."""
        return in_flight(h.load for h in self._held.values())

    def release(self, pending: Callable[[Request], bool]) -> list[Request]:
        """The held requests none of whose sources is ``pending`` any more and whose tier load (if any) is
        done, oldest first (removed here).

        A source that stopped pending never pends again (its prompt is computed or it ended), so each held
        request keeps a cursor past its done sources: a step costs O(held), not O(held x sources).
        """
        ready = []
        for held in self._held.values():
            while held.done < len(held.sources) and not pending(held.sources[held.done]):
                held.done += 1
            if held.done == len(held.sources) and (held.load is None or held.load.done):
                ready.append(held.req)
        for req in ready:
            del self._held[req.request_id]
        return ready

    def abort(self, request_id: RequestId) -> bool:
        entry = self._held.pop(request_id, None)
        if entry is None:
            return False
        drop_load(entry.req)
        entry.req.status = RequestStatus.FINISHED
        return True
