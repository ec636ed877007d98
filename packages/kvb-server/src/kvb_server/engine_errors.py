"""What the client gets when the engine raises: each engine exception mapped to its HTTP error."""

from __future__ import annotations

import logging

import torch

from kvb_cache.errors import CacheBusyError, ContextLengthError, InvalidRequestError, PromptTypeError
from kvb_cache.results import GenerationResult
from kvb_server.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    CacheBusyConflictError,
    EngineError,
    InvalidParameterError,
    OutOfMemoryDuringRunError,
    ServerError,
)

logger = logging.getLogger(__name__)


def engine_error(exc: BaseException) -> ServerError:
    """Map an exception raised by the engine to the HTTP error the client gets."""
    if isinstance(exc, ServerError):
        return exc
    if is_out_of_memory(exc):
        logger.error("engine ran out of memory: %r", exc)
        return OutOfMemoryDuringRunError(exc)
    if isinstance(exc, CacheBusyError):
        return CacheBusyConflictError(f"The cache was not reset: {exc}.")
    if isinstance(exc, ContextLengthError):
        return InvalidParameterError(str(exc), param="max_tokens", code=CONTEXT_LENGTH_EXCEEDED)
    if isinstance(exc, InvalidRequestError | PromptTypeError):
        return InvalidParameterError(str(exc), param=_openai_param(exc.param))
    logger.error("engine failed: %r", exc, exc_info=exc)
    return EngineError(f"The engine failed while serving this request: {type(exc).__name__}: {exc}")


def grammar_failure(
    result: GenerationResult, *, tools: bool, field: str = "response_format"
) -> InvalidParameterError | None:
    """The 400 of a choice whose grammar (``response_format``, or the tool-call grammar when ``tools``)
    failed while decoding, or None.

    The engine ends such a choice as ``"stop"`` with text that does not complete the grammar; served as is,
    a client asking for a schema would get an answer that silently breaks it. The grammar is the client's
    (it outgrew the grammar library's limits), hence 400, not 500.
    """
    error = getattr(result, "grammar_error", None)  # engines that never fail a grammar may lack the field
    if error is None:
        return None
    param = "tools" if tools else field  # the field the constraint came in (guided_regex, ...)
    if "NoExtensionBias" in str(error):  # llguidance's word for "no token can continue": nothing matches
        return InvalidParameterError(
            f"The {param} grammar admits no output: no text matches it (an empty regex class, a schema whose "
            f"$ref loops back to itself with nothing in between, ...) ({error}).",
            param=param,
        )
    return InvalidParameterError(
        f"The {param} grammar could not be followed while decoding ({error}); the output would not match "
        "it. Use a simpler schema, regex or grammar (fewer alternatives, smaller repetition counts).",
        param=param,
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's out-of-memory error (host or CUDA)."""
    # CUDA raises its own type; the CPU allocator raises a RuntimeError naming itself.
    return isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    )


def _openai_param(param: str | None) -> str | None:
    return {"max_new_tokens": "max_tokens", "logprobs": "logprobs"}.get(param or "", param)
