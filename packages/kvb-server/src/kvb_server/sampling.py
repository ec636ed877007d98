"""Per-choice sampling settings, as the engine receives them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one choice is generated (OpenAI's parameters after defaults and server caps are applied).

    Attributes:
        max_new_tokens: generated tokens before ``finish_reason == "length"``.
        temperature: 0 is greedy; OpenAI's default is 1.
        top_p: nucleus mass in ``(0, 1]``.
        presence_penalty / frequency_penalty: OpenAI's additive penalties in ``[-2, 2]``.
        stop: up to four strings that end generation (not included in the output).
        seed: makes sampling reproducible; ``None`` draws fresh randomness.
        logprobs: ``None``: no logprobs; ``k >= 0``: the chosen token's logprob and ``k`` alternatives.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")

    def for_choice(self, index: int) -> SamplingParams:
        """Settings of choice ``index`` of an ``n > 1`` request: each choice gets its own seed (seed + index)."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + index)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``KVBoost.generate``/``stream`` and the per-prompt dicts of ``generate_batch``."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": list(self.stop) or None,
            "seed": self.seed,
            "logprobs": self.logprobs,
        }
