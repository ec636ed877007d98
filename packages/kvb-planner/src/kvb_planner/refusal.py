"""Why a request was refused, in a form an HTTP layer can send verbatim (OpenAI-style 413 body, or a 400
when the request exceeds the model's context length)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvb_planner.units import to_mb

#: OpenAI-style ``error.type`` and ``error.code`` of a refusal.
ERROR_TYPE = "invalid_request_error"
ERROR_CODE = "request_too_large_for_memory"
#: ``error.code`` when prompt + max_new_tokens exceed the model's context length (OpenAI's, as kvb-server's).
CONTEXT_ERROR_CODE = "context_length_exceeded"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRefusal:
    """A request no ladder step can fit, or one longer than the model's context length.

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
        context_length: The model's context length (``ModelShape.context_length``), None when unknown. Both
            suggestions stay within it (prompt <= context - max_new_tokens, new tokens <= context - prompt).
        step_bound: Planned for a paged engine loop (``PagedLoop``) and nothing shorter fits: one full step of
            the engine needs more than the budget whatever the request, so the message names the server's
            step limits instead of the request's lengths.
    """

    prompt_tokens: int
    max_new_tokens: int
    predicted_peak_bytes: int
    free_bytes: int
    budget_bytes: int
    suggested_max_tokens: int
    suggested_max_new_tokens: int
    context_length: int | None = None
    step_bound: bool = False

    @property
    def exceeds_context(self) -> bool:
        """Whether prompt + max_new_tokens exceed the model's context length (then ``code`` says so)."""
        limit = self.context_length
        return limit is not None and self.prompt_tokens + self.max_new_tokens > limit

    @property
    def code(self) -> str:
        """``error.code``: ``context_length_exceeded`` over the context, else ``request_too_large_for_memory``."""
        return CONTEXT_ERROR_CODE if self.exceeds_context else ERROR_CODE

    @property
    def message(self) -> str:
        """A sentence for humans that says what to change."""
        if self.exceeds_context:
            return self._context_message()
        text = (
            f"Request needs about {to_mb(self.predicted_peak_bytes)} MB but only {to_mb(self.budget_bytes)} MB "
            f"of {to_mb(self.free_bytes)} MB free may be used."
        )
        if self.suggested_max_tokens:
            text += f" Shorten the prompt to at most {self.suggested_max_tokens} tokens"
            if self.suggested_max_new_tokens:
                text += f" or lower max_tokens to at most {self.suggested_max_new_tokens}"
            return text + "."
        if self.step_bound:
            return text + (
                " That is one full step of the server's engine (its max_num_batched_tokens and max_num_seqs), "
                "needed whatever the request: a limit of the server's configuration or of its free memory, "
                "not of this request."
            )
        return text + f" Lower max_tokens (now {self.max_new_tokens}); even a one-token prompt does not fit."

    def _context_message(self) -> str:
        # Worded as kvb-server's own context error (sampling_params.max_new_tokens), plus what would fit.
        text = (
            f"This model's maximum context length is {self.context_length} tokens. However, you requested "
            f"{self.prompt_tokens + self.max_new_tokens} tokens ({self.prompt_tokens} in the prompt, "
            f"{self.max_new_tokens} for the completion)."
        )
        prompt, new = self.suggested_max_tokens, self.suggested_max_new_tokens
        if prompt and new:
            return (
                text + f" Shorten the prompt to at most {prompt} tokens or lower max_tokens to at most {new}."
            )
        if prompt:
            return text + f" Shorten the prompt to at most {prompt} tokens."
        if new:
            return text + f" Lower max_tokens to at most {new}."
        return text + " Reduce the prompt and max_tokens."

    @property
    def param(self) -> str:
        """``error.param``: ``max_tokens`` when the prompt alone fits the context, else ``messages``."""
        if self.exceeds_context and self.prompt_tokens < self.context_length:  # type: ignore[operator]
            return "max_tokens"
        return "messages"

    def to_dict(self) -> dict[str, Any]:
        """OpenAI-style error body for an HTTP 413 (or the final SSE event; a ``context_length_exceeded`` one is
        what OpenAI sends as a 400): JSON-safe, no NaN/inf.

        ``context_length`` is a member only when known (a refusal from a shape without one keeps the old body).
        """
        error: dict[str, Any] = {
            "message": self.message,
            "type": ERROR_TYPE,
            "param": self.param,
            "code": self.code,
            "prompt_tokens": self.prompt_tokens,
            "max_new_tokens": self.max_new_tokens,
            "predicted_peak_mb": to_mb(self.predicted_peak_bytes),
            "free_mb": to_mb(self.free_bytes),
            "budget_mb": to_mb(self.budget_bytes),
            "suggested_max_tokens": self.suggested_max_tokens,
            "suggested_max_new_tokens": self.suggested_max_new_tokens,
        }
        if self.context_length is not None:
            error["context_length"] = self.context_length
        return {"error": error}
