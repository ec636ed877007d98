"""Value objects the engine returns: generation results, stream events, warm results."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


class HitKind(str, enum.Enum):
    """How a prompt chunk was served."""

    #: Prefix-hash hit: KV reused exactly (same tokens after the same history).
    EXACT = "exact"
    #: Only part of the chunk matched a cached chunk token by token (radix-style tail match).
    PARTIAL = "partial"
    #: Content-hash hit reused at a new position after a different history (approximate; seam-repaired).
    STITCHED = "stitched"
    #: Computed by the prefill forward.
    MISS = "miss"


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkHit:
    """One prompt chunk and how it was served: tokens ``[start, end)`` of the prompt."""

    start: int
    end: int
    kind: HitKind
    #: Tokens of this chunk served from cache (``end - start`` for exact hits, fewer for partial ones).
    cached_tokens: int
    #: Tokens of this chunk that were recomputed by seam repair (0 unless stitched).
    recomputed_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprob:
    """Log-probability of a generated token and of the most likely alternatives at that step."""

    token_id: int
    token: str
    logprob: float
    #: ``(token_id, token_text, logprob)`` for the ``top_logprobs`` most likely tokens, best first.
    top: tuple[tuple[int, str, float], ...] = ()
    #: 1-based rank of ``token_id`` among all tokens (1: the most likely), as vLLM's prompt logprobs report
    #: it; set by prompt scoring (:meth:`KVBoost.prompt_logprobs`), None for generated tokens.
    rank: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationResult:
    """The outcome of one :meth:`KVBoost.generate` call."""

    output_text: str
    output_ids: list[int]
    prompt_tokens: int
    #: Prompt tokens whose KV came from the cache (exact + partial + stitched).
    cached_tokens: int
    #: Wall time from the call to the first generated token: tokenization, lookup, assembly, repair, prefill.
    ttft_ms: float
    total_ms: float
    finish_reason: FinishReason
    #: Wall time from the call to the engine loop's first work on the request (admitted into the running
    #: batch, or a stitched prompt's first repair slice), part of ``ttft_ms``: vLLM's WAITING phase (the
    #: queue of a full batch or pool, a deferred stitched prompt; docs/server.md). 0 on the solo path.
    queued_ms: float = 0.0
    chunks: tuple[ChunkHit, ...] = ()
    #: Tokens recomputed by seam repair (stitched chunks only).
    recomputed_tokens: int = 0
    #: Per generated token, when logprobs were requested.
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: What ended generation when it was not end-of-sequence or the length: the stop string, or the token id
    #: of ``stop_token_ids`` (vLLM's ``stop_reason``); None otherwise.
    stop_reason: str | int | None = None
    #: Set when the ``response_format`` grammar's matcher failed while decoding (the grammar outgrew the
    #: library's limits): the output then does not complete the grammar, although ``finish_reason`` is
    #: ``"stop"``. None otherwise.
    grammar_error: str | None = None
    #: Predicted outputs (``prediction_ids``): drafted prediction tokens the verification kept / rejected
    #: (OpenAI's ``completion_tokens_details``); 0 without a prediction, or where it was not used.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def kv_reuse_ratio(self) -> float:
        """``cached_tokens / prompt_tokens``."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens after the first, per second of decode time."""
        decode_ms = self.total_ms - self.ttft_ms
        return (
            (len(self.output_ids) - 1) / (decode_ms / 1e3)
            if decode_ms > 0 and len(self.output_ids) > 1
            else 0.0
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEvent:
    """One step of :meth:`KVBoost.stream`.

    Every event but the last carries a text delta (possibly empty while a multi-byte character or a
    possible stop string is held back) and the token ids it covers. The last event has ``result`` set.
    """

    delta_text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    result: GenerationResult | None = None

    @property
    def is_final(self) -> bool:
        return self.result is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmResult:
    """The outcome of :meth:`KVBoost.warm`."""

    tokens: int
    #: Full ``chunk_size`` chunks of this text (the stitching store's unit; 0 for a text shorter than one
    #: chunk, whose blocks are cached all the same: see ``cached_tokens``), and how many were not yet cached.
    chunks: int
    new_chunks: int
    #: Tokens whose KV was already cached before the call (no forward ran for them).
    already_cached_tokens: int
    elapsed_ms: float = field(default=0.0)
    #: Tokens of this text the block pool now holds (its full blocks): what a prompt starting with the text
    #: reuses. A reply to ``warm()`` said ``chunks=0`` for a short system prompt whose next request then
    #: reused 126 tokens.
    cached_tokens: int = 0
