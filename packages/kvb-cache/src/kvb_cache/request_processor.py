"""A request's :class:`~kvb_cache.sampling.SamplingParams` applied to raw logits, one request at a time.

The batched step samples every row at once (``core/sampler.py``); this processor serves the paths that
decode one request alone (speculative verification, solo generators) and must pick the same tokens.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvb_cache.errors import NonFiniteLogitsError
from kvb_cache.sampling import SamplingParams
from kvb_cache.token_bans import TokenBans, check_choosable


class RequestProcessor:
    """Applies a request's :class:`SamplingParams` to raw logits (satisfies ``decoding.TokenProcessor``).

    Repetition penalty, temperature, top-k and top-p are transformers' own logits processors; only the
    OpenAI presence/frequency penalties, which transformers lacks, are done here.
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        prompt_len: int,
        device: torch.device,
        eos: frozenset[int] = frozenset(),
    ) -> None:
        """``eos``: the token ids that end this request (empty with ``ignore_eos``), held back by ``min_tokens``."""
        self.params = params
        self.prompt_len = prompt_len
        # Kept apart from the others so that a greedy request is an identity again once min_tokens is met.
        self._min_tokens = (
            MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, sorted(eos), device=device)
            if params.min_tokens and eos
            else None
        )
        # NOTE: apart from the warpers, and applied before the presence/frequency penalties: that is the
        # batched sampler's order (core/sampler.py, vLLM's too). Inside the list it ran after them, so a
        # solo request (speculative decoding) with both kinds of penalty decoded other tokens than plain.
        self._repetition = (
            RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
            if params.repetition_penalty != 1.0
            else None
        )
        processors = LogitsProcessorList()
        if not params.greedy:
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            # vLLM's order (the batched sampler's): min-p before top-k / top-p, not after as transformers.
            if params.min_p > 0.0:
                processors.append(MinPLogitsWarper(params.min_p))
            if params.top_k:
                processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(params.top_p))
        self._processors = processors
        self._penalized = bool(params.presence_penalty or params.frequency_penalty)
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if params.logit_bias:
            self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            self.bias_values = torch.tensor(
                list(params.logit_bias.values()), dtype=torch.float32, device=device
            )
        self.bans: TokenBans | None = (
            TokenBans(params.allowed_token_ids, params.bad_words_ids, device)
            if params.allowed_token_ids is not None or params.bad_words_ids
            else None
        )
        self._generator: torch.Generator | None = None
        if params.seed is not None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def generator(self) -> torch.Generator | None:
        return self._generator

    @property
    def history_free(self) -> bool:
        """True when the processed distribution does not depend on the tokens generated so far (no
        repetition / presence / frequency penalty, no banned words, no ``min_tokens`` hold): every drafted
        position is processed alike (speculation inside the batched step)."""
        return (
            self._repetition is None
            and not self._penalized
            and self.bans is None
            and self._min_tokens is None
        )

    @property
    def is_identity(self) -> bool:
        """True when processing cannot change the argmax (greedy without penalties): skip it."""
        return (
            self.greedy
            and self._repetition is None
            and not self._processors
            and not self._penalized
            and self.bias_ids is None
            and self.bans is None
        )

    def holds_eos(self, history: torch.Tensor) -> bool:
        """True while ``min_tokens`` bans end-of-sequence (``history`` ``[S]``: prompt and output so far)."""
        return self._min_tokens is not None and history.shape[-1] - self.prompt_len < self.params.min_tokens

    def process(self, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``history`` ``[S]`` int64, ``logits`` ``[V]`` -> processed ``[V]`` float32."""
        scores = logits.float().unsqueeze(0)
        if self.bias_ids is not None:
            scores = scores.index_add(1, self.bias_ids, self.bias_values.unsqueeze(0))
        if self.bans is not None:
            self.bans.apply_(scores[0], history.tolist(), self.prompt_len)
        if self._repetition is not None:
            scores = self._repetition(history.unsqueeze(0), scores)
        if self._penalized:
            generated = history[self.prompt_len :]
            if generated.numel():
                counts = torch.bincount(generated, minlength=scores.shape[-1])[: scores.shape[-1]].to(scores)
                scores = (
                    scores
                    - self.params.frequency_penalty * counts
                    - self.params.presence_penalty * (counts > 0)
                )
        if self._min_tokens is not None:
            scores = self._min_tokens(history.unsqueeze(0), scores)
        if self.bans is not None:
            check_choosable(scores[0], self.params, holds_eos=self.holds_eos(history), constrained=False)
        if self._processors:
            scores = self._processors(history.unsqueeze(0), scores)
        return scores[0]

    def choose(self, history: torch.Tensor, logits: torch.Tensor) -> int:
        """Pick the next token from raw ``logits`` ``[V]``.

        Raises:
            NonFiniteLogitsError: ``logits`` hold NaN (argmax would return a NaN's index as a token).
        """
        if bool(torch.isnan(logits).any()):
            raise NonFiniteLogitsError()
        if self.is_identity and not self.holds_eos(history):
            return int(torch.argmax(logits))
        scores = self.process(history, logits)
        if self.greedy:
            return int(torch.argmax(scores))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))
