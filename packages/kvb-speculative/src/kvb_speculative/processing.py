"""A :class:`~kvb_speculative.protocols.TokenProcessor` built from transformers' own logits processors.

Engines pass their own processor to :meth:`SpeculativeDecoder.decode`; this one serves the standalone
:func:`~kvb_speculative.generate.speculative_generate` and any plain Hugging Face code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvb_speculative.errors import SpeculativeConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen from the target's logits.

    Attributes:
        temperature: 0 for greedy decoding, else the softmax temperature (> 0).
        top_k: keep only the ``top_k`` most likely tokens (None: no limit).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (None: no limit).
        repetition_penalty: CTRL-style penalty on tokens already in the history (1.0: none).
        min_p: drop tokens less likely than ``min_p`` times the most likely one, after the other filters
            (0.0: none; transformers' ``MinPLogitsWarper``).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        # NOTE: finite numbers first: nan passed every comparison below (and sampled from a meaningless
        # distribution), inf sampled uniformly; a string raised a bare TypeError.
        for name in ("temperature", "repetition_penalty", "min_p") + (
            ("top_p",) if self.top_p is not None else ()
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SpeculativeConfigError(f"{name} must be a finite number, got {value!r}.")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise SpeculativeConfigError(f"top_k must be an int >= 1 or None, got {self.top_k!r}.")
        if self.temperature < 0:
            raise SpeculativeConfigError(
                f"temperature={self.temperature} is negative; use 0 for greedy or a positive value to sample."
            )
        if self.top_k is not None and self.top_k < 1:
            raise SpeculativeConfigError(f"top_k={self.top_k} must be >= 1, or None to disable it.")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise SpeculativeConfigError(f"top_p={self.top_p} must be in (0, 1], or None to disable it.")
        if self.repetition_penalty <= 0:
            raise SpeculativeConfigError(
                f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 disables it)."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SpeculativeConfigError(f"min_p={self.min_p} must be in [0, 1] (0 disables it).")


class LogitsTokenProcessor:
    """Applies ``SamplingParams`` through a ``transformers.LogitsProcessorList``.

    Args:
        params: the sampling rule.
        generator: seeded RNG for every random draw (None: torch's global RNG).
    """

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None) -> None:
        self._params = params
        self._generator = generator
        processors = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        if params.temperature > 0:
            # Warpers only shape the sampling distribution; greedy keeps the argmax of the penalised logits,
            # exactly as transformers' generate(do_sample=False) does.
            if params.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k is not None:
                processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p is not None and params.top_p < 1.0:
                processors.append(TopPLogitsWarper(params.top_p))
            if params.min_p > 0.0:
                processors.append(MinPLogitsWarper(params.min_p))
        self._processors = processors

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``."""
        return self._params.temperature == 0

    @property
    def generator(self) -> torch.Generator | None:
        """The RNG passed at construction."""
        return self._generator

    def process(self, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Apply the processors.

        Args:
            history: ``[S]`` int64 token ids seen so far.
            logits: ``[V]`` raw next-token logits.

        Returns:
            ``[V]`` float32 processed logits (excluded tokens are ``-inf``).
        """
        scores = logits.float()
        if not self._processors:
            return scores
        return self._processors(history.unsqueeze(0), scores.unsqueeze(0)).squeeze(0)
