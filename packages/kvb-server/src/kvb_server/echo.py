"""OpenAI's ``echo`` on ``/v1/completions``: the prompt repeated before each choice's text.

With ``logprobs`` the prompt's own tokens are scored as well (the first one ``null``: nothing precedes it),
which is how evaluation harnesses ask a completions server for a loglikelihood: lm-eval's
``local-completions`` sends ``echo: true, logprobs: 1, max_tokens: 1`` and sums ``token_logprobs`` over
the continuation's tokens. ``max_tokens: 0`` scores the prompt and generates nothing.

Scoring is a plain forward over the whole prompt (a cached prefix has KV but no logits). It runs on the
engine thread one slice per call (:class:`PromptScoring`), so the running requests take a step between
slices instead of waiting for the whole prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvb_cache.results import GenerationResult, TokenLogprob
from kvb_server.errors import RequestTimeoutError
from kvb_server.jobs import DISCONNECT_POLL_S, ClientDisconnected, IsDisconnected
from kvb_server.token_bytes import TextOffsets

if TYPE_CHECKING:
    from kvb_server.engine import ServingEngine
    from kvb_server.worker import EngineWorker


def as_token_ids(entry: TokenLogprob) -> TokenLogprob:
    """``entry`` with every token named ``"token_id:<id>"`` instead of its text (vLLM's
    ``return_tokens_as_token_ids``): ids a client can use as they are, where texts can be ambiguous (two
    tokens, or a lone byte token's U+FFFD)."""
    return dataclasses.replace(
        entry,
        token=token_id_label(entry.token_id),
        top=tuple((token_id, token_id_label(token_id), lp) for token_id, _, lp in entry.top),
    )


def token_id_label(token_id: int) -> str:
    return f"token_id:{token_id}"


def completion_top(entry: TokenLogprob) -> dict[str, float]:
    """A completions ``top_logprobs`` dict: the ``logprobs=N`` most likely tokens, and the token itself.

    OpenAI and vLLM always include the chosen (sampled, or for an echoed prompt the prompt's) token, so a
    dict holds up to N + 1 entries and a client can read the token's rank from it; the engine's
    alternatives are only the N best, which leave it out whenever it is not among them (a sampled token
    below the top N, any prompt token the model did not expect). Added last when it is not among them (it
    ranks below them all).
    """
    top: dict[str, float] = {}
    for _, text, lp in entry.top:
        top.setdefault(text, lp)  # most likely first: a text two tokens share keeps the likelier one
    # The chosen token's own entry wins a shared text (every lone byte token reads U+FFFD): a client reads
    # top_logprobs[token] as its token's log-probability.
    top[entry.token] = entry.logprob
    return top


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo:
    """What one prompt contributes to each of its choices."""

    text: str
    #: The text of the prompt's first token (it has no log-probability).
    first_token: str
    #: Its id (its bytes place the next tokens' text offsets).
    first_token_id: int
    #: The prompt's tokens after the first (``KVBoost.prompt_scorer``); None: logprobs not requested.
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: The tokenizer's special tokens: one the echoed text does not hold where it stands (the BOS a text
    #: prompt was encoded with: ``text`` is the prompt as sent) takes no room in it.
    special_ids: frozenset[int] = frozenset()

    def logprob_arrays(self, offsets: TextOffsets, *, tokens_as_ids: bool = False) -> dict[str, list[Any]]:
        """OpenAI's completions-style arrays for the prompt tokens, their text offsets read from ``offsets``
        (which then stands where the generated tokens' offsets continue); ``tokens_as_ids``: tokens named
        ``"token_id:<id>"`` (the offsets still count their text)."""
        assert self.logprobs is not None
        first = token_id_label(self.first_token_id) if tokens_as_ids else self.first_token
        arrays: dict[str, list[Any]] = {
            "tokens": [first],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [self._advance(offsets, self.first_token_id, self.first_token)],
        }
        for e in self.logprobs:
            shown = as_token_ids(e) if tokens_as_ids else e
            arrays["tokens"].append(shown.token)
            arrays["token_logprobs"].append(e.logprob)
            arrays["top_logprobs"].append(completion_top(shown))
            arrays["text_offset"].append(self._advance(offsets, e.token_id, e.token))
        return arrays

    def _advance(self, offsets: TextOffsets, token_id: int, token: str) -> int:
        if token_id in self.special_ids and not self.text.startswith(token, offsets.position):
            # Added by the tokenizer, not in the echoed text (a "Hello" prompt encoded as BOS + "Hello"):
            # counted, every offset after it ran len(BOS) characters past its token, most past the text.
            return offsets.position
        return offsets.advance(token_id, token)


def prompt_only_result(prompt_tokens: int, *, logprobs: bool) -> GenerationResult:
    """The result of a choice that generates nothing (``max_tokens: 0`` with echo)."""
    return GenerationResult(
        output_text="",
        output_ids=[],
        prompt_tokens=prompt_tokens,
        cached_tokens=0,
        ttft_ms=0.0,
        total_ms=0.0,
        finish_reason="length",
        logprobs=() if logprobs else None,
    )


class PromptScoring:
    """Scores echoed prompts on the engine thread, one slice per :meth:`EngineWorker.call`.

    Each slice is its own call, so the worker steps its running requests between two slices (a request
    decoding beside a long scored prompt waits about one slice per token, not the whole prompt). One
    prompt is scored at a time: a scorer holds its prompt's KV outside the block pool until it is done, so
    several at once would hold several prompts' KV the pool does not account for.
    """

    def __init__(self, worker: EngineWorker, engine: ServingEngine, *, timeout_s: float) -> None:
        self._worker = worker
        self._engine = engine
        self._timeout_s = timeout_s  # --request-timeout, named in the 504 of a request that waited its turn
        self._one_at_a_time = asyncio.Lock()

    async def score(
        self,
        prompt: list[int],
        *,
        top_logprobs: int,
        deadline: float,
        is_disconnected: IsDisconnected | None = None,
    ) -> tuple[TokenLogprob, ...]:
        """The prompt's tokens after the first, each with its ``top_logprobs`` alternatives.

        Raises what the engine raises for a bad prompt, the worker's ``QueueFullError`` /
        ``RequestTimeoutError`` (``deadline`` is ``time.monotonic()``-based), and ``ClientDisconnected`` once
        ``is_disconnected`` says so (checked before every slice and while one runs), so a client that hung
        up stops costing engine time; a cancelled caller leaves the scorer half-done, and it is dropped.
        """
        await self._acquire(deadline, is_disconnected)
        try:
            make = functools.partial(self._engine.prompt_scorer, prompt, top_logprobs=top_logprobs)
            scorer = await self._call(make, deadline, is_disconnected)
            while not scorer.done:
                await self._call(scorer.advance, deadline, is_disconnected)
            return tuple(scorer.result())
        finally:
            self._one_at_a_time.release()

    async def _acquire(self, deadline: float, is_disconnected: IsDisconnected | None) -> None:
        """Wait for the scorer's turn, but not past ``deadline`` nor for a client that went away: a
        request queued behind a long scored prompt used to learn either only once it had the lock."""
        acquire = asyncio.ensure_future(self._one_at_a_time.acquire())
        try:
            await self._watch(acquire, deadline, is_disconnected)
        except BaseException:
            if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                self._one_at_a_time.release()  # it was granted as we gave up: pass it on
            else:
                acquire.cancel()
            raise

    async def _call(self, fn: Any, deadline: float, is_disconnected: IsDisconnected | None) -> Any:
        if is_disconnected is not None and await is_disconnected():
            raise ClientDisconnected()
        call = asyncio.ensure_future(self._worker.call(fn, timeout_s=_left(deadline)))
        try:
            return await self._watch(call, deadline, is_disconnected)
        finally:
            call.cancel()  # a no-op once it is done; else the worker skips it if it has not started

    async def _watch(
        self, future: asyncio.Future[Any], deadline: float, is_disconnected: IsDisconnected | None
    ) -> Any:
        """``future``'s result; ``ClientDisconnected`` / ``RequestTimeoutError`` first if the client goes
        away (checked every :data:`DISCONNECT_POLL_S`) or ``deadline`` passes."""
        while True:
            done, _ = await asyncio.wait({future}, timeout=min(DISCONNECT_POLL_S, _left(deadline)))
            if done:
                return future.result()
            if is_disconnected is not None and await is_disconnected():
                raise ClientDisconnected()
            if _left(deadline) <= 0:
                raise RequestTimeoutError(self._timeout_s)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
