"""The engine's idle work, as the caller sees it: which prompts are queued, and running it.

What is queued and why is in :mod:`kvb_cache.core.idle`; the engine loop runs it in steps that have no
caller's request to run. A driver that owns the loop (the server's worker) calls ``KVBoost.step``
while :meth:`IdleWork.has_idle_work` and nothing else is to do; a library user calls :meth:`IdleWork.run_idle`
when it has time to spare (between a batch of requests and the next).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvb_cache.core.idle import IDLE_SLICE_TOKENS, IdleKey
from kvb_cache.core.outputs import RequestId
from kvb_cache.core.request import Request
from kvb_cache.loop_request import new_request
from kvb_cache.sampling import SamplingParams
from kvb_cache.serialized import serialized

if TYPE_CHECKING:
    from kvb_cache.config import EngineConfig
    from kvb_cache.core.engine_core import EngineCore
    from kvb_cache.core.kv_manager import KVCacheManager


class IdleWork:
    """Mixed into :class:`~kvb_cache.engine.KVBoost`."""

    core: EngineCore
    kv: KVCacheManager
    config: EngineConfig
    _fresh_id: Callable[[str], RequestId]  # LoopAPI's: an id no unfinished request holds

    def has_idle_work(self) -> bool:
        """Whether the engine has prompts to compute while no request is unfinished
        (``StitchConfig.idle_copies``)."""
        return self.core.has_idle_work()

    @serialized
    def run_idle(self, max_steps: int | None = None) -> int:
        """Compute queued idle prompts now, while no request is unfinished: at most ``max_steps`` steps (None:
        until the queue is empty). Returns the steps run (0 when a request is unfinished: requests first)."""
        steps = 0
        while self.core.has_idle_work() and not self.core.has_unfinished():
            if max_steps is not None and steps >= max_steps:
                break
            self.core.step()  # no caller's request is unfinished: it returns no outputs
            steps += 1
        return steps

    @serialized
    def clear_idle_work(self) -> None:
        """Forget the queued idle prompts (and take out the one part-way); the cache keeps what they stored."""
        self.core.clear_idle()

    def idle_stats(self) -> dict[str, Any]:
        idle = self.core.idle
        return {
            "queued": len(idle.queue),
            "computed_prompts": idle.done,
            "computed_tokens": idle.tokens,
            "yields": idle.yields,
            "dropped": idle.queue.dropped,
        }

    def _queue_idle(self, req: Request) -> None:
        """Queue ``req``'s prompt for idle time when its stitch left a document short of copies (called once
        its prompt is computed: an aborted request queues nothing)."""
        # NOTE: an engine that caches nothing (max_cache_bytes=0) would compute the prompt for nothing.
        if req.idle_refine and self.kv.caching and self.kv.can_fit(req.prompt_len + 1):
            self.core.idle.queue.add(req.tokens[: req.prompt_len], req.root)

    def _make_idle(self, key: IdleKey) -> Request:
        """The internal loop request computing idle prompt ``key``: its prompt, one greedy token (the prompt's
        chunks are stored once it is computed, :meth:`~kvb_cache.transfers.CacheTransfers._store_prompt_chunks`)."""
        root, ids = key
        chunk = min(self.config.prefill_chunk_size or IDLE_SLICE_TOKENS, IDLE_SLICE_TOKENS)
        rid = self._fresh_id("kvb-idle")
        req = new_request(
            self,  # type: ignore[arg-type]
            rid,
            list(ids),
            SamplingParams(max_new_tokens=1),
            time.perf_counter(),
            prefill_chunk_size=chunk,
            root=root,
        )
        req.internal = True
        return req
