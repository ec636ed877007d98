"""OpenAI's ``echo`` on ``/v1/completions``: the prompt repeated before each choice's text.

With ``logprobs`` the prompt's own tokens are scored as well (the first one ``null``: nothing precedes it),
which is how evaluation harnesses ask a completions server for a loglikelihood: lm-eval's
``local-completions`` sends ``echo: true, logprobs: 1, max_tokens: 1`` and sums ``token_logprobs`` over
the continuation's tokens. ``max_tokens: 0`` scores the prompt and generates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvb_cache.results import GenerationResult, TokenLogprob


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo:
    """What one prompt contributes to each of its choices."""

    text: str
    #: The text of the prompt's first token (it has no log-probability).
    first_token: str
    #: The prompt's tokens after the first (``KVBoost.prompt_logprobs``); None: logprobs not requested.
    logprobs: tuple[TokenLogprob, ...] | None = None

    def logprob_arrays(self, offset: int = 0) -> tuple[dict[str, list[Any]], int]:
        """OpenAI's completions-style arrays for the prompt tokens, starting at text offset ``offset``, and
        the offset after them (where the generated tokens' offsets continue)."""
        assert self.logprobs is not None
        arrays: dict[str, list[Any]] = {
            "tokens": [self.first_token],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [offset],
        }
        offset += len(self.first_token)
        for e in self.logprobs:
            arrays["tokens"].append(e.token)
            arrays["token_logprobs"].append(e.logprob)
            arrays["top_logprobs"].append({text: lp for _, text, lp in e.top})
            arrays["text_offset"].append(offset)
            offset += len(e.token)
        return arrays, offset


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
