"""The exceptions kvb-cache raises. Every one derives from :class:`KVBoostError`.

User mistakes subclass ``ValueError``/``TypeError`` as well, so callers that only know the builtins still
catch them; each message says what to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class KVBoostError(Exception):
    """Base class of every error raised by KVBoost."""


class InvalidRequestError(KVBoostError, ValueError):
    """A request argument is out of range or malformed (empty prompt, ``max_new_tokens <= 0``, ...)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        #: Name of the offending argument, for API layers that report it (OpenAI's ``param`` field).
        self.param = param


class UnknownOptionError(InvalidRequestError, TypeError):
    """An option name the API does not have (a ``TypeError`` too, as Python's own unexpected-keyword error);
    the message names the equivalent of a transformers / vLLM / OpenAI spelling where there is one."""


class PromptTypeError(KVBoostError, TypeError):
    """The prompt is not a string (or a list of token ids)."""

    def __init__(self, message: str, *, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt tokens plus ``max_new_tokens`` exceed the model's context window."""

    def __init__(self, message: str, *, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        super().__init__(message, param="max_new_tokens")
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length


class ModelLoadError(KVBoostError, OSError):
    """A model or tokenizer could not be loaded (unknown path, missing optional package, ...)."""


class UnsupportedModelError(KVBoostError):
    """The model's architecture cannot be served by the engine (the message names why)."""


class ConfigError(KVBoostError, ValueError):
    """An engine configuration value is invalid."""


class CacheBusyError(KVBoostError):
    """The cache cannot be reset now: running or waiting requests hold blocks (retry when the engine is
    idle, or abort them first)."""

    def __init__(self, message: str, *, running: int, waiting: int) -> None:
        super().__init__(message)
        self.running = running
        self.waiting = waiting


class NonFiniteLogitsError(KVBoostError, ArithmeticError):
    """The model's logits for a request hold NaN (a numerical overflow, usually of float16 activations):
    no token can be chosen honestly, so the request ends with this error instead of an arbitrary token."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "the model's logits for this request hold NaN (a numerical overflow, usually of float16 "
            "activations); load the model in bfloat16 or float32"
        )


class RequestInterruptedError(KVBoostError, RuntimeError):
    """A request was cut short by an exception that escaped the engine's step while it was being served (a
    ``KeyboardInterrupt``, or a signal handler's exception, during another caller's call): its token was
    part-way through being emitted, or it ran on kvb-speculative's solo path, whose generator cannot resume.
    Its stream cannot go on whole, so it ends with this error; send it again."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "the request was cut short by an exception raised while the engine stepped it (a "
            "KeyboardInterrupt or a signal handler's exception in another call); send it again"
        )


class RequestAbortedError(KVBoostError, RuntimeError):
    """The request a :meth:`~kvb_cache.KVBoost.generate` / :meth:`~kvb_cache.KVBoost.stream` call follows was
    dropped by :meth:`~kvb_cache.KVBoost.abort` (another thread, a server's cancel) before it finished."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} was aborted (engine.abort) before it finished")
        self.request_id = request_id


def check_utf8(text: str, param: str) -> None:
    """Raise :class:`InvalidRequestError` naming ``param`` when ``text`` is not valid UTF-8: an unpaired
    surrogate, what ``json.loads('"\\ud800"')`` gives for an emoji a client split. The Rust tokenizer raised
    a bare TypeError on it ("TextEncodeInput must be Union[...]"), hashing a UnicodeEncodeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} holds an unpaired surrogate {text[exc.start]!r} at index {exc.start}, which is not valid "
            "UTF-8; fix the client's encoding (or replace it: text.encode('utf-8', 'replace').decode())",
            param=param,
        ) from None


@contextlib.contextmanager
def naming_item(index: int, name: str = "prompts") -> Iterator[None]:
    """Prefix the message of a :class:`KVBoostError` raised inside with ``name[index]: ``, so an error about
    one item of a batch says which (its type and attributes are kept)."""
    try:
        yield
    except KVBoostError as exc:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{name}[{index}]: {exc.args[0]}", *exc.args[1:])
        raise
