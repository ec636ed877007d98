"""What the planner is asked about: one generation request, described by its token counts."""

from __future__ import annotations

from dataclasses import dataclass

from kvb_planner.errors import PlannerConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """The memory-relevant facts of one request (no text: the caller has already tokenized).

    Attributes:
        prompt_tokens: Prompt length per sequence, in tokens (>= 1).
        max_new_tokens: Tokens the request may generate (>= 0); their KV is reserved up front.
        batch_size: Sequences decoded together (>= 1), each of ``prompt_tokens`` tokens.
        auto_truncate: When nothing on the ladder fits, or prompt + ``max_new_tokens`` exceed the model's
            context length (``ModelShape.context_length``), plan a truncated prompt (keeping its last
            tokens) instead of refusing.
        prompt_logprobs: The caller needs logits for every prompt position (echo/logprobs), so each
            prefill slice materialises ``[batch, slice, vocab]`` logits instead of ``[batch, 1, vocab]``.
    """

    prompt_tokens: int
    max_new_tokens: int
    batch_size: int = 1
    auto_truncate: bool = False
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "max_new_tokens", "batch_size"):
            value = getattr(self, name)
            # NOTE: 100.5 passed the range checks and the binary search then planned fractional prompts; a
            # string failed the comparison with an untyped TypeError.
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlannerConfigError(f"{name} must be an int, got {value!r}")
        if self.prompt_tokens < 1:
            raise PlannerConfigError(
                f"prompt_tokens must be >= 1 (got {self.prompt_tokens}); an empty prompt has nothing to plan"
            )
        if self.max_new_tokens < 0:
            raise PlannerConfigError(f"max_new_tokens must be >= 0 (got {self.max_new_tokens})")
        if self.batch_size < 1:
            raise PlannerConfigError(f"batch_size must be >= 1 (got {self.batch_size})")

    @property
    def total_tokens(self) -> int:
        """Prompt plus generated tokens per sequence: the KV length the request can reach."""
        return self.prompt_tokens + self.max_new_tokens
