"""Stitched requests held back until earlier requests' prompts are computed.

A request whose prompt repeats documents that an earlier, still-prefilling request is computing would find
nothing to stitch if planned at once (chunks enter the stitching store once a prompt is computed) and would
prefill those documents a second time beside it. Held here, it is planned once every request it waits for
has computed its prompt (or finished, or was aborted), and then stitches their chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request, RequestStatus


class Deferred:
    """The held requests, oldest first, each with the requests whose prompts it waits for.

    Sources are held as the request objects, not their ids: an ended request's id may be taken by a new
    request before the next step, and waiting on the id, a held request waited on the newcomer, which
    could be held behind it in turn (a deadlock: ``has_unfinished()`` stayed true forever).
    """

    def __init__(self) -> None:
        self._held: dict[RequestId, tuple[Request, tuple[Request, ...]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def requests(self) -> Iterable[Request]:
        return (req for req, _ in self._held.values())

    def add(self, req: Request, sources: tuple[Request, ...]) -> None:
        self._held[req.request_id] = (req, sources)

    def release(self, pending: Callable[[Request], bool]) -> list[Request]:
        """The held requests none of whose sources is ``pending`` any more, oldest first (removed here)."""
        ready = [req for req, sources in self._held.values() if not any(pending(s) for s in sources)]
        for req in ready:
            del self._held[req.request_id]
        return ready

    def abort(self, request_id: RequestId) -> bool:
        entry = self._held.pop(request_id, None)
        if entry is None:
            return False
        entry[0].status = RequestStatus.FINISHED
        return True
