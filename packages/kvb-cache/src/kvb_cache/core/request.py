"""One request's state inside the engine loop."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvb_cache.core.block_pool import Block
from kvb_cache.core.outputs import RequestId
from kvb_cache.core.penalties import PenaltyHistory
from kvb_cache.emitter import Emitter
from kvb_cache.hashing import ChunkHash
from kvb_cache.request_processor import RequestProcessor
from kvb_cache.results import TokenLogprob
from kvb_cache.sampling import SamplingParams
from kvb_cache.structured.state import GrammarState

if TYPE_CHECKING:
    from kvb_cache.core.speculation import StepSpeculation
    from kvb_cache.core.tier_loads import TierLoad


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedKV:
    """KV of a request's first ``length`` tokens assembled outside the pool (a stitched prompt: exact prefix,
    re-positioned and repaired pieces); written into the request's private blocks when it is admitted."""

    #: Per layer ``(keys, values)``, each ``[1, kv_heads, >= length, head_dim]``.
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    length: int


@dataclass(eq=False, slots=True, kw_only=True)
class Request:
    """A prompt, what it generated so far and where its KV lives.

    ``tokens`` is the prompt followed by the generated tokens. KV exists for ``tokens[:num_computed]`` in
    ``blocks`` (token ``i`` sits in ``blocks[i // block_size]``); the next step computes
    ``tokens[num_computed:]`` (or a slice of it), and the last scheduled slice samples a token.
    """

    request_id: RequestId
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    processor: RequestProcessor
    emitter: Emitter
    arrival: float
    prefill_chunk_size: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    blocks: list[Block] = field(default_factory=list)
    #: Root of this request's hash chain: the engine's root salted by ``cache_salt`` (None: the engine's).
    root: ChunkHash | None = None
    #: Prefix hashes of the full blocks of ``tokens`` computed so far (a cache of the hash chain).
    block_hashes: list[ChunkHash] = field(default_factory=list)
    #: Leading full blocks already indexed in the pool (hits, or registered after computing).
    registered: int = 0
    num_computed: int = 0
    #: Prompt tokens served from the cache at first admission (telemetry: ``cached_tokens``).
    cached_tokens: int | None = None
    partial_tokens: int = 0
    exact_blocks: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0  # entries of ``logprobs`` already carried by an output (Emitter.covered)
    #: Output tokens already carried by a RequestOutput (tokens whose text is held back ride on the next).
    streamed: int = 0
    ttft_ms: float = 0.0
    #: When the engine first worked on this request (``time.perf_counter()``, the clock of ``arrival``): its
    #: first admission into the running batch, or a stitched prompt's first repair slice; None until then.
    #: Kept across preemptions (see ``queued_ms``).
    scheduled_at: float | None = None
    preemptions: int = 0
    #: Later requests admitted while this one was the oldest waiting (the scheduler's bound on its wait).
    bypassed: int = 0
    #: vLLM's request priority (lower runs first) under the ``priority`` scheduling policy.
    priority: int = 0

    @property
    def rank(self) -> tuple[int, float]:
        """Order under the priority policy: priority, then arrival (earlier first)."""
        return self.priority, self.arrival

    #: Chunk spans of the prompt (telemetry: which chunks were served from cache).
    spans: tuple = ()
    #: Stitching: the prompt's complete chunks under a root, hashed once (``(root, pieces)``; see
    #: :func:`kvb_cache.stitch_sources.prompt_pieces`), since every later arrival reads them while pending.
    stitch_pieces: tuple | None = None
    #: Speculating inside the batched step (:class:`~kvb_cache.decoding.StepDrafter`): this request's
    #: drafter session (None: no speculation), and the tokens it drafted for the step being planned.
    spec: StepSpeculation | None = None
    draft: list[int] = field(default_factory=list)
    #: ``[len(draft), V]``: the distributions a draft *model* sampled ``draft`` from (a sampled request);
    #: None: point-mass drafts (prompt lookup, a greedy request).
    draft_probs: torch.Tensor | None = None
    #: Keep the raw logits of each sampled token in ``last_logits`` (``next_token_logits``).
    capture_logits: bool = False
    last_logits: object = None
    #: ``(block ids, [len(ids) * block_size] slots)``: the pool slots of ``blocks``, extended as they grow
    #: (:meth:`kvb_cache.core.kv_manager.KVCacheManager.slots`).
    slot_table: tuple[list[int], torch.Tensor] | None = None
    #: Seen ids and output counts for repetition/presence/frequency penalties (made by the sampler on first
    #: use, then updated with each step's new tokens only).
    penalty_history: PenaltyHistory | None = None
    #: The ``response_format`` matcher (None: unconstrained); the sampler masks and advances it.
    grammar: GrammarState | None = None
    #: KV to adopt at admission instead of a prefix lookup (stitched prompts); dropped once written.
    prepared_kv: PreparedKV | None = None
    #: The disk/Redis lookup of this waiting request's prefix past the pool's blocks, read off the loop
    #: thread (:mod:`kvb_cache.core.tier_loads`); dropped once admitted.
    tier_load: TierLoad | None = None
    #: Only ``tokens[:exact_until]`` hold exact KV (a stitched request): later blocks are never registered
    #: under a prefix hash. None: all of them are exact.
    exact_until: int | None = None
    #: Stitched requests: prompt ranges ``(start, end)`` whose KV was copied from stored chunks.
    copied: tuple[tuple[int, int], ...] = ()
    #: Stitched requests: how each prompt chunk was served and how many stitched tokens were recomputed.
    chunk_hits: tuple | None = None
    recomputed_tokens: int = 0
    #: Stitched requests: a document was held by fewer than ``StitchConfig.idle_copies`` copies, so the
    #: prompt is queued for idle time once computed (:mod:`kvb_cache.core.idle`).
    idle_refine: bool = False
    #: The engine's own work (a prompt computed while idle, :mod:`kvb_cache.core.idle`): its outputs are
    #: never returned and it is left out of the request and prefix-cache counters.
    internal: bool = False
    #: A warm (:meth:`~kvb_cache.KVBoost.add_warm_request`): cache management, not a request: its outputs are
    #: returned, but it is left out of the request and prefix-cache counters (its lookup of the text it
    #: came to compute added the whole text to ``vllm:prefix_cache_queries_total``).
    warm: bool = False

    @property
    def lookup_limit(self) -> int:
        """Prompt tokens whose cached KV admitting this request may reuse: all but the last (whose logits
        must be computed), or the exact part of a stitched one's ``prepared_kv``."""
        return len(self.tokens) - 1 if self.prepared_kv is None else self.adoptable_prefix

    @property
    def adoptable_prefix(self) -> int:
        """Tokens of ``prepared_kv`` that may come from cached blocks: its exact part (0 without one)."""
        if self.prepared_kv is None:
            return 0
        length = self.prepared_kv.length
        return length if self.exact_until is None else min(self.exact_until, length)

    @property
    def counted(self) -> bool:
        """Whether the request and prefix-cache counters see this request."""
        return not (self.internal or self.warm)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        """``len(output_ids)`` without copying them (hot paths read it every step)."""
        return len(self.tokens) - self.prompt_len

    def mark_scheduled(self) -> None:
        """The engine works on this request now (admitted into the batch, or a stitched prompt's repair
        slice): the end of its WAITING phase. Only the first call counts (see ``queued_ms``)."""
        if self.scheduled_at is None:
            self.scheduled_at = time.perf_counter()

    @property
    def queued_ms(self) -> float:
        """Arrival to first scheduling (vLLM's WAITING phase; 0 while never scheduled).

        As in vLLM v1 (``IterationStats``: the first SCHEDULED event counts, later ones are ignored), a
        preempted request that is scheduled again keeps its first time: its wait after a preemption falls
        in the prefill or decode phase it interrupted, not in the queue time.
        """
        return 0.0 if self.scheduled_at is None else max(self.scheduled_at - self.arrival, 0.0) * 1e3

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return len(self.tokens) - self.num_computed
