"""The exceptions kvb-server raises, each mapped to an HTTP status and OpenAI's error body.

OpenAI clients read ``{"error": {"message", "type", "param", "code"}}`` and pick the exception class from
the status code (400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``, ...), so
every error here carries both.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

#: OpenAI's error code for a prompt (or prompt plus max_tokens) beyond the context window: clients match it
#: to shorten the conversation and retry.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ServerError(Exception):
    """Base class of every error raised by kvb-server; renders as an OpenAI-style error response."""

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    #: HTTP headers the response carries (``Retry-After`` for overload; OpenAI's SDKs read both below).
    headers: ClassVar[Mapping[str, str] | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: The request parameter at fault (OpenAI's ``param``), when there is one.
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI returns for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidParameterError(ServerError):
    """A request parameter is missing, of the wrong type or out of range (400)."""

    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedFeatureError(InvalidParameterError):
    """The request asks for a feature this server does not implement (tools, response_format, ...)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message, param=param, code="unsupported_parameter")


class AuthenticationError(ServerError):
    """``--api-key`` is set and the request's Bearer token is missing or wrong (401)."""

    status_code = 401
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class UnsupportedMediaTypeError(ServerError):
    """The body is not JSON by its ``Content-Type``, or is compressed (``Content-Encoding``) (415)."""

    status_code = 415
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="unsupported_media_type")


class PermissionDeniedError(ServerError):
    """The API key is valid but may not use this route (403), e.g. a tenant key on the cache reset route."""

    status_code = 403
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="permission_denied")


class ModelNotFoundError(ServerError):
    """The request names a model this server does not serve (404)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it. "
            f"This server serves: {', '.join(served)}.",
            param="model",
            code="model_not_found",
        )


class RequestTooLargeError(ServerError):
    """An admission gate (e.g. the memory planner) refused the request before it was queued (413)."""

    status_code = 413
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        param: str | None = None,
        fields: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, param=param, code="request_too_large")
        self.details = dict(details or {})
        #: Extra members of the ``error`` object (the planner's numbers), next to message/type/param/code.
        self.fields = {
            k: v for k, v in (fields or {}).items() if k not in ("message", "type", "param", "code")
        }

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"].update(self.fields)
        if self.details:
            body["error"]["details"] = self.details
        return body


class OutOfMemoryDuringRunError(RequestTooLargeError):
    """The engine ran out of memory while serving the request (413, or the final SSE event once streaming).

    The planner predicts memory before a request runs; this is what a wrong prediction looks like.
    """

    def __init__(self, cause: BaseException) -> None:
        super().__init__(
            f"The server ran out of memory while serving this request ({type(cause).__name__}). Retry with a "
            "shorter prompt or a lower max_tokens."
        )


class CacheBusyConflictError(ServerError):
    """The cache cannot be reset while requests are running or waiting (409); retry when idle."""

    status_code = 409
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="cache_busy")


#: The overload answers' ``Retry-After``: the openai SDKs wait this long (their own backoff otherwise).
RETRY_AFTER: Mapping[str, str] = MappingProxyType({"Retry-After": "1"})
#: Read by the openai SDKs (Python and Node): do not retry this response.
NO_RETRY: Mapping[str, str] = MappingProxyType({"x-should-retry": "false"})


class QueueFullError(ServerError):
    """The request queue is full (503); the client should retry later."""

    status_code = 503
    error_type = "server_overloaded"
    headers = RETRY_AFTER

    def __init__(self, max_queue_size: int) -> None:
        super().__init__(
            f"The server is overloaded: {max_queue_size} requests are already queued. Retry shortly, "
            "or start the server with a larger --max-queue-size.",
            code="queue_full",
        )


class SharedStepOutOfMemoryError(ServerError):
    """The engine ran out of memory in a step several requests shared (503, retryable): which of them
    needed the memory is unknown, and a small request that merely shared the step is not too large, so
    they are not answered 413 (a client error the openai SDKs do not retry)."""

    status_code = 503
    error_type = "server_overloaded"
    headers = RETRY_AFTER

    def __init__(self, cause: BaseException, *, sharing: int) -> None:
        super().__init__(
            f"The server ran out of memory ({type(cause).__name__}) in a step shared by {sharing} requests. "
            "Retry shortly.",
            code="out_of_memory",
        )


class ShuttingDownError(ServerError):
    """The server is shutting down and takes no new work (503); retry against another replica or later."""

    status_code = 503
    error_type = "server_overloaded"
    headers = RETRY_AFTER

    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down and accepts no new requests. Retry shortly.", code="shutting_down"
        )


class EngineDeadError(ServerError):
    """The engine thread has stopped after an internal error (503): this process serves nothing more, and
    ``/health`` says so, so that a supervisor restarts it (vLLM's ``EngineDeadError``)."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, cause: BaseException | None = None) -> None:
        reason = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        super().__init__(
            f"The server's engine loop has stopped after an internal error{reason}; this server must be "
            "restarted (see its log).",
            code="engine_dead",
        )


class RequestTimeoutError(ServerError):
    """The request did not finish within ``--request-timeout`` seconds (504)."""

    status_code = 504
    error_type = "timeout_error"
    # The openai SDKs retry a 504 twice by default, each retry costing another --request-timeout of engine
    # time; a request that took too long under load is not worth repeating blindly.
    headers = NO_RETRY

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"The request did not complete within {timeout_s:g} s (--request-timeout). Ask for fewer "
            "tokens, retry when the server is less busy, or raise --request-timeout.",
            code="timeout",
        )


class EngineError(ServerError):
    """The engine failed while serving the request (500); the message is the engine's."""
