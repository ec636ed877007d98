"""Work the engine does only while it has no request to serve: stitched prompts computed exactly.

A stitched prompt is served from copies of its documents' KV computed after other histories. Computing that
prompt again, exactly, once the engine has nothing else to do stores its chunks under its own prefix keys:
the same prompt asked again is then an exact prefix hit, and each of its documents has one more independent
copy, computed after this prompt's history, for later stitched prompts to average
(``StitchConfig.average_copies``; two copies halved the KL on long documents, docs/fidelity.md). That is
what ``StitchConfig.collect_copies`` buys by computing a document on its second sighting, without making that
request pay for it (``StitchConfig.idle_copies``).

The queue holds prompts (token ids and chain root), not requests: :class:`IdleSlot`, which the engine loop
(:class:`~kvb_cache.core.engine_core.EngineCore`) asks at the start of every step, turns the first one into
an internal loop request when no other request is unfinished, and takes it out again as soon as one arrives. Its full blocks stay cached in the pool, so when it comes back
its prefix lookup finds the part it had computed; what it loses is at most the partial last block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvb_cache.hashing import ChunkHash

if TYPE_CHECKING:  # the scheduler and requests import nothing from here; only annotations need them
    from kvb_cache.core.outputs import RequestOutput
    from kvb_cache.core.request import Request
    from kvb_cache.core.scheduler import Scheduler

#: Prompts waiting for idle time at most; past it the oldest is forgotten (a busy engine never gets to them,
#: and a prompt asked again is queued again).
MAX_IDLE_PROMPTS = 64
#: Tokens an idle prompt computes per step: a request arriving at an idle engine waits for the step in
#: progress, so this bounds what idle work adds to its TTFT (SmolLM2-135M on one CPU thread: ~3 ms a
#: prompt token, so ~0.2 s; a GPU's step is overhead-bound at this size).
IDLE_SLICE_TOKENS = 64

IdleKey = tuple[ChunkHash | None, tuple[int, ...]]


class IdleQueue:
    """Prompts to compute when idle, oldest first, each at most once."""

    def __init__(self, max_prompts: int = MAX_IDLE_PROMPTS) -> None:
        self.max_prompts = max_prompts
        self._queue: OrderedDict[IdleKey, None] = OrderedDict()
        #: Prompts forgotten because the queue was full.
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, ids: Sequence[int], root: ChunkHash | None) -> bool:
        """Queue ``ids`` (under chain ``root``; None: the engine's); False when it is already queued."""
        key = (root, tuple(ids))
        if key in self._queue:
            return False
        self._queue[key] = None
        while len(self._queue) > self.max_prompts:
            self._queue.popitem(last=False)
            self.dropped += 1
        return True

    def pop(self) -> IdleKey:
        """The oldest queued prompt, removed (raises KeyError when empty)."""
        return self._queue.popitem(last=False)[0]

    def push_front(self, key: IdleKey) -> None:
        """Put back a prompt taken out part-way (a request arrived): it runs first when idle again."""
        self._queue[key] = None
        self._queue.move_to_end(key, last=False)

    def clear(self) -> None:
        self._queue.clear()


class IdleSlot:
    """The idle queue and the one idle prompt being computed, as the engine loop runs them.

    :meth:`schedule` is called at the start of every step: it takes the prompt part-way out when a caller's
    request is unfinished (its committed full blocks stay cached, so resuming hits them) and otherwise starts
    the next queued prompt as an internal loop request (``make`` builds it).
    """

    def __init__(self, make: Callable[[IdleKey], Request] | None) -> None:
        self.queue = IdleQueue()
        self.make = make
        #: The internal request computing a prompt now, and that prompt's key.
        self.current: tuple[Request, IdleKey] | None = None
        #: Idle prompts computed to the end, taken out part-way, and the tokens computed for them.
        self.done = 0
        self.yields = 0
        self.tokens = 0

    def has_work(self) -> bool:
        """Whether a step with no request unfinished would compute an idle prompt."""
        return self.make is not None and (self.current is not None or bool(self.queue))

    def schedule(self, scheduler: Scheduler, busy: bool) -> None:
        """Take the prompt part-way out when ``busy`` (a caller's request is unfinished), else start the next."""
        if self.current is not None:
            if busy:
                req, key = self.current
                scheduler.remove(req)
                self.queue.push_front(key)
                self.current = None
                self.yields += 1
        elif self.queue and self.make is not None and not busy:
            key = self.queue.pop()
            req = self.make(key)
            self.current = (req, key)
            scheduler.add(req)

    def finished(self, output: RequestOutput) -> None:
        """The internal request produced ``output``: with its result, that prompt is computed."""
        if output.result is not None and self.current is not None:
            self.current = None
            self.done += 1

    def failed(self) -> None:
        """The internal request ended with an error: not retried (its committed blocks stay cached)."""
        self.current = None

    def clear(self, scheduler: Scheduler) -> None:
        """Forget the idle work (a cache reset): the prompt part-way is taken out, the queue emptied."""
        if self.current is not None:
            scheduler.remove(self.current[0])
            self.current = None
        self.queue.clear()
