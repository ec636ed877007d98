"""Constrained field types the request models share (and the Responses API's request reuses).

Strict types (``"max_tokens": "10"`` is a 400, as on OpenAI) with OpenAI's and vLLM's ranges, integers that
also take a whole JSON number (``10.0``), and :func:`only`: the documented schema of a parameter declared only
to be refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema

STRICT = ConfigDict(strict=True, extra="forbid")

Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(ge=0.0, le=1.0)]
#: vLLM's top-k: keep the k most likely tokens; -1 or 0 turn the filter off. At most int64's largest: the
#: batched sampler puts every row's k in one int64 tensor, and a larger one raised there, failing the step
#: of every request decoding beside it (any k past the vocabulary keeps every token anyway).
TopK = Annotated[int, Field(ge=-1, lt=2**63)]
#: vLLM's (Hugging Face's) repetition penalty: divides the positive logits of every token seen; 1 is off.
#: Bounded so the penalized logits stay finite in float32 (``1e-308`` is 0 there: logits / 0 = inf, and
#: the softmax's NaN failed the step of every request decoding beside it); 1.0-2.0 is the useful range.
RepetitionPenalty = Annotated[float, Field(ge=1e-3, le=1e3, allow_inf_nan=False)]


def _whole_number(value: Any) -> Any:
    # JSON does not tell 10 from 10.0 (nor does JSON Schema's "integer"): a whole float is that integer.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Strict integers that also take a whole JSON number such as ``10.0`` (never ``"10"`` or ``true``). NOTE: the
# bounds come before the validator, so the JSON schema says "minimum" rather than pydantic's raw "ge".
WHOLE = BeforeValidator(_whole_number)
Int = Annotated[int, WHOLE]
MaxTokens = Annotated[int, Field(ge=1), WHOLE]
TokenId = Annotated[int, Field(ge=0), WHOLE]
NonEmpty = Annotated[str, Field(min_length=1)]
#: Stop strings one request may give. OpenAI takes 4, vLLM any number: lm-eval's local-completions sends a
#: task's every stop sequence plus the end-of-text token (often 5 or more). Bounded so that matching (each
#: string against the tail of the text, every token) stays cheap.
MAX_STOP_STRINGS = 64
Stop = NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)]
# torch seeds are 64-bit; choice i of n > 1 samples with seed + i, still inside torch's range.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**63), WHOLE]
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)]
#: OpenAI's processing tiers. This server has one, so a request naming any is answered with ``"default"``.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]
#: OpenAI's ``safety_identifier`` (a stable id of the application's end user, for abuse detection).
SafetyIdentifier = Annotated[str, Field(max_length=128)]
#: OpenAI's ``prompt_cache_retention``.
PromptCacheRetention = Literal["in_memory", "24h"]
#: OpenAI's ``verbosity`` (chat) / ``text.verbosity`` (Responses): a hint for the reply's length.
Verbosity = Literal["low", "medium", "high"]


def only(accepted: dict[str, Any], what: str) -> WithJsonSchema:
    """The documented schema of a parameter declared only to be refused by name: just the values this
    server accepts (validation itself stays loose, so the refusal names the parameter)."""
    return WithJsonSchema({**accepted, "description": f"Not supported: {what}; anything else is a 400."})


NULL: dict[str, Any] = {"type": "null"}


#: OpenAI's request ``metadata``: at most 16 pairs, keys up to 64 characters, values up to 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]
