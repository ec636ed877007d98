"""How a library call passed its arguments: the checks that turn a call shaped for another library (vLLM's
``generate(prompt, sampling_params)``, transformers' ``generate(**inputs)``) into its equivalent here or an
error naming it."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from kvb_cache.errors import InvalidRequestError, PromptTypeError
from kvb_cache.sampling import SamplingParams


def keyword_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """The defaults of ``fn``'s keyword-only parameters."""
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def changed_options(options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` not at their ``defaults`` (a name without a default counts as changed).

    Compared without trusting ``==``: an array or tensor passed where a number goes (refused later, with its
    name) made ``==`` raise NumPy's "truth value of an array is ambiguous"."""

    def same(value: Any, default: Any) -> bool:
        if value is default:
            return True
        try:
            return type(value) is type(default) and bool(value == default)
        except Exception:
            return False

    return {k: v for k, v in options.items() if k not in defaults or not same(v, defaults[k])}


def given_params(params: SamplingParams | None, options: dict[str, Any]) -> SamplingParams | None:
    """``params`` when a call passed a :class:`SamplingParams` (checked), None when it passed keywords.

    ``options``: the sampling keywords the call set besides it (any of them is an error: which one should win
    would be a guess)."""
    if params is None:
        return None
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling_params must be a kvb_cache.SamplingParams, got {type(params).__module__}."
            f"{type(params).__name__}; or pass its options as keywords (max_new_tokens=..., temperature=...)",
            param="sampling_params",
        )
    if options:
        raise InvalidRequestError(
            f"pass sampling options either in sampling_params or as keywords, not both (got {sorted(options)} "
            "beside sampling_params): dataclasses.replace(sampling_params, ...) makes a changed copy",
            param="sampling_params",
        )
    return params


def input_ids_given(method: str) -> PromptTypeError:
    """``generate(**tokenizer(text, return_tensors="pt"))``, as transformers' ``model.generate`` takes it
    (Python's own TypeError named the missing argument, not the fix); ``stream`` / ``warm`` /
    ``generate_batch`` alike."""
    if method == "generate_batch":
        return PromptTypeError(
            "KVBoost.generate_batch takes its prompts as its first argument (a list of texts or of token-id "
            "sequences), not input_ids= / attention_mask=: generate_batch([row for row in "
            "inputs['input_ids'].tolist()]) for an unpadded batch, or the texts themselves",
            param="prompts",
        )
    return PromptTypeError(
        f"KVBoost.{method} takes the prompt as its first argument (text, or one sequence of token ids), not "
        f"input_ids= / attention_mask=: {method}(inputs['input_ids'][0].tolist(), ...), or the text itself"
        + ("; several prompts go to generate_batch" if method != "warm" else "")
    )
