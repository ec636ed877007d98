"""The engine contract the server drives, defined here because the server consumes it.

``kvb_cache.KVBoost`` satisfies it structurally; tests drive the server with small fakes. The engine is
not thread-safe: every method below is called from the server's single engine thread
(:class:`kvb_server.worker.EngineWorker`), except tokenization (:func:`encode_text` and
:meth:`ServingEngine.chat_prompt`) and the plain attributes, which the event loop reads so requests can be
measured (and refused by an admission gate) before they are queued.

Serving is iteration-level: :meth:`ServingEngine.add_request` hands the engine a request and
:meth:`ServingEngine.step` advances every request it holds by one iteration (a prefill slice for new ones,
one decoded token for running ones), so requests arriving at any time share the next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from kvb_cache.core.outputs import PagedStats, RequestId, RequestOutput
from kvb_cache.results import TokenLogprob, WarmResult
from kvb_cache.sampling import SamplingParams


class PromptScorer(Protocol):
    """A prompt being scored one slice per :meth:`advance` (``kvb_cache.scoring.PromptScorer``)."""

    @property
    def done(self) -> bool:
        """Whether every prompt token after the first is scored."""
        ...

    def advance(self) -> bool:
        """Score the next slice; returns :attr:`done`."""
        ...

    def result(self) -> list[TokenLogprob]:
        """The entries once done (``len == len(prompt) - 1``)."""
        ...


@runtime_checkable
class ServingEngine(Protocol):
    """What the server needs from a generation engine."""

    @property
    def model_name(self) -> str:
        """The model id clients put in ``model``."""
        ...

    @property
    def context_length(self) -> int | None:
        """Maximum prompt + generated tokens (None: unknown, the engine checks nothing)."""
        ...

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (callable: ``tokenizer(text, add_special_tokens=True)["input_ids"]``)."""
        ...

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        content_format: str = "auto",
    ) -> list[int]:
        """Token ids of a chat conversation through the tokenizer's chat template (generation prompt added
        unless ``add_generation_prompt`` is False; ``/tokenize`` answers 400 for engines without the keyword).

        ``tools`` (OpenAI function definitions) are passed to templates that render tools themselves; the
        server sends them only for such templates (see :func:`kvb_server.tool_calls.detect`).
        ``continue_final_message`` and ``chat_template_kwargs`` are vLLM's request options, ``content_format``
        its ``--chat-template-content-format`` (``"auto"``, ``"string"``, ``"openai"``); the server passes
        each keyword only when a request (or the flag) sets it (raise ``InvalidRequestError`` for a bad one).
        """
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI's logprobs report it."""
        ...

    def prompt_scorer(self, prompt: list[int], *, top_logprobs: int = 0) -> PromptScorer:
        """A scorer of each prompt token after the first given those before it, with the ``top_logprobs``
        most likely tokens there: ``echo`` with ``logprobs``. Validates now (bad input raises a
        ``kvb_cache`` error); the server then calls ``advance()`` once per slice, between steps."""
        ...

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
        """Queue one generation; it joins the next :meth:`step`.

        Validates synchronously: bad input raises a ``kvb_cache`` error (``InvalidRequestError``,
        ``ContextLengthError``, ...) and nothing is queued. ``prefill_chunk_size`` / ``kv_cache_bits`` are
        the admission gate's per-request overrides (None: the engine's default). ``cache_salt`` roots the
        request's prefix hash chain: requests with different salts never share cached blocks (None:
        unsalted). ``priority`` (vLLM's, lower first) is passed only when not 0, to an engine scheduling by
        priority.
        """
        ...

    def step(self) -> list[RequestOutput]:
        """Run one iteration; at most one output per request, ``result`` set on a request's last one."""
        ...

    def abort(self, request_id: RequestId) -> bool:
        """Drop a request now (its KV blocks are freed); it produces no further outputs."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        ...

    def paged_stats(self) -> PagedStats:
        """Block pool and scheduler counters."""
        ...

    def cache_stats(self) -> Mapping[str, Any]:
        """Cache counters and tier state (the server makes them JSON-safe)."""
        ...

    def warm(self, text: str, *, cache_salt: str | None = None) -> WarmResult:
        """Prefill ``text`` under ``cache_salt`` and store its KV so later prompts of that salt hit (runs the
        engine to the end; the server uses it only before serving, ``--warm``)."""
        ...

    def add_warm_request(
        self, prompt: list[int], /, *, cache_salt: str | None = None, prefill_chunk_size: int | None = None
    ) -> RequestId:
        """Queue ``prompt`` to be computed and cached exactly, nothing generated (``/v1/warm``): stepped with
        the other requests, aborted like them. Its one output carries a result whose token is discarded.
        Validates synchronously, like :meth:`add_request`."""
        ...

    def warm_result(
        self,
        prompt: list[int],
        /,
        *,
        cache_salt: str | None = None,
        already_cached_tokens: int = 0,
        elapsed_ms: float = 0.0,
    ) -> WarmResult:
        """What a warm of ``prompt`` left cached (chunks, tokens the pool holds); runs no forward."""
        ...

    def reset_cache(self, *, lower_tiers: bool = False) -> Mapping[str, Any]:
        """Forget every cached prefix in RAM (and, with ``lower_tiers``, on disk / in Redis); returns what
        was dropped (the server makes it JSON-safe).

        Raises ``kvb_cache.CacheBusyError`` while requests are running or waiting (the server: 409).
        """
        ...

    def close(self, *, timeout_s: float | None = None) -> bool:
        """Flush queued tier writes (disk, Redis) for at most ``timeout_s`` and close the tiers; the engine
        keeps serving from RAM afterwards. False: writes were still queued at the deadline."""
        ...


def encode_text(engine: ServingEngine, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a completion prompt, as ``KVBoost.generate(text)`` tokenizes it (special tokens added;
    vLLM's ``add_special_tokens: false`` leaves them out).

    The server tokenizes before queueing (for the admission gate and usage) and hands the engine ids, so
    both must agree; this mirrors ``KVBoost._tokenize``.
    """
    return list(engine.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
