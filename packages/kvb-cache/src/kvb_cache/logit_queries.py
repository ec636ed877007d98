"""Reading the model through the engine instead of generating: next-token logits, prompt log-probabilities
and the fidelity check.

Mixed into :class:`~kvb_cache.engine.KVBoost`. :meth:`LogitQueries.next_token_logits` runs a one-token loop
request that keeps its logits (the reference point of every fidelity check, :mod:`kvb_cache.fidelity`);
:meth:`LogitQueries.prompt_logprobs` and :meth:`LogitQueries.prompt_scorer` score a prompt with plain
forwards that neither read nor write the cache (:mod:`kvb_cache.scoring`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvb_cache import scoring
from kvb_cache.core.outputs import RequestId
from kvb_cache.core.preparing import adopt_stitched
from kvb_cache.errors import InvalidRequestError
from kvb_cache.fidelity import CorrectnessReport
from kvb_cache.loop_request import new_request
from kvb_cache.prepared import NextTokenLogits, Prompt
from kvb_cache.results import TokenLogprob
from kvb_cache.sampling import SamplingParams
from kvb_cache.serialized import serialized

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from kvb_cache.config import EngineConfig
    from kvb_cache.core.engine_core import EngineCore


class LogitQueries:
    """Mixed into :class:`~kvb_cache.engine.KVBoost` (see the module docstring); relies on its request checks
    (``_tokenize``, ``_check_context``, ``_salted_root``) and loops (``_run_to_end``, ``_prepare``)."""

    core: EngineCore
    config: EngineConfig
    model: PreTrainedModel
    device: torch.device
    _fresh_id: Callable[[str], RequestId]  # LoopAPI's: an id no unfinished request holds
    _check_model_unmoved: Callable[[], None]  # LoopAPI's

    @serialized
    def next_token_logits(self, prompt: Prompt, *, cache_salt: str | None = None) -> NextTokenLogits:
        """Raw logits for the token after ``prompt``, computed through the cache, and the prompt cached
        (under ``cache_salt``'s chain).

        The reference point of every fidelity check: compare against ``model(ids).logits[0, -1]``.
        """
        self._check_model_unmoved()
        root = self._salted_root(cache_salt)
        ids = self._tokenize(prompt)
        # NOTE: this request skips add_request's checks; a prompt larger than the pool was admitted slice by
        # slice and preempted itself forever (the call never returned). The prompt alone must fit: the token
        # sampled after it is never computed (a prompt of exactly the context is scored, as by a forward).
        self._check_context(len(ids), 0)
        t0 = time.perf_counter()
        rid = self._fresh_id("logits")
        req = new_request(self, rid, ids, SamplingParams(max_new_tokens=1), t0, root=root)
        req.capture_logits = True
        if self.config.stitching is not None:
            prepared = self._prepare(ids, max_reuse=len(ids) - 1, stitch=True, root=root)
            if prepared.exact_until is not None:
                adopt_stitched(req, prepared)
        self.core.add(req)
        result = self._run_to_end([rid])[0]
        return NextTokenLogits(
            logits=req.last_logits,
            cached_tokens=result.cached_tokens,
            prompt_tokens=len(ids),
            recomputed_tokens=result.recomputed_tokens,
        )

    @serialized
    def prompt_logprobs(self, prompt: Prompt, *, top_logprobs: int = 0) -> list[TokenLogprob]:
        """Log-probability of every prompt token after the first, under the model given the tokens before it,
        with the ``top_logprobs`` (the whole vocabulary at most) most likely tokens at each position: what OpenAI's ``echo`` with
        ``logprobs`` reports and lm-eval's loglikelihood tasks read. ``len(result) == prompt_tokens - 1``.

        A plain forward over the whole prompt (:mod:`kvb_cache.scoring`): a cached prefix has KV but no
        logits, so nothing is read from or written to the cache. :meth:`prompt_scorer` is the same in
        slices a caller can interleave with :meth:`step`.
        """
        scorer = self.prompt_scorer(prompt, top_logprobs=top_logprobs)
        while not scorer.advance():
            pass
        return scorer.result()

    def prompt_scorer(self, prompt: Prompt, *, top_logprobs: int = 0) -> scoring.PromptScorer:
        """:meth:`prompt_logprobs` one slice (``prefill_chunk_size`` positions, default 256) per
        ``advance()`` call, so the running requests can take a :meth:`step` between slices; ``result()``
        once ``done``. Validates now (:class:`InvalidRequestError`, :class:`ContextLengthError`,
        :class:`ConfigError` for a model moved since the engine was built)."""
        self._check_model_unmoved()
        ids = self._tokenize(prompt)
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise InvalidRequestError(
                f"top_logprobs must be an int >= 0, got {top_logprobs!r}.", param="logprobs"
            )
        self._check_context(len(ids), 0)
        slice_size = self.config.prefill_chunk_size or scoring.SLICE
        return scoring.PromptScorer(
            self.model, self, ids, top=top_logprobs, slice_size=slice_size, device=self.device
        )

    def verify_correctness(
        self, prompts: Sequence[Prompt] | None = None, *, new_tokens: int = 16
    ) -> CorrectnessReport:
        """Run ``prompts`` through this engine and compare each with no-cache (see :mod:`kvb_cache.fidelity`):
        reuse ratio, first-token max-abs logit diff and KL, greedy agreement over ``new_tokens``."""
        from kvb_cache.fidelity import verify_correctness

        return verify_correctness(self, prompts, new_tokens=new_tokens)
