"""What one engine step returns per request, and the paged pool's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NewType

from kvb_cache.results import GenerationResult, TokenLogprob

RequestId = NewType("RequestId", str)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    """The progress of one request in one :meth:`KVBoost.step`.

    ``token_ids`` are the tokens generated since the request's previous output: usually this step's one,
    more when the text of earlier ones was held back (no output is emitted for a token that adds no text,
    nor while a long prompt is still being prefilled). ``delta_text`` is the text now safe to
    show (stop strings and partial UTF-8 characters are held back). ``result`` is set on the request's last
    output, and only then. ``error`` is set instead when choosing or emitting this request's token failed:
    the request is over (its blocks freed) and the other requests of the step went on.
    """

    request_id: RequestId
    delta_text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    result: GenerationResult | None = None
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedStats:
    """Block pool and scheduler counters (vLLM-style names where one exists).

    Attributes:
        block_size: tokens per KV block.
        blocks_total / blocks_used / blocks_cached / blocks_free: pool occupancy. ``used`` blocks belong to
            running requests; ``cached`` ones hold reusable KV with no owner (evictable); ``free`` ones hold
            nothing. ``cached`` and ``free`` together are what new requests can take.
        running / waiting: requests in each queue.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / served from cached blocks.
        preemptions: requests sent back to waiting because the pool ran out of blocks.
        steps: engine steps run.
        max_num_seqs: most requests running at once (0: not known).
        tier_loads: disk/Redis lookups started for waiting requests and stitched prompts about to be planned,
            off the loop thread.
        loading: those requests whose lookup is still in flight (skipped or held until it answers).
    """

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    running: int
    waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    steps: int
    max_num_seqs: int = 0
    tier_loads: int = 0
    loading: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks owned by running requests (vLLM's ``kv_cache_usage_perc`` / 100)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "hit_rate": round(self.hit_rate, 4),
            "kv_cache_usage": round(self.kv_cache_usage, 4),
        }
