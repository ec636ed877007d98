"""A deterministic stand-in engine for tests that need to control timing (queue full, timeouts, disconnects)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvb_cache.core.outputs import PagedStats, RequestId, RequestOutput
from kvb_cache.errors import CacheBusyError, ContextLengthError, InvalidRequestError
from kvb_cache.results import GenerationResult, TokenLogprob, WarmResult
from kvb_cache.sampling import SamplingParams


class CharTokenizer:
    """One token per character (code point mod 256)."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 256 for c in text]}

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(chr(i) for i in ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class Added:
    """One ``add_request`` call the fake accepted."""

    request_id: RequestId
    prompt: list[int]
    params: SamplingParams
    #: The per-request overrides that were set (``prefill_chunk_size``, ``kv_cache_bits``).
    overrides: dict[str, int]
    cache_salt: str | None = None


@dataclass(slots=True, kw_only=True)
class _Request:
    added: Added
    started: float = field(default_factory=time.perf_counter)
    out: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_at: float | None = None
    #: When a step first moved it from waiting to running (its ``queued_ms`` ends there).
    scheduled_at: float | None = None

    def next_token(self) -> int:
        # ``a, b, c, ...`` shifted by the last prompt token and the seed.
        start = (self.added.prompt[-1] + (self.added.params.seed or 0)) % 26
        return ord("a") + (start + len(self.out)) % 26


class FakeScorer:
    """``FakeEngine.prompt_scorer``'s result: hands out precomputed entries ``scorer_slice`` at a time."""

    def __init__(self, engine: FakeEngine, prompt: list[int], top: int, entries: list[TokenLogprob]) -> None:
        self._engine, self._prompt, self._top, self._entries = engine, prompt, top, entries
        self._scored = 0

    @property
    def done(self) -> bool:
        return self._scored >= len(self._entries)

    def advance(self) -> bool:
        engine = self._engine
        engine.scored.append((self._prompt, self._top, threading.current_thread().name))
        self._scored = min(self._scored + engine.scorer_slice, len(self._entries))
        engine.timeline.append(("score", self._scored))
        return self.done

    def result(self) -> list[TokenLogprob]:
        assert self.done
        return list(self._entries)


class FakeEngine:
    """Continuous batching in miniature: every step decodes one token of each running request.

    ``add_request`` queues a request as waiting; a step first moves waiting requests to running (at most
    ``max_num_seqs``), then emits one token per running request; there is no prefill step. Records:
    ``added`` (every accepted request), ``step_log`` (the ids decoded in each step, so tests can assert
    that requests shared steps) and ``aborted``.

    ``token_delay_s`` makes every step that long. ``hold`` (when cleared) blocks ``step()`` at its start
    until set; ``pause_before_step = k`` clears it right before the ``k``-th step (1-based), so the engine
    stalls at a known point. ``stalled`` is set while a step waits on ``hold``. :meth:`fail_step` makes one
    step raise. ``reply`` (when set) is the text every request generates, one character per token, then
    finishes ``"stop"``; ``generation_prompt`` ends every chat prompt.
    """

    model_name = "fake-model"
    context_length = 200
    block_size = 4
    num_blocks = 256

    def __init__(self, *, token_delay_s: float = 0.0, max_num_seqs: int = 8) -> None:
        self.tokenizer = CharTokenizer()
        self.reply: str | None = None
        self.generation_prompt = "<assistant>"
        self.token_delay_s = token_delay_s
        self.max_num_seqs = max_num_seqs
        self.hold = threading.Event()
        self.hold.set()
        self.stalled = threading.Event()
        self.pause_before_step: int | None = None
        self._failure: tuple[int, BaseException] | None = None
        self._row_failures: dict[int, tuple[int, Exception]] = {}
        self.added: list[Added] = []
        self.step_log: list[frozenset[RequestId]] = []
        self.aborted: list[RequestId] = []
        self.warmed: list[str] = []
        #: ``(prompt, top_logprobs, thread name)`` of every scorer ``advance()`` call.
        self.scored: list[tuple[list[int], int, str]] = []
        #: Prompt tokens one scorer ``advance()`` scores.
        self.scorer_slice = 8
        #: ``("step", running count)`` and ``("score", scored so far)`` in the order they ran.
        self.timeline: list[tuple[str, int]] = []
        self.warm_salts: list[str | None] = []
        #: ``lower_tiers`` of every ``reset_cache`` call, and the thread each ran on.
        self.resets: list[bool] = []
        self.reset_threads: list[str] = []
        #: Names of the threads ``close()`` ran on (one entry per call).
        self.closed: list[str] = []
        #: ``close()`` sleeps this long first (a slow flush).
        self.close_delay_s = 0.0
        self.close_timeouts: list[float | None] = []
        self._ids = itertools.count(1)
        self._waiting: deque[_Request] = deque()
        self._running: dict[RequestId, _Request] = {}
        self._cached_blocks = 0
        self._queries = 0
        self._hits = 0

    # -- what the server reads on the event loop -------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def chat_prompt(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + self.generation_prompt
        if tools:
            text = f"<tools>{tools}" + text
        return self.tokenizer(text)["input_ids"]

    def prompt_scorer(self, prompt: list[int], *, top_logprobs: int = 0) -> FakeScorer:
        """A made-up, deterministic score: after token ``p`` the best token is ``p + 1`` (logprob 0), and
        each step further down the alphabet costs 0.1; one ``advance()`` per ``scorer_slice`` tokens."""
        entries = []
        for prev, tok in itertools.pairwise(prompt):
            top = tuple((prev + 1 + k, chr(prev + 1 + k), -k / 10) for k in range(top_logprobs))
            entries.append(
                TokenLogprob(
                    token_id=tok,
                    token=chr(tok),
                    logprob=-((tok - prev - 1) % 26) / 10,
                    top=top,
                    rank=(tok - prev - 1) % 26 + 1,
                )
            )
        return FakeScorer(self, list(prompt), top_logprobs, entries)

    @property
    def overrides(self) -> list[dict[str, int]]:
        return [a.overrides for a in self.added]

    # -- the engine loop -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        prefill_chunk_size: int | None = None,
        kv_cache_bits: int | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestId:
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(prompt) + params.max_new_tokens > self.context_length:
            raise ContextLengthError(
                "too long",
                prompt_tokens=len(prompt),
                max_new_tokens=params.max_new_tokens,
                context_length=self.context_length,
            )
        overrides = {"prefill_chunk_size": prefill_chunk_size, "kv_cache_bits": kv_cache_bits}
        added = Added(
            request_id=RequestId(f"req-{next(self._ids)}"),
            prompt=list(prompt),
            params=params,
            overrides={k: v for k, v in overrides.items() if v is not None},
            cache_salt=cache_salt,
        )
        self.added.append(added)
        self._waiting.append(_Request(added=added))
        self._queries += len(prompt)
        self._hits += len(prompt) // 2
        return added.request_id

    def fail_row(self, index: int, at_token: int, error: Exception) -> None:
        """Make the ``index``-th added request (0-based) end with ``error`` instead of its ``at_token``-th
        token (0-based), as the engine ends a request whose sampler row failed; the step goes on."""
        self._row_failures[index] = (at_token, error)

    def fail_step(self, number: int, error: BaseException) -> None:
        """Make the ``number``-th step (1-based, counting successful ones) raise ``error`` once."""
        self._failure = (number, error)

    def step(self) -> list[RequestOutput]:
        number = len(self.step_log) + 1
        if self.pause_before_step == number:
            self.pause_before_step = None
            self.hold.clear()
        if not self.hold.is_set():
            self.stalled.set()
            self.hold.wait()
            self.stalled.clear()
        if self._failure is not None and self._failure[0] == number:
            error, self._failure = self._failure[1], None
            raise error
        if self.token_delay_s:
            time.sleep(self.token_delay_s)
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.popleft()
            request.scheduled_at = time.perf_counter()
            self._running[request.added.request_id] = request
        self.step_log.append(frozenset(self._running))
        self.timeline.append(("step", len(self._running)))
        outputs = [self._decode(request) for request in list(self._running.values())]
        for output in outputs:
            if output.finished:
                finished = self._running.pop(output.request_id)
                self._cached_blocks += self._blocks(finished)
        return outputs

    def _decode(self, request: _Request) -> RequestOutput:
        params = request.added.params
        failure = self._row_failures.get(self.added.index(request.added))
        if failure is not None and failure[0] == len(request.out):
            return RequestOutput(request_id=request.added.request_id, delta_text="", error=failure[1])
        token = request.next_token() if self.reply is None else ord(self.reply[len(request.out)])
        request.out.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        piece = chr(token)
        lp = TokenLogprob(
            token_id=token,
            token=piece,
            logprob=-0.5,
            top=tuple((token + k, chr(token + k), -0.5 - k) for k in range(params.logprobs or 0)),
        )
        request.logprobs.append(lp)
        lps = (lp,) if params.logprobs is not None else ()
        hit = next((s for s in params.stop if (request.text + piece).endswith(s)), None)
        if hit is not None:
            request.text = (request.text + piece)[: -len(hit)]
            return RequestOutput(
                request_id=request.added.request_id,
                delta_text="",
                token_ids=(token,),
                result=self._result(request, "stop"),
            )
        request.text += piece
        said = self.reply is not None and len(request.out) >= len(self.reply)
        finished = said or len(request.out) >= params.max_new_tokens
        return RequestOutput(
            request_id=request.added.request_id,
            delta_text=piece,
            token_ids=(token,),
            logprobs=lps,
            result=self._result(request, "stop" if said else "length") if finished else None,
        )

    def _result(self, request: _Request, finish: str) -> GenerationResult:
        prompt, params = request.added.prompt, request.added.params
        return GenerationResult(
            output_text=request.text,
            output_ids=list(request.out),
            prompt_tokens=len(prompt),
            cached_tokens=len(prompt) // 2,
            ttft_ms=((request.first_token_at or request.started) - request.started) * 1e3,
            queued_ms=((request.scheduled_at or request.started) - request.started) * 1e3,
            total_ms=(time.perf_counter() - request.started) * 1e3,
            finish_reason=finish,  # type: ignore[arg-type]
            logprobs=tuple(request.logprobs) if params.logprobs is not None else None,
        )

    def abort(self, request_id: RequestId) -> bool:
        self.aborted.append(request_id)
        if self._running.pop(request_id, None) is not None:
            return True
        before = len(self._waiting)
        self._waiting = deque(r for r in self._waiting if r.added.request_id != request_id)
        return len(self._waiting) < before

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def _blocks(self, request: _Request) -> int:
        return -(-(len(request.added.prompt) + len(request.out)) // self.block_size)

    def paged_stats(self) -> PagedStats:
        used = sum(self._blocks(r) for r in self._running.values())
        cached = min(self._cached_blocks, self.num_blocks - used)
        return PagedStats(
            block_size=self.block_size,
            blocks_total=self.num_blocks,
            blocks_used=used,
            blocks_cached=cached,
            blocks_free=self.num_blocks - used - cached,
            running=len(self._running),
            waiting=len(self._waiting),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            preemptions=0,
            steps=len(self.step_log),
            max_num_seqs=self.max_num_seqs,
        )

    # -- warming: a request like the others (``/v1/warm``), or one call (``--warm``) ------------------------
    def add_warm_request(
        self, prompt: list[int], *, cache_salt: str | None = None, prefill_chunk_size: int | None = None
    ) -> RequestId:
        self.warmed.append("".join(chr(t) for t in prompt))
        self.warm_salts.append(cache_salt)
        return self.add_request(
            prompt,
            SamplingParams(max_new_tokens=1),
            prefill_chunk_size=prefill_chunk_size,
            cache_salt=cache_salt,
        )

    def warm_result(
        self,
        prompt: list[int],
        *,
        cache_salt: str | None = None,
        already_cached_tokens: int = 0,
        elapsed_ms: float = 0.0,
    ) -> WarmResult:
        return WarmResult(
            tokens=len(prompt),
            chunks=1,
            new_chunks=1,
            already_cached_tokens=already_cached_tokens,
            elapsed_ms=elapsed_ms,
            cached_tokens=len(prompt),
        )

    # -- engine calls between steps ----------------------------------------------------------------------
    def warm(self, text: str, *, cache_salt: str | None = None) -> WarmResult:
        self.warmed.append(text)
        self.warm_salts.append(cache_salt)
        return WarmResult(tokens=len(text), chunks=1, new_chunks=1, already_cached_tokens=0)

    def cache_stats(self) -> dict[str, Any]:
        # Deliberately not JSON-native, like real engines' stats can be: the server must cope.
        return {"entries": 1, "ratio": float("nan"), "tiers": {"ram": {"bytes": 10}}, "kinds": {1: "x"}}

    def reset_cache(self, *, lower_tiers: bool = False) -> dict[str, Any]:
        if self.has_unfinished():
            raise CacheBusyError(
                f"cannot reset the cache while requests hold blocks ({len(self._running)} running, "
                f"{len(self._waiting)} waiting); retry when the engine is idle",
                running=len(self._running),
                waiting=len(self._waiting),
            )
        self.resets.append(lower_tiers)
        self.reset_threads.append(threading.current_thread().name)
        dropped, self._cached_blocks = self._cached_blocks, 0
        return {"blocks_dropped": dropped, "lower_tiers_cleared": lower_tiers}

    def close(self, *, timeout_s: float | None = None) -> bool:
        self.close_timeouts.append(timeout_s)
        if self.close_delay_s:
            time.sleep(self.close_delay_s)
        self.closed.append(threading.current_thread().name)
        return True
