"""Engine-wide reuse counters."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvb_cache.lookup import PrefixMatch
    from kvb_cache.results import GenerationResult


class EngineCounters:
    """Lookups by hit kind and request totals; thread-safe; :meth:`as_dict` is JSON-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookups = 0
        self.chunks_total = 0
        self.exact_chunk_hits = 0
        self.partial_hits = 0
        self.partial_tokens = 0
        self.content_only_hits = 0
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def record_lookup(self, match: PrefixMatch, *, total_chunks: int) -> None:
        with self._lock:
            self.lookups += 1
            self.chunks_total += total_chunks
            self.exact_chunk_hits += match.exact_chunks
            self.partial_hits += bool(match.partial_tokens)
            self.partial_tokens += match.partial_tokens
            self.content_only_hits += match.content_hits

    def record_chunks(self, chunks, *, partial_tokens: int) -> None:
        """One lookup of the engine loop, described by its prompt's :class:`~kvb_cache.results.ChunkHit` s."""
        from kvb_cache.results import HitKind

        with self._lock:
            self.lookups += 1
            self.chunks_total += len(chunks)
            self.exact_chunk_hits += sum(c.kind is HitKind.EXACT for c in chunks)
            self.partial_hits += sum(c.kind is HitKind.PARTIAL for c in chunks)
            self.partial_tokens += partial_tokens

    def record_result(self, result: GenerationResult) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += result.prompt_tokens
            self.cached_tokens += result.cached_tokens
            self.completion_tokens += len(result.output_ids)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            missed = self.chunks_total - self.exact_chunk_hits
            return {
                "lookups": self.lookups,
                "hits": {
                    "exact": self.exact_chunk_hits,
                    "partial": self.partial_hits,
                    "content_only": self.content_only_hits,
                    "miss": max(missed - self.partial_hits, 0),
                },
                "partial_tokens": self.partial_tokens,
                "requests": self.requests,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens,
                "kv_reuse_ratio": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            }
