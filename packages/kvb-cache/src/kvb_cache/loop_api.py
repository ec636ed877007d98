"""The engine loop's request API: admit a request, step, abort, observe; and the loop's result callbacks.

Mixed into :class:`~kvb_cache.engine.KVBoost`. :meth:`LoopAPI.add_request` validates a request and routes
it: a solo request (speculative decoding, a private quantized cache) runs in its own generator, a stitched
one is planned (or deferred behind the requests computing its documents, :mod:`kvb_cache.core.deferred`),
every other one joins the batched loop directly. :meth:`LoopAPI.step` runs one iteration of
:class:`~kvb_cache.core.engine_core.EngineCore`, which calls back into :meth:`LoopAPI._prompt_computed` and
:meth:`LoopAPI._paged_result`. The library loops over this API are :mod:`kvb_cache.loops`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from kvb_cache import generation
from kvb_cache.core import tier_loads
from kvb_cache.core.outputs import PagedStats, RequestId, RequestOutput
from kvb_cache.core.request import Request
from kvb_cache.core.speculation import StepSpeculation, verifiable_in_step
from kvb_cache.core.tier_loads import in_flight, wait_all
from kvb_cache.errors import ConfigError, InvalidRequestError, PromptTypeError, RequestAbortedError
from kvb_cache.live_quant import check_kv_cache_bits
from kvb_cache.loop_request import new_request
from kvb_cache.prediction import prediction_counts, prediction_limit
from kvb_cache.prepared import Prompt
from kvb_cache.request_checks import check_prefill_chunk_size, live_bits
from kvb_cache.results import GenerationResult, HitKind, StreamEvent
from kvb_cache.sampling import SamplingParams, check_token_ids
from kvb_cache.serialized import serialized
from kvb_cache.stitch_sources import stitch_sources

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from kvb_cache.config import EngineConfig
    from kvb_cache.core.engine_core import EngineCore
    from kvb_cache.core.kv_manager import KVCacheManager
    from kvb_cache.decoding import SpeculativeDecoder
    from kvb_cache.hashing import ChunkHash
    from kvb_cache.stats import EngineCounters
    from kvb_cache.stitching import Stitcher
    from kvb_cache.store import ChunkStore
    from kvb_cache.structured.backend import GrammarCache


class LoopAPI:
    """Mixed into :class:`~kvb_cache.engine.KVBoost` (see the module docstring); relies on its request checks
    (``_tokenize``, ``_check_context``, ``_salted_root``, ``_logits_width``) and on
    :class:`~kvb_cache.transfers.CacheTransfers` / :class:`~kvb_cache.idle_work.IdleWork` for the stitch
    plan and the stores."""

    core: EngineCore
    kv: KVCacheManager
    config: EngineConfig
    counters: EngineCounters
    drafter: SpeculativeDecoder | None
    grammars: GrammarCache
    root: ChunkHash
    stitcher: Stitcher
    store: ChunkStore
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    _built_for: tuple[torch.dtype, torch.device]  # the model's dtype and device when the pool was built
    _built_attention: str | None  # the model's attention implementation once the engine routed it (kvb_paged)
    _ids: itertools.count[int]
    _followed: set[RequestId]  # EngineLoops'
    _unfollowed: list[RequestOutput]  # EngineLoops'
    # EngineLoops': a step's outputs filed, followed ones to their loops and the rest kept for step().
    _file: Callable[[list[RequestOutput]], None]
    take_unfollowed_outputs: Callable[[], list[RequestOutput]]  # EngineLoops'

    @serialized
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prefill_chunk_size: int | None = None,
        kv_cache_bits: int | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestId:
        """Queue a request; it joins the running batch at the next :meth:`step`.

        ``cache_salt`` (vLLM's name) isolates a tenant: it roots the request's prefix-hash chain, so only
        requests with the same salt share its cached KV (RAM, stitching store, disk and Redis records).
        ``priority`` (vLLM's; lower runs first) needs ``scheduling_policy="priority"``; speculative and
        ``kv_cache_bits`` requests run beside the loop and do not wait in its queue.

        Raises (synchronously, nothing queued): :class:`InvalidRequestError`, :class:`PromptTypeError`,
        :class:`ContextLengthError` for bad input or a request larger than the pool.
        """
        t0 = time.perf_counter()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise PromptTypeError(f"params must be a kvb_cache.SamplingParams, got {type(params).__name__}")
        self._check_model_unmoved()
        self._check_priority(priority)
        prefill_chunk_size = check_prefill_chunk_size(prefill_chunk_size)
        if prefill_chunk_size is None:
            prefill_chunk_size = self.config.prefill_chunk_size
        bits = live_bits(check_kv_cache_bits(kv_cache_bits))
        root = self._salted_root(cache_salt)
        ids = self._tokenize(prompt)
        self._check_context(len(ids), params.max_new_tokens)
        if request_id is None:
            rid = self._fresh_id("req")
        elif isinstance(request_id, str):
            rid = RequestId(request_id)
        else:  # an int id was kept as is, and abort("5") then missed it
            raise PromptTypeError(
                f"request_id must be a str, got {type(request_id).__name__}", param="request_id"
            )
        if self.core.knows(rid):
            raise InvalidRequestError(f"request_id {rid!r} is already in use", param="request_id")
        check_token_ids(params, self._logits_width)
        constrained = params.response_format is not None
        if constrained and bits is not None:
            raise InvalidRequestError(
                "response_format cannot be combined with kv_cache_bits (a private quantized cache)",
                param="response_format",
            )
        # Constrained requests decode in the batched loop (its sampler holds the grammar masks): no
        # speculation and exact prefix reuse only, never a stitched prompt.
        speculative = self.drafter is not None and params.logprobs is None and not constrained
        req = new_request(self, rid, ids, params, t0, prefill_chunk_size=prefill_chunk_size, root=root)
        # Drafts verified in the batched step: a request with neither a private quantized cache, a grammar nor
        # logprobs whose next token the step can verify (greedy by argmax, unseeded history-free sampling).
        steppable = bits is None and not constrained and params.logprobs is None and verifiable_in_step(req)
        if steppable and params.prediction_ids:
            # Predicted outputs: the request drafts its prediction (kvb_cache.prediction), with or without the
            # engine's drafter; verified as any draft, so the output does not change.
            speculative = False
            req.spec = StepSpeculation.predicted(
                params.prediction_ids[: prediction_limit(params.max_new_tokens)], ids, params.max_new_tokens
            )
        in_step = speculative and steppable and self.core.drafter is not None
        if in_step:
            # Greedy without processing (verified by argmax) or unseeded and history-free sampled (speculative
            # sampling): its drafts are verified inside the batched step beside every other request (vLLM
            # v1's way), however many run; the solo path is left to the rest.
            speculative = False
            req.spec = StepSpeculation.start(self.core.drafter, ids, params.max_new_tokens)
        if speculative and self.kv.storage.narrowed:
            # NOTE: the solo path decodes over its own cache in the model's dtype, the loop over pool-precision
            # KV (kv_cache_dtype): a greedy request's tokens would depend on the drafter and on the load. With a
            # narrowed pool only the requests verified inside the step speculate.
            speculative = False
        if speculative and self.core.has_unfinished() and (params.greedy or params.seed is None):
            # NOTE: a speculative request runs solo (its own batch-1 forwards, beside the batched one), so
            # speculating beside other requests turns one batched forward into one per request: 8 concurrent
            # greedy requests took longer than without a drafter (docs/speculative.md). Like vLLM's
            # speculative disable_by_batch_size, speculate only when nothing else is running; outputs are the
            # same either way. A seeded sampled request keeps its path so its sample does not depend on load.
            speculative = False
        if speculative or bits is not None:

            def start() -> Iterator[StreamEvent]:
                prepared = self._prepare(ids, max_reuse=len(ids) - 1, stitch=True, root=root)
                # Its prefix lookup is a prefix-cache query like any admission's (the counters skipped solo
                # requests); stitched tokens are not prefix hits (they count in the stitching counters).
                # A stitched prompt's hits are what the pool served (its exact and partial chunks), not its
                # exact_until, which also covers a computed gap before the first stitched piece.
                exact = (
                    prepared.cached_tokens
                    if prepared.exact_until is None
                    else sum(
                        c.cached_tokens for c in prepared.chunks if c.kind in (HitKind.EXACT, HitKind.PARTIAL)
                    )
                )
                self.kv.count_lookup(len(ids), exact)
                prepared.prefill_chunk_size = prefill_chunk_size
                self._apply_kv_bits(prepared, bits)
                return generation.run(self, prepared, params, t0)

            self.core.add_solo(rid, start)
            return rid
        req.priority = priority
        if constrained:
            req.grammar = self.grammars.state(params.response_format, self.tokenizer, self._logits_width)
        if self.config.stitching is None or constrained or not self.stitcher.enabled:
            self.core.add(req)
            return rid
        # A prompt whose documents an earlier request is still computing waits for them (core/deferred.py)
        # instead of computing them again beside it; else it is planned now.
        wanted = self.stitcher.config.collect_copies if self.stitcher.config is not None else 1
        sources = stitch_sources(
            self.store, req.root or self.root, req, self.core.pending_prompts(), wanted=wanted
        )
        if sources:
            self.core.defer(req, sources)
        elif self.core.deferred.awaiting_room or not self.core.plan_room().take(req):
            self.core.deferred.hold_for_room(req)  # planned by a step once room frees (core/deferred.py)
        else:
            self._queue_stitched(req)
        return rid

    def _fresh_id(self, prefix: str) -> RequestId:
        """``<prefix>-<n>`` that no unfinished request holds (a caller may have picked ``req-3`` itself)."""
        while True:
            rid = RequestId(f"{prefix}-{next(self._ids)}")
            if not self.core.knows(rid):
                return rid

    def _queue_stitched(self, req: Request) -> None:
        """Plan ``req``'s stitch and queue it: its repair runs in slices, a bounded amount per step (at most
        one slice here), so other requests keep decoding while it prepares (core/preparing.py).

        Planning reads the prompt's exact prefix; where it continues in a disk/Redis tier, those records are
        read on a loader thread first and the request is held (``core.defer``) until they are in memory, so a
        slow tier never pauses the running requests (:mod:`kvb_cache.core.tier_loads`)."""
        if self.kv.tiers is not None and req.tier_load is None:
            keys = self.kv.tier_keys(req, req.prompt_len - 1)
            if keys:
                load = self.core.scheduler.loads.start_load(req, keys)
                wait_all([load], tier_loads.LOAD_GRACE_S)
                if not req.tier_load.done:
                    self.core.defer(req, (), req.tier_load)  # planned by a later step, once read
                    return
        job = self._plan_stitch(req)
        if job is None:
            self.core.add(req)
        else:
            self.core.add_preparing(req, job)

    def _check_priority(self, priority: object) -> None:
        """``priority`` is an int, and 0 unless the engine schedules by priority (vLLM refuses it too)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
            raise InvalidRequestError(f"priority must be an int, got {priority!r}", param="priority")
        if priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs priority scheduling: build the engine with "
                "scheduling_policy='priority' (kvboost-server --scheduling-policy priority)",
                param="priority",
            )

    def _check_model_unmoved(self) -> None:
        """The model is still as the engine was built for it, checked before anything runs on it:

        - the same dtype and device (``model.to(torch.bfloat16)`` failed in the next forward with a bare SDPA
          error: query bf16, key fp32 from the pool);
        - attention still routed through the pool (``model.set_attn_implementation("eager")``, e.g. for
          ``output_attentions``, sent the engine's forwards past the pool: wrong logits, and blocks
          registered with KV never written, which later prompts then hit);
        - in eval mode (``model.train()`` in a fine-tuning loop: dropout in every forward, and that noisy KV
          cached for later requests).
        """
        now = (self.model.dtype, self.model.device)
        if now != self._built_for:
            raise ConfigError(
                f"the model was moved to {now[0]} on {now[1]} after this engine was built for {self._built_for[0]}"
                f" on {self._built_for[1]}: build a new KVBoost for it (the cached KV is of the old dtype/device)"
            )
        attention = getattr(self.model.config, "_attn_implementation", None)
        if attention != self._built_attention:
            raise ConfigError(
                f"the model's attention implementation was set to {attention!r} after this engine routed it "
                f"through {self._built_attention!r}: call model.set_attn_implementation({self._built_attention!r}) "
                "before using the engine again (the model's own forwards keep the implementation it had before "
                "the engine was built)"
            )
        if self.model.training:
            raise ConfigError(
                "the model is in training mode (model.train(): dropout in every forward, and that KV would be "
                "cached): call model.eval() before using the engine, and reset_cache() if its weights changed"
            )

    @serialized
    def step(self) -> list[RequestOutput]:
        """Run one iteration: new prefills (sliced to the token budget) and one token for every running
        request. Returns at most one :class:`RequestOutput` per request that produced text or finished.

        Outputs of requests that a library call follows (:meth:`generate`, :meth:`stream`,
        :meth:`generate_batch`, :meth:`warm`, in this thread or another) go to that call, not here; outputs
        those calls' own steps produced for the caller's requests (:meth:`add_request`) come first. Before,
        a driver's ``step`` beside an open stream took the stream's tokens (it ended short, silently) and a
        ``generate`` in another thread raised a bare ``RuntimeError``.

        Raises:
            ConfigError: the model was moved to another dtype or device since the engine was built (the
                pool holds KV of the old one); nothing runs until it is moved back.
        """
        self._file(self._step_engine())
        return self.take_unfollowed_outputs()

    @serialized
    def _step_engine(self) -> list[RequestOutput]:
        """One engine step; every request's outputs (the library loops file them, :meth:`step` too)."""
        self._check_model_unmoved()
        return self.core.step()

    @serialized
    def abort(self, request_id: RequestId | str) -> bool:
        """Drop a request now (its blocks are released); False when it is unknown or already finished.

        A :meth:`generate` / :meth:`stream` call following the request (another thread's) ends at once with
        :class:`RequestAbortedError`. Before, it found no final output only once every other request had
        finished (it stepped them all first), then raised a bare ``RuntimeError``.

        Raises:
            PromptTypeError: ``request_id`` is not a string (one id per call).
        """
        if not isinstance(request_id, str):  # a list of ids raised "unhashable type" from inside the core
            raise PromptTypeError(
                f"request_id must be a str, got {type(request_id).__name__}; abort one id per call",
                param="request_id",
            )
        rid = RequestId(request_id)
        aborted = self.core.abort(rid)
        # What a library loop's steps produced for it and no step returned yet is dropped with it.
        self._unfollowed[:] = [out for out in self._unfollowed if out.request_id != rid]
        if aborted and rid in self._followed:
            error = RequestAbortedError(rid)
            self._mailbox.setdefault(rid, deque()).append(
                RequestOutput(request_id=rid, delta_text="", error=error)
            )
        return aborted

    def has_unfinished(self) -> bool:
        """Whether :meth:`step` has more to return: a request is unfinished, or a library call's steps
        produced outputs for the caller's requests that no ``step`` returned yet (a request a ``generate``
        finished: the driver's ``while has_unfinished(): step()`` loop still gets its result)."""
        return self.core.has_unfinished() or bool(self._unfollowed)

    @serialized
    def paged_stats(self) -> PagedStats:
        pool, sched = self.kv.pool, self.core.scheduler
        return PagedStats(
            block_size=pool.block_size,
            blocks_total=pool.num_blocks,
            blocks_used=pool.num_blocks - pool.num_free,
            blocks_cached=pool.num_cached,
            blocks_free=pool.num_free - pool.num_cached,
            running=self.core.running,
            waiting=self.core.waiting,
            prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits,
            preemptions=sched.preemptions,
            steps=self.core.steps,
            max_num_seqs=sched.max_num_seqs,
            tier_loads=sched.loads.started,
            # The callers' requests only, as ``waiting`` (the idle prompt being computed is the engine's own).
            loading=len(in_flight(r.tier_load for r in sched.waiting if not r.internal))
            + len(self.core.deferred.loading()),
        )

    def _prompt_computed(self, req: Request) -> None:
        self._store_prompt_chunks(req)
        self._queue_idle(req)

    def _paged_result(self, req: Request) -> GenerationResult:
        cached = req.cached_tokens or 0
        chunks = req.chunk_hits if req.chunk_hits is not None else generation.chunk_hits(req.spans, cached)
        result = GenerationResult(
            output_text=req.emitter.text,
            output_ids=list(req.output_ids),
            prompt_tokens=req.prompt_len,
            cached_tokens=cached,
            recomputed_tokens=req.recomputed_tokens,
            ttft_ms=req.ttft_ms,
            total_ms=(time.perf_counter() - req.arrival) * 1e3,
            # Arrival to the engine's first work on the request (Request.queued_ms): its first admission into
            # the batch, or for a stitched prompt the first slice of its repair (that is its prefill compute,
            # and preparing requests count as running); a deferred stitched prompt waits until then.
            queued_ms=req.queued_ms,
            finish_reason=req.emitter.finish or "length",
            chunks=chunks,
            logprobs=tuple(req.logprobs[: req.emitter.covered()])
            if req.params.logprobs is not None
            else None,
            stop_reason=req.emitter.stop_reason,
            grammar_error=req.grammar.error if req.grammar is not None else None,
            **prediction_counts(req.spec.counts if req.spec is not None else None),
        )
        if req.counted:  # an idle prompt (core/idle.py) or a warm is the engine's work, not a request
            self.counters.record_chunks(chunks, partial_tokens=req.partial_tokens)
            self.record_request(result)
        if self.config.stitching is not None:
            self._store_chunks(req)
        return result

    def record_request(self, result: GenerationResult) -> None:
        self.counters.record_result(result)
