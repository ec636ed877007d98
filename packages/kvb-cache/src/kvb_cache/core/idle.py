"""Work the engine does only while it has no request to serve: stitched prompts computed exactly.

A stitched prompt is served from copies of its documents' KV computed after other histories. Computing that
prompt again, exactly, once the engine has nothing else to do stores its chunks under its own prefix keys:
the same prompt asked again is then an exact prefix hit, and each of its documents has one more independent
copy, computed after this prompt's history, for later stitched prompts to average
(``StitchConfig.average_copies``; two copies halved the KL on long documents, docs/fidelity.md). That is
what ``StitchConfig.collect_copies`` buys by computing a document on its second sighting, without making that
request pay for it (``StitchConfig.idle_copies``).

The queue holds prompts (token ids and chain root), not requests: :class:`~kvb_cache.core.engine_core.
EngineCore` turns the first one into an internal loop request when no other request is unfinished, and
takes it out again as soon as one arrives. Its full blocks stay cached in the pool, so when it comes back
its prefix lookup finds the part it had computed; what it loses is at most the partial last block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvb_cache.hashing import ChunkHash

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
