"""Why a request was refused, in a form an HTTP layer can send verbatim (OpenAI-style 413 body)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvb_planner.units import to_mb

#: OpenAI-style ``error.type`` and ``error.code`` of a refusal.
ERROR_TYPE = "invalid_request_error"
ERROR_CODE = "request_too_large_for_memory"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRefusal:
    """A request no ladder step can fit.

    Attributes:
        prompt_tokens: Prompt length asked for.
        max_new_tokens: Generation length asked for.
        predicted_peak_bytes: The smallest predicted peak over all ladder steps.
        free_bytes: Free memory the profile reported.
        budget_bytes: ``free * (1 - safety_margin)``, what the peak had to fit in.
        suggested_max_tokens: Longest *prompt* (in tokens) that fits with the requested ``max_new_tokens``
            on some ladder step; 0 when not even one prompt token fits.
        suggested_max_new_tokens: Largest ``max_new_tokens`` (>= 1) that fits with the full prompt; 0 when
            none does.
    """

    prompt_tokens: int
    max_new_tokens: int
    predicted_peak_bytes: int
    free_bytes: int
    budget_bytes: int
    suggested_max_tokens: int
    suggested_max_new_tokens: int

    @property
    def message(self) -> str:
        """A sentence for humans that says what to change."""
        text = (
            f"Request needs about {to_mb(self.predicted_peak_bytes)} MB but only {to_mb(self.budget_bytes)} MB "
            f"of {to_mb(self.free_bytes)} MB free may be used."
        )
        if self.suggested_max_tokens:
            text += f" Shorten the prompt to at most {self.suggested_max_tokens} tokens"
            if self.suggested_max_new_tokens:
                text += f" or lower max_tokens to at most {self.suggested_max_new_tokens}"
            return text + "."
        return text + f" Lower max_tokens (now {self.max_new_tokens}); even a one-token prompt does not fit."

    def to_dict(self) -> dict[str, Any]:
        """OpenAI-style error body for an HTTP 413 (or the final SSE event): JSON-safe, no NaN/inf."""
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPE,
                "param": "messages",
                "code": ERROR_CODE,
                "prompt_tokens": self.prompt_tokens,
                "max_new_tokens": self.max_new_tokens,
                "predicted_peak_mb": to_mb(self.predicted_peak_bytes),
                "free_mb": to_mb(self.free_bytes),
                "budget_mb": to_mb(self.budget_bytes),
                "suggested_max_tokens": self.suggested_max_tokens,
                "suggested_max_new_tokens": self.suggested_max_new_tokens,
            }
        }
