"""Auto-truncation (``--auto-truncate``): keeping the end of each prompt the admission gate says is too long.

The kept part is the *end* of each prompt (the latest messages and the generation prompt); what was dropped
is reported in the response body (``prompt_truncation``) and in the :data:`TRUNCATION_HEADER` header.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from kvb_server.engine import ServingEngine
from kvb_server.request_plan import GenerationPlan

#: Response header carrying how many prompt tokens auto-truncation dropped (summed over prompts).
TRUNCATION_HEADER = "X-KVBoost-Prompt-Tokens-Dropped"


class Truncation(NamedTuple):
    """What auto-truncation did to a request: each prompt's original length and what was kept."""

    original_tokens: tuple[int, ...]
    kept_tokens: tuple[int, ...]

    @property
    def dropped(self) -> int:
        return sum(o - k for o, k in zip(self.original_tokens, self.kept_tokens))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kept": "last_tokens",
            "original_prompt_tokens": list(self.original_tokens),
            "prompt_tokens": list(self.kept_tokens),
            "dropped_tokens": self.dropped,
        }

    def headers(self) -> dict[str, str]:
        return self.header_for(self.dropped)

    @staticmethod
    def header_for(dropped: int) -> dict[str, str]:
        return {TRUNCATION_HEADER: str(dropped)}


class Truncated(NamedTuple):
    """A plan after auto-truncation, and what was dropped (None: every prompt fit)."""

    plan: GenerationPlan
    truncation: Truncation | None


def keep_last_tokens(plan: GenerationPlan, keep: int | None, engine: ServingEngine | None) -> Truncated:
    """Keep the last ``keep`` tokens of each prompt (None: keep everything).

    An echoed prompt is echoed as the model saw it: the kept tokens, decoded by ``engine``'s tokenizer (when
    the caller holds no engine, the echo stays the original text).
    """
    if keep is None or not any(len(p) > keep for p in plan.prompts):
        return Truncated(plan, None)
    kept = tuple(p[-keep:] for p in plan.prompts)
    truncation = Truncation(tuple(len(p) for p in plan.prompts), tuple(len(p) for p in kept))
    plan = dataclasses.replace(plan, prompts=kept)
    if plan.echo is not None and engine is not None:
        plan = dataclasses.replace(plan, echo=tuple(engine.tokenizer.decode(p) for p in kept))
    return Truncated(plan, truncation)
