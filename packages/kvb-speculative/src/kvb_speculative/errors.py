"""The exceptions kvb-speculative raises. Every one derives from :class:`SpeculativeError`.

User mistakes also subclass ``ValueError`` (or ``RuntimeError`` for cache states), so callers that only
know the builtins still catch them; each message says what to change.
"""

from __future__ import annotations


class SpeculativeError(Exception):
    """Base class of every error raised by kvb-speculative."""


class SpeculativeConfigError(SpeculativeError, ValueError):
    """A speculative-decoding setting is out of range or inconsistent (the message names the fix)."""


class VocabularyMismatchError(SpeculativeError, ValueError):
    """The draft model does not share the target's vocabulary (sizes or special tokens differ).

    Attributes:
        mismatches: one human-readable line per differing property, e.g.
            ``"eos_token_id: target [2] != draft [0]"``.
    """

    def __init__(self, mismatches: tuple[str, ...]) -> None:
        self.mismatches = mismatches
        lines = "\n  ".join(mismatches)
        super().__init__(
            "The draft model's vocabulary differs from the target's, so its tokens cannot be verified:\n  "
            f"{lines}\nUse a draft model trained with the target's tokenizer (same family, smaller size), "
            "or use speculative='prompt_lookup', which needs no draft model."
        )


class CacheRollbackError(SpeculativeError, RuntimeError):
    """A ``transformers.Cache`` could not be cut back to the accepted length after a partial acceptance."""


class NonFiniteLogitsError(SpeculativeError, ArithmeticError):
    """The target's processed logits for a committed position hold NaN (a numerical overflow, usually of
    float16 activations): no token can be committed honestly (``argmax`` would return the NaN's index, a
    sample would come from an undefined distribution), so decoding stops with this error."""

    def __init__(self) -> None:
        super().__init__(
            "the target model's logits hold NaN (a numerical overflow, usually of float16 activations); "
            "load the model in bfloat16 or float32"
        )
