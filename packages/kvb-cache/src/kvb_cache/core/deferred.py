"""Stitched requests held back until earlier requests' prompts are computed.

A request whose prompt repeats documents that an earlier, still-prefilling request is computing would find
nothing to stitch if planned at once (chunks enter the stitching store once a prompt is computed) and would
prefill those documents a second time beside it. Held here, it is planned once every request it waits for
has computed its prompt (or finished, or was aborted), and then stitches their chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request, RequestStatus


@dataclass(slots=True)
class _Held:
    req: Request
    sources: tuple[Request, ...]
    #: How many leading ``sources`` are known to be done (they never pend again).
    done: int = 0


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

    def add(self, req: Request, sources: tuple[Request, ...]) -> None:
        self._held[req.request_id] = _Held(req, sources)

    def release(self, pending: Callable[[Request], bool]) -> list[Request]:
        """The held requests none of whose sources is ``pending`` any more, oldest first (removed here).

        A source that stopped pending never pends again (its prompt is computed or it ended), so each held
        request keeps a cursor past its done sources: a step costs O(held), not O(held x sources).
        """
        ready = []
        for held in self._held.values():
            while held.done < len(held.sources) and not pending(held.sources[held.done]):
                held.done += 1
            if held.done == len(held.sources):
                ready.append(held.req)
        for req in ready:
            del self._held[req.request_id]
        return ready

    def abort(self, request_id: RequestId) -> bool:
        entry = self._held.pop(request_id, None)
        if entry is None:
            return False
        entry.req.status = RequestStatus.FINISHED
        return True
