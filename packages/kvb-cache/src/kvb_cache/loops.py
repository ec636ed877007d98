"""Library loops over the engine loop: ``generate``, ``stream``, ``generate_batch``, ``warm``.

Each is a thin loop over :meth:`~kvb_cache.engine.KVBoost.add_request` and ``step``. Several may interleave
(open streams share steps): outputs of other requests wait in per-request mailboxes until their loop reads
them. Outputs of requests no library loop follows (a server's, added with ``add_request`` and driven by its
own ``step`` calls) are kept aside for the driver's next ``step`` (or :meth:`EngineLoops.take_unfollowed_outputs`),
so a library call made between a driver's steps (the server's ``/v1/warm``) never swallows them; and a
driver's ``step`` files the outputs of requests a library loop follows in that loop's mailbox, so a driver
stepping beside ``generate`` / ``stream`` (another thread's, or a stream left open) never swallows theirs.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

from kvb_cache.call_args import changed_options, given_params, input_ids_given, keyword_defaults
from kvb_cache.core.outputs import RequestId, RequestOutput
from kvb_cache.errors import (
    InvalidRequestError,
    naming_item,
)
from kvb_cache.loop_request import new_request
from kvb_cache.pool_io import probe_request
from kvb_cache.prepared import Prompt
from kvb_cache.request_checks import check_prefill_chunk_size
from kvb_cache.request_stream import RequestStream
from kvb_cache.results import GenerationResult, StreamEvent, WarmResult
from kvb_cache.sampling import SamplingParams
from kvb_cache.serialized import serialized
from kvb_cache.token_bans import bad_words_ids, check_sequences

if TYPE_CHECKING:
    from kvb_cache.core.engine_core import EngineCore
    from kvb_cache.core.kv_manager import KVCacheManager


class EngineLoops:
    """Mixed into :class:`~kvb_cache.engine.KVBoost`; relies on its loop API and tokenizer."""

    core: EngineCore
    kv: KVCacheManager
    _mailbox: dict[RequestId, deque[RequestOutput]]
    _followed: set[RequestId]
    _unfollowed: list[RequestOutput]
    _fresh_id: Callable[[str], RequestId]  # LoopAPI's: an id no unfinished request holds
    _check_model_unmoved: Callable[[], None]  # LoopAPI's
    _step_engine: Callable[[], list[RequestOutput]]  # LoopAPI's: one engine step, every output
    _engine_lock: threading.RLock  # serialized.py
    tokenizer: Any

    def stream(
        self, prompt: Prompt | None = None, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> RequestStream:
        """Token-by-token text deltas; the last event carries the :class:`GenerationResult`.

        Accepts the same arguments as :meth:`generate`. Arguments are validated at the call; closing
        the iterator early (``close()``, leaving a ``with`` block, or dropping it), even before its first
        event, aborts the request (its computed KV stays cached).
        """
        if prompt is None and "input_ids" in sampling:
            raise input_ids_given("stream")
        prefill_chunk_size = sampling.pop("prefill_chunk_size", None)
        kv_cache_bits = sampling.pop("kv_cache_bits", None)
        cache_salt = sampling.pop("cache_salt", None)
        priority = sampling.pop("priority", 0)
        params = given_params(sampling_params, sampling) or self._sampling_params(sampling)
        with self._engine_lock:  # followed before another thread's step can produce its first output
            rid = self.add_request(
                prompt,
                params,
                prefill_chunk_size=prefill_chunk_size,
                kv_cache_bits=kv_cache_bits,
                cache_salt=cache_salt,
                priority=priority,
            )
            self._followed.add(rid)
        return RequestStream(rid, self._follow(rid), functools.partial(self._unfollow, rid, finished=False))

    def _sampling_params(self, fields: dict[str, Any]) -> SamplingParams:
        """:meth:`SamplingParams.build` of a library call's keywords; vLLM's ``bad_words`` (strings) become
        ``bad_words_ids`` with this engine's tokenizer (:func:`kvb_cache.token_bans.bad_words_ids`)."""
        words = fields.pop("bad_words", None)
        if words is not None:
            if isinstance(words, str) or not isinstance(words, (list, tuple)):
                raise InvalidRequestError(
                    f"bad_words must be a list of strings, got {type(words).__name__}", param="bad_words"
                )
            extra = bad_words_ids(self.tokenizer, words)
            fields["bad_words_ids"] = (*check_sequences(fields.get("bad_words_ids", ())), *extra)
        return SamplingParams.build(**fields)

    @serialized
    def take_unfollowed_outputs(self) -> list[RequestOutput]:
        """Outputs that library loops stepped past for requests none of them follows, in step order.

        A driver that shares the engine with library calls (the server runs ``warm`` between its own steps)
        routes these as if its own ``step`` had returned them; otherwise a request finishing during the call
        would never be answered.
        """
        taken = list(self._unfollowed)
        self._unfollowed.clear()
        return taken

    def _follow(self, rid: RequestId) -> Generator[StreamEvent, None, None]:
        done = False
        try:
            while not done:
                out = self._next_output(rid)
                done = out.finished
                if out.error is not None:
                    raise out.error
                yield StreamEvent(
                    delta_text=out.delta_text,
                    token_ids=out.token_ids,
                    logprobs=out.logprobs,
                    result=out.result,
                )
        finally:
            self._unfollow(rid, finished=done)

    @serialized
    def _unfollow(self, rid: RequestId, *, finished: bool) -> None:
        """Forget a library loop's request; abort it unless it finished."""
        self._mailbox.pop(rid, None)
        self._followed.discard(rid)
        if not finished:
            self.abort(rid)

    def _next_output(self, rid: RequestId) -> RequestOutput:
        """The next output of a request followed by a library loop, stepping the engine as needed.

        Several loops may share the engine (interleaved streams): outputs of the others are kept in their
        mailboxes until they ask."""
        while True:
            # One step per hold of the lock: loops of other threads step in between, and whichever steps
            # files every output in its loop's mailbox.
            with self._engine_lock:
                box = self._mailbox.setdefault(rid, deque())
                if box:
                    return box.popleft()
                if not self.core.has_unfinished():
                    raise RuntimeError(f"request {rid} ended without a final output")
                self._file(self._step_engine())

    def _file(self, outputs: list[RequestOutput]) -> None:
        """File one step's outputs: a followed request's in its loop's mailbox, any other (a driver's) in
        ``_unfollowed``, which the driver's own :meth:`step` (or :meth:`take_unfollowed_outputs`) returns."""
        outs = deque(outputs)
        try:
            while outs:
                out = outs[0]
                if out.request_id in self._followed:
                    self._mailbox.setdefault(out.request_id, deque()).append(out)
                else:
                    self._unfollowed.append(out)
                outs.popleft()
        finally:  # an interrupt while filing: the rest reach their loops with the next step
            self.core.carry(outs)

    def generate(
        self,
        prompt: Prompt | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: list[int] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        response_format: Any = None,
        logit_bias: dict[int, float] | None = None,
        prefill_chunk_size: int | None = None,
        kv_cache_bits: int | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        **unknown: Any,
    ) -> GenerationResult:
        """Generate a completion of ``prompt`` (a string, or token ids) reusing cached KV.

        ``temperature=0`` is greedy. ``stop`` strings end generation and are not included in the text.
        ``prefill_chunk_size`` processes the uncached prompt suffix in slices (bounded activation memory).
        ``kv_cache_bits`` 8 or 4 holds this request's live KV KIVI-quantized (lower peak memory, approximate
        outputs, nothing stored; see :mod:`kvb_cache.live_quant`); 16 or None keep the exact path.
        ``cache_salt`` isolates a tenant: only requests with the same salt share cached KV.
        ``priority`` (lower first) orders concurrent requests under ``scheduling_policy="priority"``.
        ``response_format`` constrains the output (a JSON schema dict, a pydantic model class, ``"json"``,
        ``{"type": "regex", "pattern": ...}`` or ``{"type": "grammar", "grammar": <Lark/GBNF>}``; see
        docs/structured.md). ``logit_bias``: token id -> bias in [-100, 100] added to its logit.
        ``min_tokens``: no end-of-sequence and no stop string before that many tokens (vLLM's semantics).
        ``stop_token_ids`` end generation like end-of-sequence; ``include_stop_str_in_output`` keeps the stop
        string or token in the text; ``skip_special_tokens=False`` keeps special tokens' text (all vLLM's).

        ``sampling_params``: a :class:`SamplingParams` instead of those keywords, as vLLM's
        ``llm.generate(prompt, sampling_params)`` takes it (positionally or by name); giving both is an
        :class:`InvalidRequestError`. ``prefill_chunk_size``, ``kv_cache_bits``, ``cache_salt`` and
        ``priority`` are not sampling options and go with either.
        """
        if prompt is None and "input_ids" in unknown:
            raise input_ids_given("generate")
        options = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            stop=stop,
            seed=seed,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=include_stop_str_in_output,
            skip_special_tokens=skip_special_tokens,
            response_format=response_format,
            logit_bias=logit_bias,
            # NOTE: a misspelt option raises the InvalidRequestError naming the valid ones, as stream()
            # and generate_batch() do, not Python's TypeError (OpenAI's max_tokens is the usual slip).
            **unknown,
        )
        if sampling_params is not None:
            params = given_params(sampling_params, changed_options(options, _GENERATE_DEFAULTS))
        else:
            params = self._sampling_params(options)
        with self._engine_lock:
            rid = self.add_request(
                prompt,
                params,
                prefill_chunk_size=prefill_chunk_size,
                kv_cache_bits=kv_cache_bits,
                cache_salt=cache_salt,
                priority=priority,
            )
            self._followed.add(rid)
        return self._run_to_end([rid])[0]

    def generate_batch(
        self,
        prompts: Sequence[Prompt] | None = None,
        *,
        sampling: Sequence[dict[str, Any]] | None = None,
        prefill_chunk_size: int | None = None,
        kv_cache_bits: int | None = None,
        cache_salt: str | None = None,
        **common: Any,
    ) -> list[GenerationResult]:
        """Generate for several prompts through the engine loop, each with its own sampling parameters.

        ``sampling[i]`` (if given) overrides ``common`` for prompt ``i`` (``priority`` included);
        ``cache_salt`` applies to every prompt (one tenant per batch). Each row equals what
        :meth:`generate` returns for it alone (greedy: the same tokens, up to near-ties of the logits).
        Every prompt is validated before any is queued.
        """
        if prompts is None and "input_ids" in common:
            raise input_ids_given("generate_batch")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError("prompts must be a non-empty list", param="prompts")
        # NOTE: a single dict (an easy slip for "the same options for all") raised KeyError: 0 when indexed.
        if sampling is not None and (
            not isinstance(sampling, (list, tuple))
            or len(sampling) != len(prompts)
            or not all(isinstance(s, dict) for s in sampling)
        ):
            raise InvalidRequestError(
                "sampling must be a list with one dict per prompt (options shared by every prompt go in as "
                "keyword arguments)",
                param="sampling",
            )
        rows = [{**common, **(sampling[i] if sampling else {})} for i in range(len(prompts))]
        priorities = [row.pop("priority", 0) for row in rows]
        params = []
        for i, (prompt, row) in enumerate(zip(prompts, rows)):
            with naming_item(i):
                params.append(self._sampling_params(row))
                self._check_context(len(self._tokenize(prompt)), params[-1].max_new_tokens)
        self._salted_root(cache_salt)  # validated before any prompt is queued
        ids: list[RequestId] = []
        with self._engine_lock:
            try:
                for i, (prompt, p, priority) in enumerate(zip(prompts, params, priorities)):
                    with naming_item(i):
                        ids.append(
                            self.add_request(
                                prompt,
                                p,
                                prefill_chunk_size=prefill_chunk_size,
                                kv_cache_bits=kv_cache_bits,
                                cache_salt=cache_salt,
                                priority=priority,
                            )
                        )
            except BaseException:
                # add_request has checks of its own (the pool's size, stop_token_ids against the
                # vocabulary): when a later prompt fails them, the ones already queued would be left running
                # with no loop following them (their outputs piling up unread). The batch is all or nothing.
                for rid in ids:
                    self.abort(rid)
                raise
            self._followed.update(ids)
        return self._run_to_end(ids)

    def _run_to_end(self, rids: list[RequestId]) -> list[GenerationResult]:
        results: dict[RequestId, GenerationResult] = {}
        self._followed.update(rids)
        try:
            for rid in rids:
                while rid not in results:
                    out = self._next_output(rid)
                    if out.error is not None:
                        raise out.error
                    if out.result is not None:
                        results[rid] = out.result
        finally:
            for rid in rids:
                self._unfollow(rid, finished=rid in results)
        return [results[rid] for rid in rids]

    def warm(
        self, text: Prompt | None = None, *, cache_salt: str | None = None, **unknown: Any
    ) -> WarmResult:
        """Compute and cache the KV of ``text`` (no generation), so later prompts starting with it hit
        (those with the same ``cache_salt``). Runs the engine loop until it is done (other requests in the
        loop advance too); a server queues :meth:`add_warm_request` instead, stepping it with the rest."""
        if unknown:
            if text is None and "input_ids" in unknown:
                raise input_ids_given("warm")
            raise TypeError(f"warm() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        t0 = time.perf_counter()
        ids = self._tokenize(text)
        with self._engine_lock:
            already = self._cached_prefix(ids, cache_salt)
            rid = self.add_warm_request(ids, cache_salt=cache_salt)
            self._followed.add(rid)
        self._run_to_end([rid])
        return self.warm_result(
            ids,
            cache_salt=cache_salt,
            already_cached_tokens=already,
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
        )

    @serialized
    def add_warm_request(
        self, text: Prompt, *, cache_salt: str | None = None, prefill_chunk_size: int | None = None
    ) -> RequestId:
        """Queue ``text`` to be computed and cached, exactly (never stitched: what a warm stores must be an
        exact prefix hit for the prompts starting with it); it is prefilled in slices like any prompt and
        can be aborted. Its one output is a result whose token is discarded (``cached_tokens``: the tokens
        already cached when it was admitted).

        Raises (nothing queued): :class:`InvalidRequestError` / :class:`ContextLengthError` for bad input.
        """
        self._check_model_unmoved()
        t0 = time.perf_counter()
        root = self._salted_root(cache_salt)
        ids = self._tokenize(text)
        chunk = check_prefill_chunk_size(prefill_chunk_size)
        # NOTE: the prompt alone must fit (a prompt of exactly the context is warmed): add_request would count
        # the one generated token against the context. That token only makes the loop compute every prompt
        # token; it is discarded and its KV never computed.
        self._check_context(len(ids), 0)
        rid = self._fresh_id("warm")
        request = new_request(
            self,  # type: ignore[arg-type]
            rid,
            ids,
            SamplingParams(max_new_tokens=1),
            t0,
            prefill_chunk_size=chunk if chunk is not None else self.config.prefill_chunk_size,
            root=root,
        )
        request.warm = True
        self.core.add(request)
        return rid

    def warm_result(
        self,
        text: Prompt,
        *,
        cache_salt: str | None = None,
        already_cached_tokens: int = 0,
        elapsed_ms: float = 0.0,
    ) -> WarmResult:
        """What a warm of ``text`` left cached (no forward runs): its chunks, and the tokens the pool holds."""
        ids = self._tokenize(text)
        spans = self.chunker.split(ids)
        chunks = sum(span.complete for span in spans)
        done = sum(span.complete and span.end <= already_cached_tokens for span in spans)
        return WarmResult(
            tokens=len(ids),
            chunks=chunks,
            new_chunks=chunks - done,
            already_cached_tokens=already_cached_tokens,
            elapsed_ms=elapsed_ms,
            cached_tokens=self._cached_prefix(ids, cache_salt),
        )

    def _cached_prefix(self, ids: list[int], cache_salt: str | None) -> int:
        """Leading tokens of ``ids`` the block pool holds under ``cache_salt``'s chain (0 without caching)."""
        if not self.kv.caching:
            return 0
        return self.kv.cached_prefix_len(probe_request(ids, root=self._salted_root(cache_salt)), len(ids))


#: generate()'s keyword defaults: a keyword at its default beside a SamplingParams is no conflict.
_GENERATE_DEFAULTS = keyword_defaults(EngineLoops.generate)
